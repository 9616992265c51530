"""Checkpoints on the ranks: save and load times of ``sparktorch_ops.checkpoint``, and the cost
of a save next to a training step of the example model.

Three parts, each on a temporary directory on local disk (deleted at the end):

- **One process** (no process group): for each size in ``--sizes`` (MiB of float32, in
  ``--chunk-mib`` tensors of an ``nn.ParameterList``, random values), ``save(TrainingState(
  model), 0)`` into a fresh directory, then ``load_latest`` into the same model after zeroing
  it (checked against checksums). ``torch.save`` (then ``fsync``) / ``torch.load`` +
  ``load_state_dict`` of the same state is measured alongside as a reference; the two
  alternate round by round. A discarded first round on a 1 MiB state takes the one-time costs
  (imports, DCP's first call); its times are kept apart.
- **Two ranks**: ``TorchDistributor(num_processes=2, local_mode=True, use_gpu=False,
  checkpoint_dir=DIR)``; every rank wraps the same model in DDP (so the state is replicated,
  and DCP writes one copy, spread over the ranks), and times its own ``save`` and
  ``load_latest`` between barriers (a fresh step directory under ``DIR`` per repeat). Rank 0's
  time and the slowest rank's are reported.
- **Save vs training step**: ``DigitsCNN`` of ``examples/ddp_train.py``, batch 64 of random
  1x8x8 inputs, SGD with momentum: the median time of one step (forward, backward, optimizer
  step) and of ``save(TrainingState(model, optimizer, losses=[...]), step)`` (``keep=3``, as
  the example saves every epoch), in one process with ``--threads`` torch threads (default:
  cores / 2, what a rank of a 2-rank local run gets) and on 2 DDP ranks. The per-epoch
  overhead assumes the pipeline's epoch: 1200-1800 rows over 2 ranks at batch 64, i.e.
  10-15 steps per rank (``--epoch-steps``).
- **Epochs, saving or not**: the same model on 2 DDP ranks trains ``--epoch-rounds`` rounds of
  ``--epochs`` epochs of ``--epoch-length`` steps per rank under each of three variants,
  alternating round by round (the order rotated): no checkpoint, ``save(...)`` at the end of
  every epoch, and ``save(..., blocking=False)`` (written in the background while the next
  epoch trains). A round's time runs from a barrier to the last save committed (``wait()``),
  then a barrier. The overhead is each round's time over the same round's no-checkpoint
  time, then the median (and min-max) over rounds.

Sizes are MiB (2**20 bytes); MiB/s is the state's size over the time. Loads read files that
the save just wrote, so they come from the page cache; saves ``fsync`` their files (DCP's
``FileSystemWriter`` default).

    python benchmarks/checkpoint.py --sizes 100,1000 --repeats 3
    python benchmarks/checkpoint.py --quick
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import common
import pages
from common import log, median, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

NAME = "checkpoint"
EXAMPLE = common.ROOT / "examples" / "ddp_train.py"
BATCH = 64


# -- helpers shared by the driver process and the ranks (no benchmark module in them) --------
def make_state(mib: int, chunk_mib: int, seed: int = 0) -> Any:
    """An ``nn.ParameterList`` of float32 random tensors, ``mib`` MiB in all."""
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(seed)
    total = mib * 2**20 // 4
    chunk = max(1, chunk_mib * 2**20 // 4)
    params = []
    while total > 0:
        n = min(chunk, total)
        params.append(nn.Parameter(torch.randn(n, generator=generator)))
        total -= n
    return nn.ParameterList(params)


def checksums(module: Any) -> list[float]:
    """One float64 sum per tensor: enough to tell a loaded state from a zeroed one."""
    import torch

    return [float(p.detach().sum(dtype=torch.float64)) for p in module.parameters()]


def zero(module: Any) -> None:
    """Overwrite every parameter with zeros, in place (so a load has to bring the values)."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.zero_()


def tree_bytes(path: str) -> tuple[int, int]:
    """(bytes, files) under ``path``."""
    total = files = 0
    for folder, _dirs, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(folder, name))
            files += 1
    return total, files


def quiet() -> Any:
    """A logger for ``load_latest``'s one line (dropped)."""
    import logging

    logger = logging.getLogger("bench.checkpoint.quiet")
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


def load_example(path: str) -> Any:
    """``examples/ddp_train.py`` as a module (for ``DigitsCNN``)."""
    spec = importlib.util.spec_from_file_location("ddp_train_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- one process ---------------------------------------------------------------------------
def dcp_once(model: Any, directory: str, expected: list[float]) -> dict[str, Any]:
    """sparktorch_ops' save, then load_latest into the zeroed model; times and size on disk."""
    from sparktorch_ops.checkpoint import TrainingState, load_latest, save

    state = TrainingState(model)
    started = time.perf_counter()
    step_dir = save(state, 0, directory=directory)
    save_s = time.perf_counter() - started
    disk, files = tree_bytes(step_dir)
    zero(model)
    started = time.perf_counter()
    step = load_latest(state, directory=directory, log=quiet())
    load_s = time.perf_counter() - started
    if step != 0 or checksums(model) != expected:
        raise AssertionError("load_latest did not bring back the saved values")
    return {"save_s": save_s, "load_s": load_s, "disk_bytes": disk, "files": files}


def torch_save_once(model: Any, directory: str, expected: list[float]) -> dict[str, Any]:
    """Reference: torch.save + fsync of the state dict, torch.load + load_state_dict."""
    import torch

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "state.pt")
    started = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(model.state_dict(), handle)
        handle.flush()
        os.fsync(handle.fileno())
    save_s = time.perf_counter() - started
    disk = os.path.getsize(path)
    zero(model)
    started = time.perf_counter()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    load_s = time.perf_counter() - started
    if checksums(model) != expected:
        raise AssertionError("torch.load did not bring back the saved values")
    return {"save_s": save_s, "load_s": load_s, "disk_bytes": disk, "files": 1}


VARIANTS = {"sparktorch_ops (DCP)": dcp_once, "torch.save (reference)": torch_save_once}


def one_process(
    sizes: list[int], repeats: int, chunk_mib: int, root: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every size, the variants alternating per round; (first-call figures, results by size)."""
    warm_model = make_state(1, chunk_mib, seed=1)
    first = {}
    for name, once in VARIANTS.items():
        first[name] = once(warm_model, os.path.join(root, "warm", name[:5]), checksums(warm_model))
        log(
            f"first call, 1 MiB, {name}: save {first[name]['save_s']:.3f} s, load {first[name]['load_s']:.3f} s"
        )
    results: dict[str, Any] = {}
    for mib in sizes:
        log(f"one process: building a {mib} MiB state")
        model = make_state(mib, chunk_mib)
        expected = checksums(model)

        def once(name: str, model: Any = model, expected: list[float] = expected) -> Any:
            directory = tempfile.mkdtemp(prefix="one-", dir=root)
            try:
                return VARIANTS[name](model, directory, expected)
            finally:
                shutil.rmtree(directory, ignore_errors=True)

        series = common.alternate(
            {name: functools.partial(once, name) for name in VARIANTS},
            repeats,
            warmup=0,
            check=lambda _name, sample: dict(sample),
            settle_s=0,
        )
        samples = {name: s.extra for name, s in series.items()}
        results[str(mib)] = {
            name: summarize(mib, s, len(list(model.parameters()))) for name, s in samples.items()
        }
        del model
        gc.collect()
    return first, results


def summarize(mib: int, samples: list[dict[str, Any]], tensors: int) -> dict[str, Any]:
    """Medians, min/max and MiB/s of one variant at one size."""
    save = [s["save_s"] for s in samples]
    load = [s["load_s"] for s in samples]
    save_med, load_med = median(save), median(load)
    return {
        "state_mib": mib,
        "tensors": tensors,
        "disk_mib": samples[0]["disk_bytes"] / 2**20 if samples else None,
        "files": samples[0]["files"] if samples else None,
        "save_median_s": save_med,
        "save_min_s": min(save, default=None),
        "save_max_s": max(save, default=None),
        "save_mib_per_s": mib / save_med if save_med else None,
        "load_median_s": load_med,
        "load_min_s": min(load, default=None),
        "load_max_s": max(load, default=None),
        "load_mib_per_s": mib / load_med if load_med else None,
        "runs": len(samples),
        "samples": samples,
    }


# -- two ranks -----------------------------------------------------------------------------
def two_local_ranks(directory: str, timeout: float) -> Any:
    """The distributor of every 2-rank part: local mode, CPU, ``directory`` as checkpoint_dir."""
    return common.ours(checkpoint_dir=directory, timeout=timeout)


def rank_sizes(sizes: list[int], repeats: int, chunk_mib: int) -> Any:
    """On every rank: DDP-replicated states of each size, save/load timed per rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparktorch_ops.checkpoint import TrainingState, checkpoint_dir, load_latest, save

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = checkpoint_dir()
    assert root is not None, "SPARKTORCH_CHECKPOINT_DIR is not set"
    mine: dict[str, Any] = {"rank": rank, "sizes": {}}
    try:
        for label, mib, reps in [("first", 1, 1), *((str(m), m, repeats) for m in sizes)]:
            model = make_state(mib, chunk_mib, seed=0 if label != "first" else 1)
            expected = checksums(model)
            ddp = DistributedDataParallel(model)
            state = TrainingState(ddp)
            samples = []
            for index in range(reps):
                directory = os.path.join(root, f"ranks-{label}-{index}")
                dist.barrier()
                started = time.perf_counter()
                step_dir = save(state, 0, directory=directory)
                save_s = time.perf_counter() - started
                dist.barrier()
                disk, files = tree_bytes(step_dir)
                zero(model)
                dist.barrier()
                started = time.perf_counter()
                step = load_latest(state, directory=directory, log=quiet())
                load_s = time.perf_counter() - started
                ok = step == 0 and checksums(model) == expected
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(directory, ignore_errors=True)
                samples.append(
                    {
                        "save_s": save_s,
                        "load_s": load_s,
                        "disk_bytes": disk,
                        "files": files,
                        "ok": ok,
                    }
                )
            mine["sizes"][label] = samples
            del ddp, state, model
            gc.collect()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    finally:
        dist.destroy_process_group()
    return gathered


def two_ranks(
    sizes: list[int], repeats: int, chunk_mib: int, root: str, timeout: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run :func:`rank_sizes` on 2 local ranks; (first-call figures, results by size)."""
    directory = os.path.join(root, "ranks")
    os.makedirs(directory)
    ranks = two_local_ranks(directory, timeout).run(rank_sizes, sizes, repeats, chunk_mib)
    if not isinstance(ranks, list) or len(ranks) != 2:
        raise AssertionError(f"expected two ranks' figures, got {ranks!r:.200}")
    ranks.sort(key=lambda r: r["rank"])
    per_label: dict[str, Any] = {}
    for label in ranks[0]["sizes"]:
        runs = list(zip(*(r["sizes"][label] for r in ranks), strict=True))
        if not all(s["ok"] for run in runs for s in run):
            raise AssertionError(f"2 ranks, {label}: a load did not bring back the saved values")
        mib = 1 if label == "first" else int(label)
        save0 = [run[0]["save_s"] for run in runs]
        load0 = [run[0]["load_s"] for run in runs]
        save_max = [max(s["save_s"] for s in run) for run in runs]
        load_max = [max(s["load_s"] for s in run) for run in runs]
        per_label[label] = {
            "state_mib": mib,
            "disk_mib": runs[0][0]["disk_bytes"] / 2**20,
            "files": runs[0][0]["files"],
            "save_rank0_median_s": median(save0),
            "save_max_median_s": median(save_max),
            "save_mib_per_s": ratio(mib, median(save_max)),
            "load_rank0_median_s": median(load0),
            "load_max_median_s": median(load_max),
            "load_mib_per_s": ratio(mib, median(load_max)),
            "runs": len(runs),
            "per_rank": [r["sizes"][label] for r in ranks],
        }
    first = per_label.pop("first")
    return first, per_label


# -- save vs training step -----------------------------------------------------------------
def cnn_figures(example: str, steps: int, warmup: int, saves: int, directory: str | None) -> Any:
    """Step and save times of the example's DigitsCNN, here or on every rank (DDP when
    ``WORLD_SIZE`` > 1): this process's figures, or on ranks every rank's (gathered)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from sparktorch_ops.checkpoint import TrainingState, checkpoint_dir, save

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model: Any = load_example(example).DigitsCNN()
        if distributed:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        x = torch.randn(BATCH * 8, 1, 8, 8)
        y = torch.randint(0, 10, (BATCH * 8,))
        step_s: list[float] = []
        losses: list[float] = []
        for index in range(warmup + steps):
            lo = (index % 8) * BATCH
            started = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])
            loss.backward()
            optimizer.step()
            elapsed = time.perf_counter() - started
            if index >= warmup:
                step_s.append(elapsed)
            losses.append(float(loss.detach()))
        root = directory or checkpoint_dir()
        assert root is not None
        save_s: list[float] = []
        step_dir = ""
        for index in range(saves + 1):  # the first save is kept apart
            if distributed:
                dist.barrier()
            started = time.perf_counter()
            step_dir = save(
                TrainingState(model, optimizer, losses=losses[: index + 1]), index, directory=root
            )
            save_s.append(time.perf_counter() - started)
        disk, files = tree_bytes(step_dir)
        figures = {
            "rank": dist.get_rank() if distributed else 0,
            "torch_threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters()),
            "step_s": step_s,
            "first_save_s": save_s[0],
            "save_s": save_s[1:],
            "disk_bytes": disk,
            "files": files,
        }
        if not distributed:
            return figures
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, figures)
        return gathered
    finally:
        if distributed:
            dist.destroy_process_group()


EPOCH_VARIANTS = ("no checkpoint", "save every epoch", "save every epoch, blocking=False")


def epoch_rounds(example: str, epoch_length: int, epochs: int, rounds: int, idle_s: float) -> Any:
    """On every rank: rounds of ``epochs`` epochs per variant; rank 0's seconds per round.
    ``idle_s``: a sleep after every step, the CPU left idle as while a GPU computes."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from sparktorch_ops.checkpoint import TrainingState, checkpoint_dir, save, wait

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(load_example(example).DigitsCNN())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        x = torch.randn(BATCH * epoch_length, 1, 8, 8)
        y = torch.randint(0, 10, (BATCH * epoch_length,))
        root = checkpoint_dir()
        assert root is not None
        losses: list[float] = []
        seconds: dict[str, list[float]] = {name: [] for name in EPOCH_VARIANTS}
        step = 0
        for index in range(rounds + 1):  # round 0 warms up and is not counted
            order = EPOCH_VARIANTS[index % 3 :] + EPOCH_VARIANTS[: index % 3]
            for name in order:
                directory = os.path.join(root, f"epochs-{EPOCH_VARIANTS.index(name)}")
                dist.barrier()
                started = time.perf_counter()
                for _epoch in range(epochs):
                    for batch in range(epoch_length):
                        lo = batch * BATCH
                        optimizer.zero_grad()
                        loss = F.cross_entropy(model(x[lo : lo + BATCH]), y[lo : lo + BATCH])
                        loss.backward()
                        optimizer.step()
                        if idle_s:
                            time.sleep(idle_s)
                    losses.append(float(loss.detach()))
                    if name != EPOCH_VARIANTS[0]:
                        state = TrainingState(model, optimizer, losses=losses)
                        blocking = name == EPOCH_VARIANTS[1]
                        save(state, step, directory=directory, blocking=blocking)
                        step += 1
                wait()
                dist.barrier()
                if index > 0:
                    seconds[name].append(time.perf_counter() - started)
        return {"seconds": seconds, "threads": torch.get_num_threads()}
    finally:
        dist.destroy_process_group()


def epochs_part(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """:func:`epoch_setting` with CPU-bound steps, then with ``--idle-ms`` after each."""
    settings = [epoch_setting(args, root, 0.0)]
    if args.idle_ms:
        settings.append(epoch_setting(args, root, args.idle_ms))
    return {"settings": settings}


def epoch_setting(args: argparse.Namespace, root: str, idle_ms: float) -> dict[str, Any]:
    """Run :func:`epoch_rounds` on 2 local ranks; per variant its round times and overhead."""
    directory = os.path.join(root, f"epochs-idle-{idle_ms:g}")
    os.makedirs(directory)
    figures = two_local_ranks(directory, args.timeout).run(
        epoch_rounds,
        str(EXAMPLE),
        args.epoch_length,
        args.epochs,
        args.epoch_rounds,
        idle_ms / 1000,
    )
    seconds = figures["seconds"]
    base = seconds[EPOCH_VARIANTS[0]]
    variants: dict[str, Any] = {}
    for name in EPOCH_VARIANTS:
        per_round = [s / args.epochs for s in seconds[name]]
        ratios = [s / b for s, b in zip(seconds[name], base, strict=True)]
        variants[name] = {
            "epoch_median_s": median(per_round),
            "epoch_min_s": min(per_round),
            "epoch_max_s": max(per_round),
            "over_none_median": median(ratios),
            "over_none_min": min(ratios),
            "over_none_max": max(ratios),
            "round_s": seconds[name],
        }
        log(
            f"epochs (idle {idle_ms:g} ms per step), {name}: {median(per_round):.3f} s per epoch, "
            f"{median(ratios):.3f}x no checkpoint ({min(ratios):.3f}-{max(ratios):.3f})"
        )
    return {
        "idle_ms_per_step": idle_ms,
        "epoch_length": args.epoch_length,
        "epochs_per_round": args.epochs,
        "rounds": args.epoch_rounds,
        "torch_threads": figures["threads"],
        "variants": variants,
    }


def overhead(step_s: float | None, save_s: float | None, epoch_steps: list[int]) -> dict[str, Any]:
    """save / step, and a save's share of an epoch of each length (one save per epoch)."""
    per_epoch = {
        str(n): save_s / (save_s + n * step_s) if save_s and step_s else None for n in epoch_steps
    }
    return {
        "step_median_s": step_s,
        "save_median_s": save_s,
        "save_over_step": ratio(save_s, step_s),
        "save_share_of_epoch": per_epoch,
        "epoch_with_save_over_without": {
            str(n): (1 + save_s / (n * step_s)) if save_s and step_s else None for n in epoch_steps
        },
    }


def save_vs_step(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """The CNN part, one process then 2 DDP ranks."""
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        single = cnn_figures(
            str(EXAMPLE), args.steps, args.warmup_steps, args.saves, os.path.join(root, "cnn-one")
        )
    finally:
        torch.set_num_threads(threads_before)
    results: dict[str, Any] = {
        "one_process": {
            **single,
            **overhead(median(single["step_s"]), median(single["save_s"]), args.epoch_steps),
        }
    }
    if args.ranks:
        directory = os.path.join(root, "cnn-ranks")
        os.makedirs(directory)
        ranks = two_local_ranks(directory, args.timeout).run(
            cnn_figures, str(EXAMPLE), args.steps, args.warmup_steps, args.saves, None
        )
        ranks.sort(key=lambda r: r["rank"])
        # A DDP step and a collective save end together on both ranks: take the slower rank.
        step_max = [max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True)]
        save_max = [max(s) for s in zip(*(r["save_s"] for r in ranks), strict=True)]
        results["two_ranks"] = {
            "per_rank": ranks,
            "first_save_max_s": max(r["first_save_s"] for r in ranks),
            "disk_bytes": ranks[0]["disk_bytes"],
            "files": ranks[0]["files"],
            "torch_threads": ranks[0]["torch_threads"],
            "save_rank0_median_s": median(ranks[0]["save_s"]),
            **overhead(median(step_max), median(save_max), args.epoch_steps),
        }
    return results


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.epoch_steps = [int(s) for s in args.epoch_steps.split(",") if s.strip()]

    root = tempfile.mkdtemp(prefix="sparktorch-ckpt-bench-", dir=args.tmpdir)
    log(f"temporary directory {root}")
    try:
        first_one, one = one_process(sizes, args.repeats, args.chunk_mib, root)
        first_ranks: dict[str, Any] | None = None
        ranks: dict[str, Any] = {}
        if args.ranks:
            log("two ranks: sizes " + ",".join(map(str, sizes)))
            first_ranks, ranks = two_ranks(sizes, args.repeats, args.chunk_mib, root, args.timeout)
        log("save vs training step: DigitsCNN")
        cnn = save_vs_step(args, root)
        epochs = epochs_part(args, root) if args.ranks else None
    finally:
        shutil.rmtree(root, ignore_errors=True)

    payload = {
        "sizes_mib": sizes,
        "repeats": args.repeats,
        "chunk_mib": args.chunk_mib,
        "one_process": one,
        "one_process_first_call": first_one,
        "two_ranks": ranks,
        "two_ranks_first_call": first_ranks,
        "save_vs_step": cnn,
        "epochs": epochs,
        "assumptions": {
            "epoch_steps_per_rank": args.epoch_steps,
            "epoch": "1200-1800 rows per epoch over 2 ranks, batch 64: 10-15 steps per rank",
            "save_frequency": "one save per epoch (examples/ddp_train.py)",
        },
        "notes": (
            "Sizes in MiB; MiB/s = state size / median time. Loads read files just written "
            "(page cache); saves fsync (DCP FileSystemWriter default). Each size's save goes to "
            "a fresh directory (no pruning in the timed save); the CNN saves go to one "
            "directory with keep=3 (pruning included). 2 ranks: every rank times its own call "
            "between barriers; 'max' is the slowest rank per run, then the median over runs."
        ),
    }
    return payload


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Checkpoint"


def _label(setting: dict[str, Any]) -> str:
    idle = setting.get("idle_ms_per_step")
    return "CPU-bound" if not idle else f"+{idle:g} ms idle per step"


def _over_none(v: dict[str, Any]) -> str:
    return (
        f"{pages.num(v.get('over_none_median'), 3, 'x')} "
        f"({pages.num(v.get('over_none_min'), 3)}-{pages.num(v.get('over_none_max'), 3)})"
    )


def render(doc: dict[str, Any]) -> str:
    """This benchmark's section of benchmarks/README.md, from its JSON."""
    reference = "torch.save (reference)"
    one = {
        f"{int(size):,} `{name}`": {
            **s,
            "ref": variants.get(reference, {}),
            "reference": name == reference,
        }
        for size, variants in doc.get("one_process", {}).items()
        for name, s in variants.items()
    }

    def vs_ref(s: dict[str, Any], what: str) -> str:
        ref = pages.ratio_of(s.get(f"{what}_median_s"), s["ref"].get(f"{what}_median_s"))
        return pages.num(ref, suffix="x")

    one_cols: list[pages.Column] = [
        ("MiB", lambda n, _s: n.split(" ")[0]),
        ("variant", lambda n, _s: n.split(" ", 1)[1]),
        ("tensors", lambda _n, s: str(s.get("tensors", "-"))),
        ("on disk MiB", pages.field_("disk_mib", 1)),
        ("save s", pages.field_("save_median_s")),
        ("min-max s", lambda _n, s: pages.spread(s, "save")),
        ("save MiB/s", pages.field_("save_mib_per_s", 0)),
        ("load s", pages.field_("load_median_s")),
        ("min-max s", lambda _n, s: pages.spread(s, "load")),
        ("load MiB/s", pages.field_("load_mib_per_s", 0)),
        (
            "vs torch.save",
            lambda _n, s: (
                "-"
                if s["reference"] or not s["ref"]
                else f"{vs_ref(s, 'save')} / {vs_ref(s, 'load')}"
            ),
        ),
        ("runs", lambda _n, s: str(s.get("runs"))),
    ]
    first = doc.get("one_process_first_call") or {}
    out = [
        "`sparktorch_ops.checkpoint`: `save(TrainingState(model), 0)` into a fresh directory, "
        "then `load_latest` into the zeroed model (checked against checksums), of a float32 "
        f"state in {doc.get('chunk_mib')} MiB tensors, median of {doc.get('repeats')}; "
        "`torch.save` (then `fsync`) / `torch.load` + `load_state_dict` of the same state "
        "alternate with it as the reference. *vs torch.save*: our time / its time "
        "(save / load).\n\n"
        "**One process** (no process group):\n\n"
        + pages.columns(one_cols, one)
        + (
            "\n\nFirst call (1 MiB, discarded, not in the table): "
            + "; ".join(
                f"`{name}` save {pages.num(f.get('save_s'))} s / load {pages.num(f.get('load_s'))} s"
                for name, f in first.items()
            )
            + "."
            if first
            else ""
        )
    ]
    ranks = doc.get("two_ranks") or {}
    if ranks:

        def checked(_n: str, s: dict[str, Any]) -> str:
            samples = [x for rank in s.get("per_rank", []) for x in rank]
            return f"{sum(1 for x in samples if x.get('ok'))}/{len(samples)}"

        rank_cols: list[pages.Column] = [
            ("MiB", lambda n, _s: f"{int(n):,}"),
            ("on disk MiB", pages.field_("disk_mib", 1)),
            ("files", lambda _n, s: str(s.get("files", "-"))),
            ("save s, rank 0", pages.field_("save_rank0_median_s")),
            ("save s, slowest", pages.field_("save_max_median_s")),
            ("save MiB/s", pages.field_("save_mib_per_s", 0)),
            ("load s, rank 0", pages.field_("load_rank0_median_s")),
            ("load s, slowest", pages.field_("load_max_median_s")),
            ("load MiB/s", pages.field_("load_mib_per_s", 0)),
            ("loads checked", checked),
            ("runs", lambda _n, s: str(s.get("runs"))),
        ]
        first_ranks = doc.get("two_ranks_first_call") or {}
        out.append(
            "**2 ranks**: `TorchDistributor(num_processes=2, local_mode=True, use_gpu=False, "
            "checkpoint_dir=...)`, the same state in DDP on every rank (replicated: DCP writes one "
            "copy, spread over the ranks); every rank times its own call between barriers. "
            "*slowest*: the slower rank per run, then the median; MiB/s from that time.\n\n"
            + pages.columns(rank_cols, ranks)
            + (
                f"\n\nFirst call on the ranks ({first_ranks.get('state_mib')} MiB, discarded): "
                f"save {pages.num(first_ranks.get('save_max_median_s'))} s / load "
                f"{pages.num(first_ranks.get('load_max_median_s'))} s (slowest rank)."
                if first_ranks
                else ""
            )
        )
    cnn = doc.get("save_vs_step") or {}
    assumptions = doc.get("assumptions") or {}
    epoch_steps = assumptions.get("epoch_steps_per_rank") or []
    settings = {
        k: c
        for k, c in (
            ("one process", cnn.get("one_process")),
            ("2 ranks, DDP", cnn.get("two_ranks")),
        )
        if c
    }
    if settings:

        def growth(n: int) -> pages.Column:
            def cell(_n: str, c: dict[str, Any]) -> str:
                value = (c.get("epoch_with_save_over_without") or {}).get(str(n))
                return f"+{100 * (value - 1):.0f}%" if value is not None else "-"

            return (f"epoch of {n} steps, + one save", cell)

        cnn_cols: list[pages.Column] = [
            ("setting", lambda n, _c: n),
            ("torch threads", lambda _n, c: str(c.get("torch_threads", "-"))),
            ("step ms", lambda _n, c: pages.ms(c.get("step_median_s"))),
            ("save ms", lambda _n, c: pages.ms(c.get("save_median_s"))),
            ("save / step", pages.field_("save_over_step", 1, "x")),
            *(growth(n) for n in epoch_steps),
            (
                "first save ms",
                lambda _n, c: pages.ms(c.get("first_save_s", c.get("first_save_max_s"))),
            ),
            (
                "on disk KiB",
                lambda _n, c: pages.num(c["disk_bytes"] / 1024, 0) if c.get("disk_bytes") else "-",
            ),
        ]
        single = cnn.get("one_process") or {}
        out.append(
            "**Save vs training step**: `DigitsCNN` of `examples/ddp_train.py` "
            f"({single.get('params', 0):,} parameters), batch 64 of random 1x8x8 inputs, SGD "
            "with momentum; the median of "
            f"{len(single.get('step_s', []))} steps (forward, backward, optimizer step) and of "
            f"{len(single.get('save_s', []))} saves of `TrainingState(model, optimizer, "
            "losses=[...])` with `keep=3` (pruning included), after a first save not counted. "
            "On 2 ranks, the slower rank per step and per save.\n\n"
            + pages.columns(cnn_cols, settings)
            + f"\n\nAssumption: {assumptions.get('epoch', '-')}; "
            f"{assumptions.get('save_frequency', '-')}. *epoch of N steps, + one save*: what the "
            "save adds to the time of N training steps per rank; data loading and the rest of an "
            "epoch are not counted, so the real share is smaller."
        )
    epochs = (doc.get("epochs") or {}).get("settings") or []
    if epochs:
        first = epochs[0]
        rows = [
            [
                _label(setting),
                name,
                pages.num(v.get("epoch_median_s"), 3),
                f"{pages.num(v.get('epoch_min_s'), 3)}-{pages.num(v.get('epoch_max_s'), 3)}",
                pages.num(v.get("over_none_median"), 3, "x"),
                f"{pages.num(v.get('over_none_min'), 3)}-{pages.num(v.get('over_none_max'), 3)}",
            ]
            for setting in epochs
            for name, v in setting.get("variants", {}).items()
        ]
        out.append(
            "**Epochs, saving or not** (measured): `DigitsCNN` on 2 DDP ranks (local mode, "
            f"{first.get('torch_threads')} torch thread per rank), epochs of "
            f"{first.get('epoch_length')} steps per rank, {first.get('rounds')} rounds of "
            f"{first.get('epochs_per_round')} epochs per variant, the variants alternating "
            "round by round (after a round not counted); a round ends when its last save "
            "committed. *vs no checkpoint*: each round's time over the same round's without "
            "a checkpoint, median (min-max). *CPU-bound*: the 2 ranks keep both cores busy, so "
            "a background write takes its CPU from training; *idle per step*: a sleep after "
            "each step leaves the CPU free part of the time, as while a GPU computes.\n\n"
            + pages.table(
                ["steps", "variant", "epoch s", "min-max s", "vs no checkpoint", "min-max"], rows
            )
            + _render_before(doc)
        )
    return "\n\n".join(out) + pages.notes(doc.get("notes"))


def _render_before(doc: dict[str, Any]) -> str:
    """The epochs part before and after a change, when the JSON holds the earlier code's run
    of this benchmark (``before``: its code, a note and its ``epochs``, run just before)."""
    before = doc.get("before")
    if not before:
        return ""
    earlier = {_label(s): s.get("variants", {}) for s in before["epochs"]["settings"]}
    rows = [
        [_label(setting), name, _over_none(earlier[_label(setting)][name]), _over_none(after)]
        for setting in doc["epochs"]["settings"]
        for name, after in setting.get("variants", {}).items()
        if name != EPOCH_VARIANTS[0] and name in earlier.get(_label(setting), {})
    ]
    return (
        f"\n\nBefore ({before.get('code')}) and after ({doc['machine'].get('git_commit')}): the epochs part of "
        f"this benchmark, run one process after the other on this machine "
        f"({before.get('note', '')}); vs no checkpoint of its own rounds, median (min-max).\n\n"
        + pages.table(["steps", "variant", "before", "after"], rows)
    )


def _background_met(setting: dict[str, Any]) -> bool:
    """Whether a background save per epoch stays within 5% of no checkpoint (median)."""
    ratio = (setting.get("variants") or {}).get(EPOCH_VARIANTS[2], {}).get("over_none_median")
    return ratio is not None and ratio <= 1.05


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline rows: save/load speed of the largest state, and the epoch cost."""
    rows = []
    if doc.get("one_process"):
        size, variants = max(doc["one_process"].items(), key=lambda item: int(item[0]))
        ours = variants.get("sparktorch_ops (DCP)", {})
        ref = variants.get("torch.save (reference)", {})
        rows.append(
            [
                f"checkpoint, {int(size):,} MiB state, one process "
                f"(median of {doc.get('repeats')})",
                f"save / load MiB/s (torch.save's: {pages.num(ref.get('save_mib_per_s'), 0)} / "
                f"{pages.num(ref.get('load_mib_per_s'), 0)})",
                f"{pages.num(ours.get('save_mib_per_s'), 0)} / "
                f"{pages.num(ours.get('load_mib_per_s'), 0)} MiB/s",
                "-",
            ]
        )
    settings = (doc.get("epochs") or {}).get("settings") or []
    if settings:
        figures = []
        for setting in settings:
            variants = setting.get("variants") or {}
            idle = setting.get("idle_ms_per_step")
            figures.append(
                ("CPU-bound: " if not idle else f"{idle:g} ms idle per step: ")
                + "; ".join(
                    pages.num(variants[name].get("over_none_median"), 2, "x")
                    for name in EPOCH_VARIANTS[1:]
                    if name in variants
                )
            )
        rows.append(
            [
                "checkpoint every epoch, example DigitsCNN, 2 ranks, "
                f"{settings[0].get('epoch_length')} steps per epoch",
                "epoch time with the save / without (blocking; blocking=False)",
                " / ".join(figures),
                "<= 1.05x with blocking=False ("
                + "; ".join(
                    ("CPU-bound" if not setting.get("idle_ms_per_step") else "idle")
                    + (": met" if _background_met(setting) else ": not met")
                    for setting in settings
                )
                + ")",
            ]
        )
    return rows


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="100,1000", help="comma-separated state sizes, MiB")
    parser.add_argument("--chunk-mib", type=int, default=32, help="MiB per tensor of the state")
    parser.add_argument("--steps", type=int, default=200, help="timed CNN training steps")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--saves", type=int, default=20, help="timed CNN saves (after a first one)")
    parser.add_argument(
        "--epoch-steps",
        default="10,15",
        help="steps per rank per epoch for the overhead figure (the pipeline: 1200-1800 rows, "
        "2 ranks, batch 64)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads of the one-process CNN part (default: what a rank of 2 gets)",
    )
    parser.add_argument(
        "--no-ranks", dest="ranks", action="store_false", help="skip the 2-rank runs"
    )
    parser.add_argument(
        "--epoch-length", type=int, default=15, help="steps per rank per epoch (epochs part)"
    )
    parser.add_argument("--epochs", type=int, default=10, help="epochs per round (epochs part)")
    parser.add_argument(
        "--epoch-rounds", type=int, default=7, help="rounds per variant (epochs part)"
    )
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=5.0,
        help="epochs part, second setting: ms of sleep after each step (the CPU idle while a "
        "GPU computes); 0 skips it",
    )
    parser.add_argument("--tmpdir", default=None, help="where the temporary directory goes")


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"repeats": 3, "timeout": 1800},
    quick=(
        "--sizes=10,50",
        "--repeats=2",
        "--steps=50",
        "--warmup-steps=5",
        "--saves=5",
        "--epochs=3",
        "--epoch-rounds=2",
    ),
    headline=True,
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
