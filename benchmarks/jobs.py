"""The training jobs the benchmarks launch, as functions and as a torchrun script.

Every benchmark runs the same code under each launcher: ``fn(*args)`` for the function
variants, ``python jobs.py <job> [options]`` for the script variants (bare ``torchrun`` and
``run("jobs.py", ...)``). Only the standard library is imported at module level: this module
is shipped to the ranks by value, and a rank's ``import torch`` is part of what is measured.

Timestamps (``--timings-dir``) are ``time.time()`` values; process start times are read from
``/proc`` against a boot time taken from ``/proc/uptime`` (10 ms resolution), not from
``/proc/stat``'s ``btime``, which is rounded to whole seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ENV_TIMINGS_DIR = "SPARKTORCH_BENCH_TIMINGS_DIR"


def _clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def _boot_time() -> float:
    with open("/proc/uptime") as handle:
        uptime = float(handle.read().split()[0])
    return time.time() - uptime


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as handle:
        text = handle.read()
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def process_chain(depth: int = 8) -> list[dict[str, Any]]:
    """This process and its ancestors: pid, start time, command line, name (newest first)."""
    boot = _boot_time()
    chain = []
    pid = os.getpid()
    for _ in range(depth):
        if pid <= 1:
            break
        try:
            fields = _stat_fields(pid)
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            break
        chain.append(
            {
                "pid": pid,
                "start": boot + int(fields[19]) / _clock_ticks(),
                "cmdline": cmdline[:300],
                "name": name,
            }
        )
        pid = int(fields[1])
    return chain


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _save_timings(timings_dir: str | None, marks: dict[str, float], extra: dict[str, Any]) -> None:
    if not timings_dir:
        return
    record = {
        "rank": _rank(),
        "marks": marks,
        "chain": process_chain(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        **extra,
    }
    path = os.path.join(timings_dir, f"rank{_rank()}.json")
    with open(path, "w") as handle:
        json.dump(record, handle)


def allreduce(timings_dir: str | None = None, use_gpu: bool = False) -> float:
    """The trivial job: one all-reduce of a one-element tensor across every rank.

    Returns:
        The reduced value (the sum of ``rank + 1`` over all ranks).
    """
    marks = {"fn_start": time.time()}
    torch_preloaded = "torch" in sys.modules
    import torch
    import torch.distributed as dist

    marks["torch_imported"] = time.time()
    if use_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    marks["pg_ready"] = time.time()
    value = torch.ones(1, device=device) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    result = float(value.item())
    marks["allreduce_done"] = time.time()
    dist.destroy_process_group()
    marks["fn_end"] = time.time()
    _save_timings(timings_dir, marks, {"torch_preloaded": torch_preloaded})
    return result


def print_lines(count: int = 20_000, width: int = 60, import_torch: bool = True) -> int:
    """Print ``count`` numbered lines (``rank R seq I <padding>``) to stdout.

    Like a training job, it imports torch first (``import_torch=False`` skips that).

    Returns:
        The number of lines printed.
    """
    if import_torch:
        import torch  # noqa: F401  (what every training rank pays before it logs)
    rank = _rank()
    padding = "x" * max(0, width - 24)
    for seq in range(count):
        print(f"rank {rank} seq {seq} {padding}")
    sys.stdout.flush()
    return count


def big_tensor(mib: int = 256, return_it: bool = True) -> Any:
    """Build a float32 tensor of ``mib`` MiB of ones; return it (every rank does).

    Every rank returns it because pyspark's local mode returns whichever rank's value was
    written last; with equal values on all ranks both distributors must return the tensor.
    With ``return_it=False`` the same tensor is built and only its size is returned (the
    control run that isolates the cost of shipping the value back).
    """
    import torch

    tensor = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    if return_it:
        return tensor
    return int(tensor.numel())


def small_cnn() -> Any:
    """The benchmarks' small CNN for 28x28 single-channel images, 10 classes."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def train_cnn(
    steps: int = 200,
    batch_size: int = 64,
    warmup: int = 10,
    use_gpu: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """DDP training of a small CNN on synthetic 28x28 images for a fixed number of steps.

    The steady-state rate excludes ``warmup`` steps and is timed between two barriers, so it
    measures training speed, not launch time; rank 0's median step time is robust to a stall.

    Returns:
        Rank 0's figures: samples/s over all ranks, seconds timed, its median step, final
        loss, world size.
    """
    started = time.time()
    import statistics

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    if use_gpu:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    world = dist.get_world_size()
    torch.manual_seed(seed + dist.get_rank())
    model = small_cnn().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_gpu else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(batch_size * 8, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (batch_size * 8,), device=device)

    def step(index: int) -> float:
        lo = (index % 8) * batch_size
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(images[lo : lo + batch_size]), labels[lo : lo + batch_size])
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    for index in range(warmup):
        step(index)
    if use_gpu:
        torch.cuda.synchronize()
    dist.barrier()
    step_s = []
    timed_from = last = time.perf_counter()
    loss = 0.0
    for index in range(steps):
        loss = step(index)
        now = time.perf_counter()
        step_s.append(now - last)
        last = now
    if use_gpu:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - timed_from
    dist.destroy_process_group()
    return {
        "samples_per_s": steps * batch_size * world / seconds,
        "timed_s": seconds,
        "step_median_s": statistics.median(step_s),
        "steps": steps,
        "batch_size": batch_size,
        "world_size": world,
        "loss": loss,
        "rank_wall_s": time.time() - started,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    """Script entry point: ``python jobs.py <allreduce|lines|tensor|cnn> [options]``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job", choices=["allreduce", "lines", "tensor", "cnn"])
    parser.add_argument("--timings-dir", default=os.environ.get(ENV_TIMINGS_DIR))
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    if args.job == "allreduce":
        value = allreduce(args.timings_dir, args.gpu)
        if _rank() == 0:
            print("RESULT " + json.dumps({"sum": value}), flush=True)
    elif args.job == "lines":
        print_lines(args.count)
    elif args.job == "tensor":
        big_tensor()
    else:
        figures = train_cnn(args.steps, args.batch_size, args.warmup, args.gpu)
        if _rank() == 0:
            print("THROUGHPUT " + json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    # fn_start of a script run is taken here, after the interpreter started and argparse ran.
    sys.exit(main())
