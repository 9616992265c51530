"""Checkpoints on the ranks: save, resume and warm start with ``torch.distributed.checkpoint``.

Every rank of a run sees ``SPARKTORCH_CHECKPOINT_DIR`` (:data:`CHECKPOINT_DIR_ENV`), a local
path or an fsspec URL (``file:///x``, ``s3://bucket/x``, ``memory://x``) that every rank can
reach (a shared file system or an object store; a plain local path only serves a single node).
Inside the training function::

    state = TrainingState(model, optimizer, epoch=0)   # or {"model": model, "optim": optimizer}
    start = load_latest(state)                         # resume (or warm start); None: fresh
    for step in range(0 if start is None else start + 1, steps):
        ...
        save(state, step)                              # every rank calls it

The layout under the directory, one checkpoint per step::

    <dir>/step-000000002/.metadata         DCP's metadata, written by rank 0 last
    <dir>/step-000000002/__0_0.distcp      rank 0's data: its shards and its share of the
    <dir>/step-000000002/__1_0.distcp      replicated values, one file per rank
    <dir>/step-000000002/reports.json      rank 0's report() records up to this step
    <dir>/step-000000002/COMMITTED         {"step": 2, "world_size": 2, "time": ..., "torch": ...}

A replicated state of at most 32 MiB (as under DDP) is one file instead of DCP's::

    <dir>/step-000000002/state.pt          torch.save of the state dict, by rank 0 alone

Guarantees:

* **A step directory counts only with its ``COMMITTED`` marker**, which rank 0 writes after
  every rank's data and DCP's metadata were written (DCP's save ends with a collective that
  waits for all ranks). A replicated state (no ``DTensor``, ``ShardedTensor`` or FSDP1 module;
  every rank holds it whole, as under DDP) of at most 32 MiB is written by rank 0 alone,
  with one ``torch.save`` and without DCP's collectives or planning: for a small state these
  cost more than the write; the marker still waits for every rank to have reached the save,
  and loading it into a sharded model (FSDP) shards it as a full state dict. A run killed in
  the middle of a save leaves a step directory without the marker: :func:`load_latest` and
  :func:`latest_step` skip it, and it is deleted by the next save of the same step or by
  pruning once a newer checkpoint is committed.
* :func:`save` returns on every rank only after the marker was written and old checkpoints
  pruned (the newest ``keep`` committed ones stay; other files under the directory are never
  touched). A step is written once: saving a committed step again, or one this process saved
  already, raises :class:`~sparktorch_ops.errors.ConfigError`.
* ``save(state, step, blocking=False)`` returns once the state is copied (to CPU memory) and
  writes, commits and prunes in the background while training goes on, with the same
  guarantees: DCP's ``async_save`` writes on a process group of its own (gloo), so its
  collectives never interleave with the training's, and the commit runs when the write
  completes. A state rank 0 writes alone is one ``torch.save`` on a thread of its own (the
  other ranks copy nothing; they only join the two small collectives of the commit).
  At most one save is in flight per rank: the next :func:`save`, :func:`load_latest`,
  :func:`wait` and the end of the training function first wait for it. Call :func:`wait`
  before ``torch.distributed.destroy_process_group()``: a save whose process group is
  destroyed under it is not committed. A background failure is raised there as
  :class:`~sparktorch_ops.errors.CheckpointError` (naming the rank and the step), so it fails
  the run; it is also logged when it happens (in the driver's log, at WARNING). A rank
  killed while a save is in flight leaves that step uncommitted: a restart resumes the one
  before.
* Checkpoints reshard: each rank writes only its own shards (FSDP2 ``DTensor``\\ s) and the
  metadata records global shapes, so a checkpoint written by N ranks loads on M ranks, or in
  one plain process.
* Decisions (which step to resume, whether a step is already committed) are taken by rank 0
  and broadcast, so every rank does the same thing even on an eventually consistent store.
  A process lists a directory at its first save there; its later saves keep that listing up
  to date instead of listing again (one training writes a directory).
* **No metric lost to a crash**: a checkpoint carries rank 0's ``report()`` records up to its
  step (``reports.json``), and a resume sends them again, marked as replayed: the driver logs
  to MLflow those steps its run lacks (the orchestrator's process may have died before it
  sent them). Steps trained again after the resumed checkpoint are reported again.

State: a :class:`TrainingState` or a dict. In a dict, ``torch.nn.Module`` values are saved
through ``get_model_state_dict`` (no DDP ``module.`` prefix, sharded FSDP2 state) and
``torch.optim.Optimizer`` values through ``get_optimizer_state_dict``, paired with the module
of the dict whose parameters they hold; tensors are loaded in place, and other values (ints,
floats, strings, nested dicts of those) are replaced in the dict by their saved values.
Modules and optimizers must be top-level values. Every rank must pass the same keys, and
values other than sharded ones are taken to be the same on every rank (DCP writes one copy of
each, spread over the ranks): a value that differs by rank comes back as one rank's value.
Random number generator states are saved only when put in the state.

Without a process group (one plain process) save and load run in that process alone; with
``WORLD_SIZE`` > 1 they need ``torch.distributed.init_process_group`` first.

The package's modules, one job each: :mod:`.state` (what is saved), :mod:`.storage` (the files
on disk, local or fsspec), :mod:`.saving` (writing, in the foreground or the background),
:mod:`.loading` and :mod:`.warm_start` (reading), :mod:`.reports` (the metrics a checkpoint
carries), :mod:`.group` (the ranks).
Only the standard library is imported here at import time; torch and fsspec when used.
"""

from __future__ import annotations

from sparktorch_ops.checkpoint.loading import latest_step, load_latest
from sparktorch_ops.checkpoint.reports import REPORTS_FILE
from sparktorch_ops.checkpoint.saving import save, wait
from sparktorch_ops.checkpoint.state import TrainingState
from sparktorch_ops.checkpoint.storage import (
    COMMIT_MARKER,
    STATE_FILE,
    checkpoint_dir,
    step_dir_name,
)
from sparktorch_ops.checkpoint.warm_start import warm_start
from sparktorch_ops.wire.env import CHECKPOINT_DIR_ENV, WARM_START_ENV

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "COMMIT_MARKER",
    "REPORTS_FILE",
    "STATE_FILE",
    "WARM_START_ENV",
    "TrainingState",
    "checkpoint_dir",
    "latest_step",
    "load_latest",
    "save",
    "step_dir_name",
    "wait",
    "warm_start",
]
