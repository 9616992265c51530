"""Checkpoints on the ranks (sparktorch_ops.checkpoint): real torchrun ranks, gloo on CPU.

The rank functions are module-level (cloudpickle ships them by reference). Runs are combined
where one run can check several things: each costs a few seconds.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sparktorch_ops import CheckpointError, ConfigError, TorchDistributor, TrainingFailedError
from sparktorch_ops import checkpoint as ck
from sparktorch_ops.lightning import latest_ckpt_path
from sparktorch_ops.rank import reporting
from sparktorch_ops.wire.messages import MetricReport, Notice

STEPS = 5
GLOBAL_BATCH = 8


# -- rank code -----------------------------------------------------------------------------------
def toy_model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, the same in every run; ``rank``'s share of it."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def train_ddp(
    steps: int, keep: int, die_after: int | None, marker: str | None, blocking: bool = True
) -> dict[str, Any]:
    """DDP training that saves every step and resumes from the latest checkpoint.

    With ``die_after``, rank 1 exits right after that step's checkpoint committed, the first
    time (``marker`` remembers it). ``blocking=False`` saves in the background; the last
    save is waited for before the ``finally`` destroys the process group.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DistributedDataParallel(toy_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        state = ck.TrainingState(model, optimizer, seen=0)
        start = ck.load_latest(state)
        first = 0 if start is None else start + 1
        for step in range(first, steps):
            x, y = batch(step, rank, world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state.extra["seen"] += GLOBAL_BATCH
            ck.save(state, step, keep=keep, blocking=blocking)
            if step == die_after and rank == 1 and marker and not os.path.exists(marker):
                ck.wait()
                Path(marker).touch()
                os._exit(1)
        ck.wait()
        return {
            "start": start,
            "seen": state.extra["seen"],
            "attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
            "weights": full_weights(model),
        }
    finally:
        dist.destroy_process_group()


def crash_while_saving(record: str, blocking: bool) -> None:
    """Attempt 0: rank 1 dies instead of saving step 2. Attempt 1 resumes (step 1), then rank 0
    dies after step 2's data was written, before the commit marker. The
    state is small and replicated: rank 0 writes it alone."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model = toy_model()
    state = {"model": model, "note": "plain"}
    start = ck.load_latest(state)
    if attempt == 0:
        for step in (0, 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            if step == 1 and rank == 0:  # before save(): rank 1 cannot be gone yet
                torch.save(model.state_dict(), os.path.join(os.path.dirname(record), "step1.pt"))
            ck.save(state, step, blocking=blocking)
        ck.wait()
        if rank == 1:
            os._exit(1)
        ck.save(state, 2, blocking=blocking)  # rank 1 never reaches it: no commit
        ck.wait()  # fails or is torn down
        return
    if rank == 0:
        Path(record).write_text(json.dumps({"start": start}))

        def die_before_marker(self: Any) -> None:
            os._exit(3)

        ck.saving.Write._commit = die_before_marker  # type: ignore[method-assign]
    ck.save(state, 2, blocking=blocking)
    ck.wait()


def save_in_background_and_return(directory: str) -> None:
    """Both ranks start a background save that cannot be written, and return at once."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    ck.save({"model": DistributedDataParallel(toy_model())}, 0, directory=directory, blocking=False)


def save_small_and_large(small_dir: str, large_dir: str) -> None:
    """A small DDP model (rank 0 writes it alone) and a 40 MiB one (every rank writes its
    share), each saved twice in the background; returns without destroying the group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    small = DistributedDataParallel(toy_model())
    large = DistributedDataParallel(
        torch.nn.ParameterList([torch.nn.Parameter(torch.ones(2**20)) for _ in range(10)])
    )
    for step in (0, 1):
        ck.save({"model": small}, step, directory=small_dir, blocking=False)
        ck.save({"model": large}, step, directory=large_dir, blocking=False)


class FsdpNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def fsdp_model(seed: int | None = None) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = FsdpNet()
    if seed is not None:
        torch.manual_seed(seed)
        for p in model.parameters():
            torch.nn.init.normal_(p)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_fsdp(model_file: str) -> dict[str, Any] | None:
    """FSDP2 on 2 ranks: train 2 steps, save step 1; warm-start fresh sharded models from a
    model file and from the checkpoint just written."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = fsdp_model()
        assert all(isinstance(p, DTensor) for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        state = ck.TrainingState(model, optimizer)
        assert ck.load_latest(state) is None
        for step in range(2):
            x, y = batch(step, rank, world)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        path = ck.save(state, 1)
        saved = full_weights(model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optim = get_optimizer_state_dict(model, optimizer, options=options)

        from_file = fsdp_model(seed=7)
        ck.warm_start({"model": from_file}, model_file)
        from_dcp = fsdp_model(seed=8)
        ck.warm_start({"model": from_dcp}, ck.checkpoint_dir() or "")
        warm = {"file": full_weights(from_file), "dcp": full_weights(from_dcp)}
        if rank != 0:
            return None
        return {"path": path, "weights": saved, "optim": optim, "warm": warm}
    finally:
        dist.destroy_process_group()


def load_fsdp_one_rank(plain_dir: str) -> dict[str, Any]:
    """One rank (a 1-rank FSDP2 mesh) loads what 2 ranks saved, and what one plain process
    saved as a single state file (a full state dict, sharded as it loads)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    dist.init_process_group("gloo")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    try:
        loaded = {}
        for key, directory in (("fsdp", None), ("plain", plain_dir)):
            model = fsdp_model(seed=3)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
            step = ck.load_latest(ck.TrainingState(model, optimizer), directory=directory)
            loaded[key] = {
                "step": step,
                "weights": full_weights(model),
                "optim": get_optimizer_state_dict(model, optimizer, options=options),
                "lr": optimizer.param_groups[0]["lr"],
            }
        return loaded
    finally:
        dist.destroy_process_group()


# -- helpers -------------------------------------------------------------------------------------
def distributor(directory: str, num_processes: int = 2, **options: Any) -> TorchDistributor:
    return TorchDistributor(
        num_processes=num_processes,
        local_mode=True,
        use_gpu=False,
        checkpoint_dir=directory,
        **options,
    )


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_tree(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def step_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("step-"))


@pytest.fixture(autouse=True)
def _no_checkpoint_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ck.CHECKPOINT_DIR_ENV, raising=False)
    monkeypatch.delenv(ck.WARM_START_ENV, raising=False)


@pytest.fixture(scope="module")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A DDP run of STEPS steps, never interrupted, keeping 2 checkpoints."""
    directory = tmp_path_factory.mktemp("uninterrupted") / "ck"
    value = distributor(str(directory)).run(train_ddp, STEPS, 2, None, None)
    yield directory, value


# -- tests ---------------------------------------------------------------------------------------
def test_ddp_resumes_after_a_crash_bit_for_bit(
    tmp_path: Path, uninterrupted: tuple[Path, dict[str, Any]]
) -> None:
    reference_dir, reference = uninterrupted
    assert reference["start"] is None and reference["seen"] == STEPS * GLOBAL_BATCH
    assert step_dirs(reference_dir) == ["step-000000003", "step-000000004"]  # keep=2

    directory = tmp_path / "ck"
    marker = tmp_path / "died-once"
    value = distributor(str(directory), max_restarts=1).run(train_ddp, STEPS, 3, 2, str(marker))
    assert marker.exists() and value["attempt"] == 1
    assert value["start"] == 2  # resumed at step 3
    assert value["seen"] == STEPS * GLOBAL_BATCH  # extra values resumed too
    assert_same(value["weights"], reference["weights"])
    assert step_dirs(directory) == ["step-000000002", "step-000000003", "step-000000004"]
    commit = json.loads((directory / "step-000000004" / ck.COMMIT_MARKER).read_text())
    assert commit["step"] == 4 and commit["world_size"] == 2
    assert ck.latest_step(directory=str(directory)) == 4


def test_barrier_mode_resumes_after_a_crash_bit_for_bit(
    spark: Any, tmp_path: Path, uninterrupted: tuple[Path, dict[str, Any]]
) -> None:
    _, reference = uninterrupted
    directory = tmp_path / "ck"
    marker = tmp_path / "died-once"
    result = TorchDistributor(
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        spark=spark,
        max_restarts=1,
        checkpoint_dir=str(directory),
    ).launch(train_ddp, STEPS, 3, 2, str(marker), False)
    # Each barrier task's agent counts its own restarts: an agent whose worker was healthy
    # restarts for the new rendezvous without counting one, so rank 0 may see 0 or 1 here.
    # Resuming at step 3 is what proves the group was restarted.
    assert marker.exists() and result.value["start"] == 2
    assert_same(result.value["weights"], reference["weights"])
    assert result.checkpoint is not None and result.checkpoint["resumed_from_step"] is None
    assert result.checkpoint["latest_step"] == STEPS - 1


def test_background_saves_train_bit_for_bit_and_commit_before_the_group_goes(
    tmp_path: Path, uninterrupted: tuple[Path, dict[str, Any]]
) -> None:
    _, reference = uninterrupted
    directory = tmp_path / "ck"
    value = distributor(str(directory)).run(train_ddp, STEPS, 2, None, None, False)
    assert_same(value["weights"], reference["weights"])
    # The last save was in flight when train_ddp returned: waited for, it committed.
    assert step_dirs(directory) == ["step-000000003", "step-000000004"]
    model = toy_model(seed=5)
    state = ck.TrainingState(model, torch.optim.AdamW(model.parameters()), seen=0)
    assert ck.load_latest(state, directory=str(directory)) == STEPS - 1
    assert_same(model.state_dict(), reference["weights"])
    assert state.extra["seen"] == STEPS * GLOBAL_BATCH


def test_a_failed_background_save_fails_the_run_naming_rank_and_step(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    directory = blocker / "ck"  # under a regular file: the write fails in the background
    with pytest.raises(TrainingFailedError) as info:
        distributor(str(directory), timeout=120).run(save_in_background_and_return, str(directory))
    failure = info.value.first_failure
    assert failure is not None and failure.exit_code == 1
    assert "CheckpointError" in failure.reason and "NotADirectoryError" in failure.reason
    assert f"the background save of step 0 to {directory}/step-000000000 failed" in failure.reason
    assert f"rank {failure.rank}: " in failure.reason


def test_rank_0_writes_a_small_replicated_state_alone_every_rank_a_large_one(
    tmp_path: Path,
) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    distributor(str(tmp_path), timeout=120).run(save_small_and_large, str(small), str(large))
    # Both background saves committed though the function left its process group alive.
    assert step_dirs(small) == step_dirs(large) == ["step-000000000", "step-000000001"]
    assert sorted(os.listdir(small / "step-000000001")) == ["COMMITTED", ck.STATE_FILE]
    assert sorted(os.listdir(large / "step-000000001")) == [
        ".metadata",
        "COMMITTED",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    model = toy_model(seed=3)
    assert ck.load_latest({"model": model}, directory=str(small)) == 1
    assert_same(model.state_dict(), toy_model().state_dict())
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2**20)) for _ in range(10)])
    assert ck.load_latest({"model": params}, directory=str(large)) == 1
    assert all(bool((p == 1).all()) for p in params)


def test_plain_torchrun_ranks_exit_cleanly_with_a_save_in_flight_and_no_destroy(
    tmp_path: Path,
) -> None:
    # A background save's thread runs collectives: alive when the interpreter exits, it
    # would abort the process ("terminate called without an active exception").
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "from sparktorch_ops import checkpoint as ck\n"
        "dist.init_process_group('gloo')\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "for step in (0, 1):\n"
        "    ck.save({'model': model}, step, directory=sys.argv[1], blocking=False)\n"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    launched = subprocess.run(
        [*torchrun, str(script), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "terminate called" not in launched.stderr
    assert ck.latest_step(directory=str(tmp_path / "ck")) == 1


def test_second_run_resumes_after_the_last_step_and_wins_over_warm_start(
    tmp_path: Path, uninterrupted: tuple[Path, dict[str, Any]]
) -> None:
    reference_dir, reference = uninterrupted
    other = tmp_path / "other.pt"
    torch.save(toy_model(seed=5).state_dict(), other)
    result = distributor(str(reference_dir), warm_start_from=str(other)).launch(
        train_ddp, STEPS, 2, None, None
    )
    assert result.checkpoint == {
        "dir": str(reference_dir),
        "resumed_from_step": STEPS - 1,
        "warm_start_from": None,
        "latest_step": STEPS - 1,
    }
    assert result.value["start"] == STEPS - 1  # nothing left to train
    assert_same(result.value["weights"], reference["weights"])
    assert f"resumed from step {STEPS - 1} at {reference_dir}" in result.outputs[0]
    assert not any("warm-started" in out for out in result.outputs.values())


def test_a_ddp_checkpoint_of_2_ranks_resumes_on_1_rank(
    tmp_path: Path, uninterrupted: tuple[Path, dict[str, Any]]
) -> None:
    """An attempt with fewer ranks (min_processes): DDP's state saved by 2 ranks loads on 1."""
    reference_dir, reference = uninterrupted
    directory = tmp_path / "ck"
    shutil.copytree(reference_dir, directory)
    value = distributor(str(directory), num_processes=1).run(train_ddp, STEPS + 1, 2, None, None)
    assert value["start"] == STEPS - 1 and value["seen"] == (STEPS + 1) * GLOBAL_BATCH
    weights = reference["weights"]
    assert value["weights"].keys() == weights.keys()
    assert any(not torch.equal(value["weights"][k], weights[k]) for k in weights)  # a step more
    commit = json.loads((directory / f"step-{STEPS:09d}" / ck.COMMIT_MARKER).read_text())
    assert commit["world_size"] == 1


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint(
    tmp_path: Path, blocking: bool
) -> None:
    directory = tmp_path / "ck"
    record = tmp_path / "record.json"
    with pytest.raises(TrainingFailedError):
        distributor(str(directory), max_restarts=1).run(crash_while_saving, str(record), blocking)
    assert json.loads(record.read_text()) == {"start": 1}  # the restart resumed step 1
    assert ck.latest_step(directory=str(directory)) == 1
    # Step 2 was written whole but never committed: it does not count.
    assert (directory / "step-000000002" / ck.STATE_FILE).exists()
    assert not (directory / "step-000000002" / ck.COMMIT_MARKER).exists()

    # Loads in one process without a process group (2 ranks -> 1), then saves step 2 again.
    model = toy_model(seed=9)
    state: dict[str, Any] = {"model": model, "note": ""}
    assert ck.load_latest(state, directory=str(directory)) == 1
    assert_same(model.state_dict(), torch.load(tmp_path / "step1.pt", weights_only=True))
    assert state["note"] == "plain"
    (directory / "step-000000002" / "__1_0.distcp").write_bytes(b"from a crashed save")
    ck.save(state, 2, directory=str(directory))
    assert ck.latest_step(directory=str(directory)) == 2
    # The crashed save's files are gone.
    assert sorted(os.listdir(directory / "step-000000002")) == ["COMMITTED", ck.STATE_FILE]


def test_fsdp2_checkpoint_of_2_ranks_loads_on_1_rank(tmp_path: Path) -> None:
    directory = "file://" + str(tmp_path / "ck")  # an fsspec URL, shared by the ranks
    model_file = tmp_path / "model.pt"
    torch.manual_seed(11)
    source = FsdpNet()
    for p in source.parameters():
        torch.nn.init.normal_(p)
    torch.save(source.state_dict(), model_file)

    saved = distributor(directory).run(train_fsdp, str(model_file))
    assert saved["path"] == directory + "/step-000000001"
    assert_same(saved["warm"]["file"], source.state_dict())
    assert_same(saved["warm"]["dcp"], saved["weights"])

    plain_dir = tmp_path / "plain"
    plain_model = FsdpNet()
    plain_optimizer = torch.optim.AdamW(plain_model.parameters(), lr=0.25)
    plain_model(torch.randn(4, 8)).sum().backward()
    plain_optimizer.step()
    ck.save(ck.TrainingState(plain_model, plain_optimizer), 6, directory=str(plain_dir))
    assert (plain_dir / "step-000000006" / ck.STATE_FILE).exists()

    both = distributor(directory, num_processes=1).run(load_fsdp_one_rank, str(plain_dir))
    loaded = both["fsdp"]
    assert loaded["step"] == 1 and loaded["lr"] == 0.05
    assert_same(loaded["weights"], saved["weights"])
    assert_same_tree(loaded["optim"], saved["optim"])
    from_file = both["plain"]
    assert from_file["step"] == 6 and from_file["lr"] == 0.25
    assert_same(from_file["weights"], plain_model.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    plain_optim = get_optimizer_state_dict(plain_model, plain_optimizer, options=full)
    assert_same_tree(from_file["optim"], plain_optim)

    plain = FsdpNet()  # and into a plain model in this process
    assert ck.load_latest({"model": plain}, directory=directory) == 1
    assert_same(plain.state_dict(), saved["weights"])


# -- in one process ------------------------------------------------------------------------------
def trained(seed: int) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    model = toy_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step, 0, 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_background_save_writes_the_state_as_it_was_when_called(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = [1.0]
    state = ck.TrainingState(model, optimizer, losses=losses)
    url = ck.save(state, 0, directory=str(tmp_path), blocking=False)
    with torch.no_grad():  # training goes on while the save is written
        for p in model.parameters():
            p.add_(1.0)
    losses.append(2.0)
    assert ck.wait() == url == str(tmp_path / "step-000000000")
    assert ck.wait() is None
    assert (tmp_path / "step-000000000" / ck.COMMIT_MARKER).exists()

    fresh, fresh_optimizer = trained(1)
    loaded = ck.TrainingState(fresh, fresh_optimizer, losses=[])
    assert ck.load_latest(loaded, directory=str(tmp_path)) == 0
    assert_same(fresh.state_dict(), before)
    assert loaded.extra["losses"] == [1.0]

    # One save in flight at a time; load_latest and the next save wait; keep prunes.
    for step in range(1, 4):
        ck.save(state, step, keep=2, directory=str(tmp_path), blocking=False)
        assert ck.latest_step(directory=str(tmp_path)) == step - 1
    assert ck.load_latest(loaded, directory=str(tmp_path)) == 3
    assert step_dirs(tmp_path) == ["step-000000002", "step-000000003"]
    assert loaded.extra["losses"] == [1.0, 2.0]


def test_a_failed_background_save_is_raised_by_the_next_call(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    directory = str(blocker / "ck")
    model, _ = trained(0)
    ck.save({"model": model}, 3, directory=directory, blocking=False)
    with pytest.raises(CheckpointError) as info:
        ck.wait()
    error = info.value
    assert (error.rank, error.step, error.directory) == (0, 3, f"{directory}/step-000000003")
    assert error.cause.startswith("NotADirectoryError: ") and error.__cause__ is not None
    assert pickle.loads(pickle.dumps(error)).args == error.args
    assert "background save of step 3" in capfd.readouterr().err
    assert ck.wait() is None  # raised once

    ck.save({"model": model}, 4, directory=directory, blocking=False)
    with pytest.raises(CheckpointError, match="step 4"):
        ck.save({"model": model}, 5, directory=str(tmp_path / "fine"))
    assert ck.latest_step(directory=str(tmp_path / "fine")) is None  # not written either
    with pytest.raises(ConfigError) as config:
        ck.save({"model": model}, 5, directory=str(tmp_path), blocking="no")  # type: ignore[arg-type]
    assert config.value.argument == "blocking"


def test_keep_prunes_and_stale_step_dirs_go(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    state = ck.TrainingState(model, optimizer)
    (tmp_path / "step-000000000").mkdir()  # a crashed save, older than what follows
    (tmp_path / "notes.txt").write_text("kept")
    for step in range(1, 5):
        ck.save(state, step, keep=2, directory=str(tmp_path))
    assert step_dirs(tmp_path) == ["step-000000003", "step-000000004"]
    assert (tmp_path / "notes.txt").read_text() == "kept"
    (tmp_path / "step-000000009").mkdir()  # uncommitted and newer: never counts, stays
    assert ck.latest_step(directory=str(tmp_path)) == 4
    with pytest.raises(ConfigError) as info:
        ck.save(state, 4, directory=str(tmp_path))
    assert info.value.argument == "step"


def test_memory_url_and_plain_dict_state_round_trip() -> None:
    model, optimizer = trained(0)
    url = f"memory://sparktorch-tests/{time.monotonic_ns()}"
    state = {"model": model, "optim": optimizer, "epoch": 3, "ema": torch.arange(4.0)}
    assert ck.save(state, 7, directory=url) == url + "/step-000000007"
    assert ck.latest_step(directory=url) == 7

    fresh, fresh_optimizer = trained(1)
    loaded: dict[str, Any] = {
        "model": fresh,
        "optim": fresh_optimizer,
        "epoch": 0,
        "ema": torch.zeros(4),
    }
    # The same layout as TrainingState(model, optim, **extra).
    as_state = ck.TrainingState(fresh, fresh_optimizer, epoch=0, ema=torch.zeros(4))
    assert ck.load_latest(as_state, directory=url) == 7
    assert as_state.extra["epoch"] == 3
    assert ck.load_latest(loaded, directory=url) == 7
    assert loaded["epoch"] == 3 and torch.equal(loaded["ema"], torch.arange(4.0))
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same_tree(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_warm_start_from_a_model_file_and_a_checkpoint_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source, optimizer = trained(0)
    ck.save(ck.TrainingState(source, optimizer), 3, directory=str(tmp_path / "src"))
    ddp_file = tmp_path / "model.pt"
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, ddp_file)
    fresh_dir = str(tmp_path / "fresh")

    for where in (ddp_file, tmp_path / "src", tmp_path / "src" / "step-000000003"):
        monkeypatch.setenv(ck.WARM_START_ENV, str(where))
        model, optimizer = trained(1)
        state = ck.TrainingState(model, optimizer, epoch=0)
        assert ck.load_latest(state, directory=fresh_dir) is None
        assert_same(model.state_dict(), source.state_dict())
        assert state.extra == {"epoch": 0}  # weights only
        assert "warm-started from" in capsys.readouterr().err

    # Only what matches: a model with a new head keeps its own head.
    monkeypatch.setenv(ck.WARM_START_ENV, str(tmp_path / "src"))
    torch.manual_seed(2)
    body, new_head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)
    head = new_head.weight.detach().clone()
    wider = torch.nn.Sequential(body, torch.nn.Tanh(), new_head)
    assert ck.load_latest({"model": wider}, directory=fresh_dir) is None
    assert torch.equal(body.weight, source.state_dict()["0.weight"])
    assert torch.equal(new_head.weight, head)

    monkeypatch.setenv(ck.WARM_START_ENV, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="does not exist") as info:
        ck.load_latest({"model": toy_model()}, directory=fresh_dir)
    assert info.value.argument == ck.WARM_START_ENV

    monkeypatch.delenv(ck.WARM_START_ENV)
    assert ck.load_latest({"model": toy_model()}, directory=fresh_dir) is None
    assert f"no checkpoint under {fresh_dir}: starting fresh" in capsys.readouterr().err


def test_a_state_with_a_key_the_checkpoint_lacks_is_refused(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    ck.save({"model": model}, 0, directory=str(tmp_path))
    assert sorted(os.listdir(tmp_path / "step-000000000")) == ["COMMITTED", ck.STATE_FILE]
    with pytest.raises(ConfigError, match=r"'optim', which .* lacks") as info:
        ck.load_latest({"model": model, "optim": optimizer}, directory=str(tmp_path))
    assert info.value.argument == "state"


WRITTEN_BEFORE = Path(__file__).parents[1] / "fixtures" / "checkpoint_written_before_package"


def zeroed_model() -> torch.nn.Sequential:
    """The model of that fixture's generator, every weight 0."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


class SentReports:
    """A channel client that keeps what ``reporting.replay`` sends."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send_message(self, message: Any) -> None:
        self.messages.append(message)


@pytest.mark.parametrize(("form", "step"), [("replicated", 3), ("dcp", 7)])
def test_a_checkpoint_written_before_the_package_split_loads(
    form: str, step: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The on-disk format did not change: checkpoints written by ``checkpoint.py`` when it was
    one module (tests/fixtures/checkpoint_written_before_package/README.md) load: the
    replicated ``state.pt`` form (model, SGD after one step, extra values) and the DCP form of
    an FSDP2 model (model and extra values), each with the reports it carried."""
    directory = tmp_path / form
    shutil.copytree(WRITTEN_BEFORE / form, directory)
    model = zeroed_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    ema = torch.zeros(3)
    extra: dict[str, Any] = {"epoch": 0, "name": "", "ema": ema, "nested": {"scale": 0.0, "seen": 0}}
    state = (
        ck.TrainingState(model, optimizer, **extra)
        if form == "replicated"
        else ck.TrainingState(model, **extra)
    )
    sent = SentReports()
    reporting.install(sent)  # type: ignore[arg-type]
    try:
        assert ck.latest_step(directory=str(directory)) == step
        assert ck.load_latest(state, directory=str(directory)) == step
    finally:
        reporting.install(None)
    # In a run, rank 0's line goes to the driver's log at INFO (not to its stderr: WARNING).
    notices = [(m.level, m.text) for m in sent.messages if isinstance(m, Notice)]
    resumed = f"resumed from step {step} at {directory / ck.step_dir_name(step)}"
    assert notices == [(logging.INFO, f"sparktorch_ops.checkpoint: {resumed}")]
    assert resumed not in capsys.readouterr().err

    stepped = 0.125 if form == "replicated" else 0.0  # one SGD step of lr 0.125, gradients 1
    for offset, p in enumerate(model.parameters()):
        written = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 8 + offset
        assert torch.equal(p.detach(), written - stepped)
    if form == "replicated":
        group = optimizer.param_groups[0]
        assert (group["lr"], group["momentum"]) == (0.125, 0.5)
        for p in model.parameters():
            assert torch.equal(optimizer.state[p]["momentum_buffer"], torch.ones_like(p))
    assert torch.equal(ema, torch.arange(3.0))  # loaded in place
    assert state.extra["epoch"] == 4 and state.extra["name"] == "fixture"
    assert state.extra["nested"] == {"scale": 0.5, "seen": 12}
    replayed = [
        (m.step, m.time, m.values, m.progress, m.replayed)
        for m in sent.messages
        if isinstance(m, MetricReport)
    ]
    assert replayed == [
        (0, 1700000000.0, {"loss": 1.0}, 0.25, True),
        (1, 1700000001.0, {"loss": 0.5, "phase": "warm"}, 0.5, True),
    ]


def test_config_errors() -> None:
    state = {"model": toy_model()}
    with pytest.raises(ConfigError, match="set checkpoint_dir= on TorchDistributor") as info:
        ck.save(state, 0)
    assert info.value.argument == "checkpoint_dir"
    with pytest.raises(ConfigError, match="set checkpoint_dir="):
        ck.load_latest(state)
    assert ck.checkpoint_dir() is None
    for step in (-1, 1.0, True, "3"):
        with pytest.raises(ConfigError) as info:
            ck.save(state, step, directory="unused")  # type: ignore[arg-type]
        assert info.value.argument == "step"
    with pytest.raises(ConfigError) as info:
        ck.save(state, 0, keep=0, directory="unused")
    assert info.value.argument == "keep"
    optimizer = torch.optim.SGD(toy_model().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="holds parameters of no module"):
        ck.save({"model": toy_model(), "optim": optimizer}, 0, directory="unused")


def test_latest_ckpt_path_picks_the_newest_lightning_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert latest_ckpt_path() is None  # no checkpoint_dir
    assert latest_ckpt_path(str(tmp_path / "missing")) is None
    now = time.time()
    for name, age in [("epoch=0-step=10.ckpt", 30), ("epoch=1-step=20.ckpt", 20), ("x.txt", 0)]:
        (tmp_path / name).write_text("")
        os.utime(tmp_path / name, (now - age, now - age))
    monkeypatch.setenv(ck.CHECKPOINT_DIR_ENV, str(tmp_path))
    assert latest_ckpt_path() == str(tmp_path / "epoch=1-step=20.ckpt")
    (tmp_path / "last.ckpt").write_text("")
    os.utime(tmp_path / "last.ckpt", (now - 40, now - 40))  # stale: an older run's
    assert latest_ckpt_path() == str(tmp_path / "epoch=1-step=20.ckpt")
    os.utime(tmp_path / "last.ckpt", (now - 10, now - 10))
    assert latest_ckpt_path() == str(tmp_path / "last.ckpt")
    assert latest_ckpt_path("file://" + str(tmp_path)) == "file://" + str(tmp_path / "last.ckpt")


def test_latest_ckpt_path_resumes_a_lightning_trainer(tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning")

    class Tiny(lightning.LightningModule):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = toy_model()

        def training_step(self, data: Any, index: int) -> torch.Tensor:
            x, y = data
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = batch(0, 0, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    def fit(epochs: int) -> Any:
        trainer = lightning.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                lightning.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
            ],
        )
        trainer.fit(Tiny(), loader, ckpt_path=latest_ckpt_path(str(tmp_path)))
        return trainer

    assert latest_ckpt_path(str(tmp_path)) is None
    fit(2)
    assert latest_ckpt_path(str(tmp_path)) == str(tmp_path / "last.ckpt")
    trainer = fit(3)  # resumes after epoch 2: one more epoch
    assert trainer.current_epoch == 3 and trainer.global_step == 6
