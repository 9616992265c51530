"""Training functions for the fault tests (shipped by value: the ranks cannot import tests)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.support.checkpointed import checkpointed_steps


def mark_ready(ready_dir: str) -> None:
    """Write this rank's pid, so a test knows training is under way and whom to kill."""
    path = Path(ready_dir, f"rank{os.environ['RANK']}.pid")
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(path.with_suffix(".tmp"), path)


def long_training(ready_dir: str, seconds: float = 300.0) -> str:
    """Collectives every 100 ms for ``seconds``: a run that only ends when something ends it."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mark_ready(ready_dir)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        dist.barrier()
        time.sleep(0.1)
    dist.destroy_process_group()
    return "finished"


def fail_after_ready(ready_dir: str, how: str) -> str:
    """Rank 1 fails (raise / exit 3) once every rank is in training; the others keep going."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mark_ready(ready_dir)
    dist.barrier()
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        if how == "raise":
            raise RuntimeError("rank 1 raised on purpose")
        os._exit(3)
    while True:  # rank 0 would wait on rank 1 forever: the distributor must end it
        time.sleep(0.1)


def stuck_in_data_loading() -> None:
    """A data loader that never returns."""
    time.sleep(3600)


def hang_in_collective(ready_dir: str) -> None:
    """Rank 0 waits in an all-reduce that rank 1, stuck loading data, never joins; rank 0's
    last line comes a second after rank 1's, so rank 1 is the one silent longest."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mark_ready(ready_dir)
    if os.environ["RANK"] == "1":
        print("loading the next batch", flush=True)
        stuck_in_data_loading()
    time.sleep(1.0)
    print("reducing", flush=True)
    dist.all_reduce(torch.ones(1))


def heartbeat_only(seconds: float) -> str:
    """Prints nothing for ``seconds``, but reports a heartbeat (no values) twice a second."""
    import sparktorch_ops

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sparktorch_ops.report()
        time.sleep(0.5)
    return "done"


def _ancestors() -> list[tuple[int, str]]:
    """This process's ancestors, nearest first: (pid, command line)."""
    found, pid = [], os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as stat:
            pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            found.append((pid, cmdline.read().replace(b"\0", b" ").decode(errors="replace")))
    return found


def steps_losing_an_executor(
    steps: int, directory: str, whole_worker: bool = False, rows: bool = False
) -> dict[str, Any]:
    """A checkpointed step counter whose first attempt loses rank 1's executor right after
    step 2's checkpoint: rank 1 SIGKILLs its executor's JVM (with ``whole_worker``, its
    worker daemon first, so the cluster has no slot to replace it). The kill's time goes to
    ``<directory>/killed``; each rank writes its pid to ``<directory>/<attempt>.rank<N>`` as it
    starts (``first`` or ``later``). With ``rows``, each rank first counts the rows of its
    DataFrame shard."""
    folder, rank = Path(directory), int(os.environ["RANK"])
    first = not (folder / "killed").exists()
    (folder / f"{'first' if first else 'later'}.rank{rank}").write_text(str(os.getpid()))
    seen = None
    if rows:
        from sparktorch_ops.data import partition_loader

        seen = sum(len(batch["id"]) for batch in partition_loader(64, columns=["id"]))

    def lose(step: int) -> None:
        if not (first and step == 2 and rank == 1):
            return
        targets = ["CoarseGrainedExecutorBackend"]
        if whole_worker:
            targets.insert(0, "org.apache.spark.deploy.worker.Worker")
        ancestors = _ancestors()
        (folder / "killed").write_text(str(time.time()))
        for target in targets:
            for pid, command in ancestors:
                if target in command:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(60)  # gone with the executor

    done = checkpointed_steps(steps, lose)
    return {**done, "world": int(os.environ["WORLD_SIZE"]), "rows": seen}
