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
ENV_STATS_DIR = "SPARKTORCH_BENCH_STATS_DIR"  # train_cnn's per-rank step figures (``cnn``)


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


def process_start_time(pid: int, boot: float | None = None) -> float:
    """When ``pid`` started, as a ``time.time()`` value (10 ms resolution)."""
    boot = _boot_time() if boot is None else boot
    return boot + int(_stat_fields(pid)[19]) / _clock_ticks()


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


def _rusage() -> list[float]:
    """This process's counters (all its threads): what :data:`RUSAGE_FIELDS` names, in order."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return [ru.ru_minflt, ru.ru_majflt, ru.ru_nvcsw, ru.ru_nivcsw, ru.ru_utime, ru.ru_stime]


RUSAGE_FIELDS = ("minflt", "majflt", "nvcsw", "nivcsw", "utime_s", "stime_s")
# The machine's CPU time (``/proc/stat``'s first line), in clock ticks.
PROC_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu() -> list[int]:
    """The whole machine's CPU ticks so far, by :data:`PROC_STAT_FIELDS` (empty if unknown).

    Taken at both ends of the steady state: less the ranks' own CPU, the busy ticks are what
    everything else ran meanwhile (other processes, our launcher's, the hypervisor's steal).
    """
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return []
    return [int(x) for x in fields[1 : 1 + len(PROC_STAT_FIELDS)]]


_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "Threads")
_ROLLUP_FIELDS = ("Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


def memory_figures() -> dict[str, int]:
    """RSS and its parts (KiB, from ``/proc/self/status`` and ``smaps_rollup``), OS threads.

    ``Shared_Dirty`` is memory written before a fork and still shared with the process forked
    from (or its other children): what copy-on-write would copy on the next write.
    """
    figures: dict[str, int] = {}
    for path, wanted in (
        ("/proc/self/status", _STATUS_FIELDS),
        ("/proc/self/smaps_rollup", _ROLLUP_FIELDS),
    ):
        try:
            with open(path) as handle:
                for line in handle:
                    key, _, rest = line.partition(":")
                    if key in wanted:
                        figures[key] = int(rest.split()[0])
        except OSError:
            continue
    return figures


class StepProbe:
    """Per-step wall time and ``getrusage`` deltas of a training loop, and the gc's work.

    ``tick()`` after every step records the seconds since the previous tick and the deltas of
    :data:`RUSAGE_FIELDS`; between ``start()`` and ``stop()`` a gc callback counts collections
    per generation and the seconds spent in them. The cost is two ``getrusage`` calls' worth
    per step (microseconds), the same in every launcher.
    """

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.deltas: list[list[float]] = [[] for _ in RUSAGE_FIELDS]
        self.gc_collections = [0, 0, 0]
        self.gc_s = 0.0
        self._gc_started = 0.0
        self._last_t = 0.0
        self._last_ru: list[float] = []

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_started
            generation = int(info.get("generation", 0))
            if 0 <= generation < 3:
                self.gc_collections[generation] += 1

    def start(self) -> None:
        import gc

        gc.callbacks.append(self._on_gc)
        self._last_ru = _rusage()
        self._last_t = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        ru = _rusage()
        self.step_s.append(now - self._last_t)
        for index, (after, before) in enumerate(zip(ru, self._last_ru, strict=True)):
            self.deltas[index].append(after - before)
        self._last_t = now
        self._last_ru = ru

    def stop(self) -> None:
        import gc

        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def record(self) -> dict[str, Any]:
        return {
            "step_s": [round(s, 7) for s in self.step_s],
            "per_step": {
                name: [round(v, 6) if isinstance(v, float) else v for v in values]
                for name, values in zip(RUSAGE_FIELDS, self.deltas, strict=True)
            },
            "gc_collections": self.gc_collections,
            "gc_s": self.gc_s,
        }


def _save_rank_stats(stats_dir: str | None, record: dict[str, Any]) -> None:
    """Ranks 0 and 1 write ``rank<R>.json`` under ``stats_dir`` (the others only measure)."""
    if not stats_dir or _rank() > 1:
        return
    path = os.path.join(stats_dir, f"rank{_rank()}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


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
    stats_dir: str | None = None,
) -> dict[str, Any]:
    """DDP training of a small CNN on synthetic 28x28 images for a fixed number of steps.

    The steady-state rate excludes ``warmup`` steps and is timed between two barriers, so it
    measures training speed, not launch time. Every rank also times each steady-state step
    and the ``getrusage`` deltas over it (:class:`StepProbe`); with ``stats_dir`` ranks 0
    and 1 write them there with their thread counts, CPU affinity, gc and memory figures and
    process ancestry (``rank<R>.json``).

    Returns:
        Rank 0's figures: samples/s over all ranks, seconds timed, final loss, world size.
    """
    started = time.time()
    ru_at_start = _rusage()
    import gc

    torch_preloaded = "torch" in sys.modules
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

    ru_after_setup = _rusage()
    warmup_s = []
    for index in range(warmup):
        step_started = time.perf_counter()
        step(index)
        warmup_s.append(time.perf_counter() - step_started)
    if use_gpu:
        torch.cuda.synchronize()
    memory_before = memory_figures() if stats_dir else {}
    gc_before = (gc.get_count(), [g["collections"] for g in gc.get_stats()])
    probe = StepProbe()
    dist.barrier()
    ru_steady_start = _rusage()
    cpu_steady_start = machine_cpu()
    timed_from = time.perf_counter()
    probe.start()
    loss = 0.0
    for index in range(steps):
        loss = step(index)
        probe.tick()
    probe.stop()
    if use_gpu:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - timed_from
    ru_steady_end = _rusage()
    cpu_steady_end = machine_cpu()
    if stats_dir:
        _save_rank_stats(
            stats_dir,
            {
                "rank": _rank(),
                "world_size": world,
                **probe.record(),
                "warmup_step_s": [round(s, 7) for s in warmup_s],
                "timed_s": seconds,
                "rusage_fields": list(RUSAGE_FIELDS),
                "rusage": {
                    "fn_start": ru_at_start,
                    "setup_done": ru_after_setup,
                    "steady_start": ru_steady_start,
                    "steady_end": ru_steady_end,
                },
                "machine_cpu_fields": list(PROC_STAT_FIELDS),
                "machine_cpu": {"steady_start": cpu_steady_start, "steady_end": cpu_steady_end},
                "clock_ticks": _clock_ticks(),
                "cpus": os.cpu_count(),
                "gc_count_before": list(gc_before[0]),
                "gc_count_after": list(gc.get_count()),
                "gc_stats_collections": [
                    after["collections"] - before
                    for after, before in zip(gc.get_stats(), gc_before[1], strict=True)
                ],
                "gc_frozen": gc.get_freeze_count(),
                "gc_enabled": gc.isenabled(),
                "torch_threads": torch.get_num_threads(),
                "torch_interop_threads": torch.get_num_interop_threads(),
                "affinity": sorted(os.sched_getaffinity(0)),
                "env": {
                    k: os.environ.get(k)
                    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "SPARKTORCH_OPS_WARM_AGENT")
                },
                "torch_preloaded": torch_preloaded,
                "memory_kib_before": memory_before,
                "memory_kib_after": memory_figures(),
                "chain": [
                    {"pid": e["pid"], "name": e["name"], "cmdline": e["cmdline"][:160]}
                    for e in process_chain(8)
                ],
            },
        )
    dist.destroy_process_group()
    return {
        "samples_per_s": steps * batch_size * world / seconds,
        "timed_s": seconds,
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
    parser.add_argument("--stats-dir", default=os.environ.get(ENV_STATS_DIR))
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
        figures = train_cnn(
            args.steps, args.batch_size, args.warmup, args.gpu, stats_dir=args.stats_dir
        )
        if _rank() == 0:
            print("THROUGHPUT " + json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    # fn_start of a script run is taken here, after the interpreter started and argparse ran.
    sys.exit(main())
