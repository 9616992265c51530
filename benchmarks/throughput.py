"""Training throughput: a small CNN, DDP on 2 ranks, fixed steps; ours vs bare torchrun.

The question (issue 16): do ranks forked from our torchrun agent (the default: the agent has
imported torch, the rank supervisors and the ranks are forked from it) train slower than the
fresh interpreters bare ``torchrun`` starts? The difference looked like a few percent, below
the noise of a 2-core machine, so this benchmark is built to resolve it:

- the same code (``jobs.train_cnn``) runs under every variant: bare ``torchrun`` (the
  baseline), ours in local mode as the default (script payload and function payload), ours
  with ``torchrun_args=["--start-method=spawn"]`` (each rank supervisor a fresh interpreter,
  the rank forked from it, so nothing is inherited from the agent) and ours with
  the warm agent off (``SPARKTORCH_OPS_WARM_AGENT=0`` in this process for that variant's run
  only; sparktorch_ops reads it at each run);
- paired rounds: every round runs each variant once, in an order rotated every round, after
  discarded warm-up rounds, so drift of a shared machine hits all of them alike; each round
  gives a paired ratio (variant's samples/s / torchrun's in the same round), and the figure is
  the geometric mean of those ratios with a bootstrap 95% confidence interval (resampling
  rounds). A CI that excludes 1.00 is a difference; its half-width is the resolution reached;
- inside every rank: the wall time and the ``getrusage`` deltas (minor/major faults,
  voluntary/involuntary context switches, user/system CPU) of every steady-state step, the
  gc's collections and time, torch's thread counts, the CPU affinity, RSS and how much of it
  is still shared dirty (copy-on-write pending) -- ranks 0 and 1 write them to a file in a
  temporary directory passed by argv (script) or argument (function). Copy-on-write faults on
  an inherited heap would show as minor faults per step; thread-pool state as thread counts
  and involuntary context switches;
- what else ran: the machine's busy CPU during rank 0's steady state less both ranks' own
  (``/proc/stat``; "other cores", hypervisor steal apart), and the CPU the driver and its
  long-lived descendants (a warm agent's fork server) used during each run, so a run disturbed
  by anything shows as such.

``SPARKTORCH_OPS_WARM_AGENT``, if set when this starts, is removed for the default variants.

Rank 0's steady state (``--steps`` steps after ``--warmup-steps`` untimed ones, between two barriers)
gives samples/s over all ranks. Both launchers get the same ``OMP_NUM_THREADS``
(``--omp-threads``, default: cores / 2, what ours would choose): torchrun's own default is 1
per rank whatever the machine.

    python benchmarks/throughput.py                      # the full run (20-25 min, 2 cores)
    python benchmarks/throughput.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import common
import pages
import psutil
from common import JOBS_SCRIPT, WARM_AGENT_ENV, log, median, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

import jobs

NAME = "throughput"
BASELINE = "torchrun"
# The default launch path with the script payload: the alternatives run the same payload, so
# "vs default" compares launch paths only.
DEFAULT = "ours_local_script"
VARIANTS = {
    "torchrun": "bare torchrun: ranks are fresh interpreters (baseline)",
    "ours_local_script": "ours, default: ranks forked from the agent; script payload",
    "ours_local_fn": "ours, default: ranks forked from the agent; function payload",
    "ours_local_script_spawn": (
        "ours, torchrun_args=['--start-method=spawn']: supervisors are fresh interpreters, "
        "each rank forked from its own"
    ),
    "ours_local_script_cold": f"ours, warm agent off ({WARM_AGENT_ENV}=0); script payload",
}
BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95
# Per-step counters kept per variant (means per step over every run and both reporting ranks).
COUNTERS = ("minflt", "majflt", "nvcsw", "nivcsw", "utime_s", "stime_s")


# -- statistics ------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between order statistics; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def geomean_ci(
    ratios: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 16,
) -> dict[str, Any]:
    """Geometric mean of paired ratios and its percentile-bootstrap CI (resampling rounds).

    The seed is fixed, so the same samples always give the same interval.
    """
    logs = [math.log(r) for r in ratios if r and r > 0]
    n = len(logs)
    if not n:
        return {"geomean": None, "ci_low": None, "ci_high": None, "median": None, "rounds": 0}
    point = math.exp(statistics.fmean(logs))
    low = high = None
    if n >= 2:
        rng = random.Random(seed)
        means = sorted(statistics.fmean(rng.choices(logs, k=n)) for _ in range(resamples))
        tail = (1 - confidence) / 2
        low = math.exp(means[int(tail * resamples)])
        high = math.exp(means[min(resamples - 1, math.ceil((1 - tail) * resamples) - 1)])
    return {
        "geomean": point,
        "ci_low": low,
        "ci_high": high,
        "median": statistics.median(ratios),
        "rounds": n,
        "ratios": [round(r, 5) for r in ratios],
    }


def verdict(ci: dict[str, Any]) -> str:
    """'slower' / 'faster' when the CI excludes 1.00, else 'no difference'."""
    low, high = ci.get("ci_low"), ci.get("ci_high")
    if low is None or high is None:
        return "-"
    if high < 1.0:
        return "slower"
    if low > 1.0:
        return "faster"
    return "no difference"


def paired(
    per_round: dict[str, dict[int, float]], name: str, reference: str, invert: bool = False
) -> dict[str, Any]:
    """CI of ``name``'s figure / ``reference``'s, paired by round (``invert``: reference / name)."""
    mine, theirs = per_round.get(name, {}), per_round.get(reference, {})
    rounds = sorted(set(mine) & set(theirs))
    ratios = [
        (theirs[r] / mine[r]) if invert else (mine[r] / theirs[r])
        for r in rounds
        if mine[r] and theirs[r]
    ]
    return geomean_ci(ratios)


# -- running ---------------------------------------------------------------------------------
def parse_figures(stdout: str) -> dict[str, Any]:
    """Rank 0's ``THROUGHPUT {json}`` line."""
    for line in stdout.splitlines():
        if "THROUGHPUT " in line:
            return dict(json.loads(line.split("THROUGHPUT ", 1)[1]))
    raise AssertionError(f"no THROUGHPUT line in rank 0's output: {stdout[-500:]!r}")


def helper_cpu(pids: Any = None) -> dict[int, float]:
    """CPU seconds so far of this driver's descendants (or of ``pids`` among them).

    Taken before a run (the descendants then are long-lived helpers, such as a warm agent's
    fork server) and after it for the same processes: what they used during the run.
    """
    out = {}
    for proc in psutil.Process().children(recursive=True):
        if pids is not None and proc.pid not in pids:
            continue
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[proc.pid] = times.user + times.system
    return out


class Runner:
    """Builds each variant's run-once callable; every run gets a fresh stats directory.

    ``common.alternate`` calls every variant once per round, so a variant's n-th call is round
    ``n - warmup_rounds`` (negative: a warm-up round).
    """

    def __init__(self, args: argparse.Namespace, omp: str | None, names: list[str]) -> None:
        self.args = args
        self.env = {"OMP_NUM_THREADS": omp} if omp else {}
        self.names = names
        self.calls = dict.fromkeys(names, 0)
        self.round_started: dict[int, float] = {}
        self.logger = common.quiet_logger()

    def script_args(self, stats_dir: str) -> list[str]:
        a = self.args
        argv = ["cnn", f"--steps={a.steps}", f"--batch-size={a.batch_size}"]
        argv += [f"--warmup={a.warmup_steps}", f"--stats-dir={stats_dir}"]
        return argv + (["--gpu"] if a.gpu else [])

    def ours(self, *torchrun_args: str) -> Any:
        from sparktorch_ops import TorchDistributor

        return TorchDistributor(
            num_processes=2,
            local_mode=True,
            use_gpu=self.args.gpu,
            env=self.env,
            logger=self.logger,
            timeout=self.args.timeout,
            torchrun_args=torchrun_args,
        )

    def launch(self, name: str, stats_dir: str) -> dict[str, Any]:
        a = self.args
        script = str(JOBS_SCRIPT)
        if name == "torchrun":
            proc = common.run_torchrun(
                JOBS_SCRIPT, self.script_args(stats_dir), env=self.env, timeout=a.timeout
            )
            return parse_figures(proc.stdout)
        if name == "ours_local_script":
            return parse_figures(self.ours().run(script, *self.script_args(stats_dir)))
        if name == "ours_local_fn":
            fn = functools.partial(
                jobs.train_cnn, a.steps, a.batch_size, a.warmup_steps, a.gpu, 0, stats_dir
            )
            return dict(self.ours().run(fn))
        if name == "ours_local_script_spawn":
            job = self.ours("--start-method=spawn")
            return parse_figures(job.run(script, *self.script_args(stats_dir)))
        if name == "ours_local_script_cold":
            with common.env_var(WARM_AGENT_ENV, "0"):
                return parse_figures(self.ours().run(script, *self.script_args(stats_dir)))
        raise ValueError(f"unknown variant {name!r}")

    def build(self, name: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            call = self.calls[name]
            self.calls[name] += 1
            round_index = call - self.args.warmup
            if round_index not in self.round_started:
                self.round_started[round_index] = time.time()
                self.log_round(round_index - 1)
            stats_dir = tempfile.mkdtemp(prefix="sparktorch-thr-")
            started = time.time()
            load1 = os.getloadavg()[0]
            helpers = helper_cpu()
            try:
                figures = self.launch(name, stats_dir)
                helpers_cpu = sum(
                    max(0.0, seconds - helpers[pid]) for pid, seconds in helper_cpu(helpers).items()
                )
                ranks = {
                    int(path.stem.removeprefix("rank")): json.loads(path.read_text())
                    for path in sorted(Path(stats_dir).glob("rank*.json"))
                }
            finally:
                shutil.rmtree(stats_dir, ignore_errors=True)
            return {
                "round": round_index,
                "started": started,
                "load1": load1,
                "helpers_cpu_s": helpers_cpu,
                "figures": figures,
                "ranks": ranks,
            }

        return run

    def log_round(self, round_index: int) -> None:
        """When the next round starts: how long this one took, and about how long is left."""
        if round_index not in self.round_started:
            return
        took = time.time() - self.round_started[round_index]
        left = self.args.repeats - 1 - round_index
        label = "warm-up round" if round_index < 0 else f"round {round_index + 1}"
        log(f"{label} took {took:.1f} s; about {left * took / 60:.1f} min left")


def check(name: str, value: Any) -> dict[str, Any]:
    """A run's figures must come from 2 ranks, and both reporting ranks must have written."""
    figures = value.get("figures") if isinstance(value, dict) else None
    if not isinstance(figures, dict) or figures.get("world_size") != 2:
        raise AssertionError(f"{name}: unexpected figures {figures!r}")
    if sorted(value["ranks"]) != [0, 1]:
        raise AssertionError(f"{name}: rank stats from ranks {sorted(value['ranks'])}, want 0, 1")
    return dict(value)


# -- summaries -------------------------------------------------------------------------------
def _mib(kib: Any) -> float | None:
    return kib / 1024 if isinstance(kib, (int, float)) else None


def _label(entry: dict[str, Any]) -> str:
    """A process of a rank's ancestry: its name, or for a plain interpreter what it runs."""
    name = re.sub(r"-\d+$", "-N", entry["name"])
    if not name.startswith("python"):
        return name
    argv = entry.get("cmdline", "").split()
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    scripts = [a for a in argv[1:] if not a.startswith("-")]
    return Path(scripts[0]).name if scripts else name


def ancestry(chain: list[dict[str, Any]], driver: int) -> tuple[str, int | None]:
    """The processes from the rank up to this driver, and how many levels apart they are.

    Bare torchrun: rank < torchrun agent (2 levels); ours cold: rank < supervisor < agent
    (3); ours from a warm agent: one more, the fork server the agent was forked from.
    """
    pids = [e["pid"] for e in chain]
    depth = pids.index(driver) if driver in pids else None
    shown = chain[:depth] if depth is not None else chain
    return " < ".join([*map(_label, shown), "driver" if depth is not None else "?"]), depth


def rank_summary(record: dict[str, Any], driver: int | None = None) -> dict[str, Any]:
    """One rank's figures of one run: step time percentiles, counters per step, state."""
    steps = record["step_s"]
    n = max(1, len(steps))
    per_step = record["per_step"]
    ru = record["rusage"]
    fields = record["rusage_fields"]
    before = {
        f: ru["steady_start"][i] - ru["fn_start"][i]
        for i, f in enumerate(fields)
        if f in ("minflt", "majflt")
    }
    memory_before = record.get("memory_kib_before") or {}
    memory_after = record.get("memory_kib_after") or {}
    lineage, depth = ancestry(record.get("chain", []), driver or os.getpid())
    return {
        "step_median_ms": 1000 * (median(steps) or 0.0),
        "step_mean_ms": 1000 * statistics.fmean(steps) if steps else None,
        "step_p90_ms": 1000 * (percentile(steps, 90) or 0.0),
        "step_p99_ms": 1000 * (percentile(steps, 99) or 0.0),
        "step_max_ms": 1000 * max(steps) if steps else None,
        "steps": len(steps),
        **{f"{c}_per_step": sum(per_step[c]) / n for c in COUNTERS},
        "minflt_before_steady": before.get("minflt"),
        "majflt_before_steady": before.get("majflt"),
        "gc_collections": record["gc_collections"],
        "gc_stats_collections": record.get("gc_stats_collections"),
        "gc_ms": 1000 * record["gc_s"],
        "gc_count_before": record.get("gc_count_before"),
        "gc_frozen": record.get("gc_frozen"),
        "warmup_step_ms": [round(1000 * s, 2) for s in record.get("warmup_step_s", [])],
        "torch_threads": record.get("torch_threads"),
        "torch_interop_threads": record.get("torch_interop_threads"),
        "affinity": record.get("affinity"),
        "os_threads": memory_before.get("Threads"),
        "rss_mib": _mib(memory_after.get("VmRSS")),
        "rss_anon_mib": _mib(memory_after.get("RssAnon")),
        "shared_dirty_mib_before": _mib(memory_before.get("Shared_Dirty")),
        "shared_dirty_mib_after": _mib(memory_after.get("Shared_Dirty")),
        "private_dirty_mib_after": _mib(memory_after.get("Private_Dirty")),
        "torch_preloaded": record.get("torch_preloaded"),
        "env": record.get("env"),
        "ancestry": lineage,
        "driver_depth": depth,
    }


def _mean(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(numbers) if numbers else None


def _r(value: Any, digits: int = 4) -> Any:
    """Rounded to ``digits`` significant digits (the JSON keeps every run: keep it small)."""
    if not isinstance(value, float) or value == 0 or not math.isfinite(value):
        return value
    return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))


# Per-run figures, each the mean over the reporting ranks (0 and 1).
RUN_FIGURES = (
    *(f"{c}_per_step" for c in COUNTERS),
    "minflt_before_steady",
    "majflt_before_steady",
    "gc_ms",
    "rss_mib",
    "shared_dirty_mib_before",
    "shared_dirty_mib_after",
    "private_dirty_mib_after",
)


def other_cpu(records: dict[int, dict[str, Any]]) -> dict[str, float | None]:
    """What else the machine ran during rank 0's steady state, in cores (busy CPU / wall).

    ``other_cores``: busy CPU time less both ranks' own (user + system over their steady-state
    steps); ``steal_cores``: time the hypervisor gave to other guests. On a quiet machine both
    are near 0; a disturbed run shows here, whatever disturbed it.
    """
    rank0 = records.get(0) or {}
    cpu = rank0.get("machine_cpu") or {}
    start, end = cpu.get("steady_start") or [], cpu.get("steady_end") or []
    timed = rank0.get("timed_s")
    if not start or not end or not timed:
        return {"other_cores": None, "steal_cores": None}
    fields = rank0["machine_cpu_fields"]
    delta = dict(zip(fields, (b - a for a, b in zip(start, end, strict=True)), strict=True))
    tick = 1 / rank0.get("clock_ticks", 100)
    busy = sum(v for k, v in delta.items() if k not in ("idle", "iowait", "steal")) * tick
    ranks_cpu = sum(
        sum(r["per_step"]["utime_s"]) + sum(r["per_step"]["stime_s"]) for r in records.values()
    )
    return {
        "other_cores": (busy - ranks_cpu) / timed if len(records) == 2 else None,
        "steal_cores": delta.get("steal", 0) * tick / timed,
    }


def run_figures(
    extra: dict[str, Any], wall: float, ranks: list[dict[str, Any]], pooled: list[float]
) -> dict[str, Any]:
    """One run's figures for the JSON: rank 0's rate, step times of both ranks, counters."""
    figures = extra["figures"]
    return {
        "round": extra["round"],
        "started": round(extra["started"], 2),
        "load1": extra["load1"],
        "helpers_cpu_s": _r(extra["helpers_cpu_s"], 3),
        "wall_s": _r(wall),
        "samples_per_s": _r(figures["samples_per_s"], 5),
        "timed_s": _r(figures["timed_s"]),
        "step_median_ms": [_r(r["step_median_ms"]) for r in ranks],
        "step_p90_ms": _r(percentile(pooled, 90) * 1000) if pooled else None,
        "step_p99_ms": _r(percentile(pooled, 99) * 1000) if pooled else None,
        **{k: _r(_mean([r[k] for r in ranks])) for k in RUN_FIGURES},
        "gc_collections": [sum(r["gc_collections"][g] for r in ranks) for g in range(3)],
        "driver_depth": sorted({r["driver_depth"] for r in ranks}, key=str),
        **{k: _r(v, 3) for k, v in other_cpu(extra["ranks"]).items()},
    }


def warmup_profile(per_rank: list[dict[str, Any]]) -> list[float | None]:
    """The median over runs and ranks of each warm-up step's time (ms): it should settle."""
    profiles = [r["warmup_step_ms"] for r in per_rank]
    longest = max((len(p) for p in profiles), default=0)
    return [_r(median([p[i] for p in profiles if len(p) > i]), 3) for i in range(longest)]


def variant_summary(series: common.Series, keep_steps: bool) -> dict[str, Any]:
    """Medians and pooled figures of one variant, and every run's own figures."""
    summary = series.summary()
    runs = []
    pooled: list[float] = []
    head: list[float] = []  # the first 10 steady-state steps of every run
    tail: list[float] = []
    per_rank: list[dict[str, Any]] = []
    for extra, wall in zip(series.extra, series.seconds, strict=True):
        ranks, steps = [], []
        for _, record in sorted(extra["ranks"].items()):
            ranks.append(rank_summary(record))
            steps.extend(record["step_s"])
            head.extend(record["step_s"][:10])
            tail.extend(record["step_s"][10:])
        pooled.extend(steps)
        per_rank.extend(ranks)
        run = run_figures(extra, wall, ranks, steps)
        if keep_steps:
            run["step_s"] = {str(k): r["step_s"] for k, r in sorted(extra["ranks"].items())}
        runs.append(run)
    rates = [r["samples_per_s"] for r in runs]
    threads = sorted(
        {
            f"{r['torch_threads']}/{r['torch_interop_threads']}/"
            f"{len(r['affinity'] or [])}/{r['os_threads']}"
            for r in per_rank
        }
    )
    summary.update(
        {
            "samples_per_s_median": median(rates),
            "samples_per_s": [round(x, 1) for x in rates],
            "step_median_ms": median([s * 1000 for s in pooled]),
            "step_p90_ms": 1000 * (percentile(pooled, 90) or 0.0) if pooled else None,
            "step_p99_ms": 1000 * (percentile(pooled, 99) or 0.0) if pooled else None,
            # > 1 would mean the first steady-state steps are still slower (warm-up too short)
            "steady_first10_over_rest": ratio(median(head), median(tail)),
            "warmup_profile_ms": warmup_profile(per_rank),
            **{f"{c}_per_step": _mean([r[f"{c}_per_step"] for r in per_rank]) for c in COUNTERS},
            "minflt_before_steady": _mean([r["minflt_before_steady"] for r in per_rank]),
            "other_cores": _mean([r["other_cores"] for r in runs]),
            "other_cores_max": max(
                (r["other_cores"] for r in runs if r["other_cores"] is not None), default=None
            ),
            "steal_cores": _mean([r["steal_cores"] for r in runs]),
            "helpers_cpu_median_s": median([r["helpers_cpu_s"] for r in runs]),
            "gc_collections_per_run": _mean([sum(r["gc_collections"]) for r in per_rank]),
            "gc_full_per_run": _mean([r["gc_collections"][2] for r in per_rank]),
            "gc_ms_per_run": _mean([r["gc_ms"] for r in per_rank]),
            "gc_frozen_seen": sorted({r["gc_frozen"] for r in per_rank}, key=str),
            "rss_mib": _mean([r["rss_mib"] for r in per_rank]),
            "shared_dirty_mib_before": _mean([r["shared_dirty_mib_before"] for r in per_rank]),
            "threads_seen": threads,
            "affinity_seen": sorted({str(r["affinity"]) for r in per_rank}),
            "torch_preloaded_seen": sorted({str(r["torch_preloaded"]) for r in per_rank}),
            "env_seen": sorted({json.dumps(r["env"], sort_keys=True) for r in per_rank}),
            "ancestry_seen": sorted({r["ancestry"] for r in per_rank}),
            "driver_depth_seen": sorted({r["driver_depth"] or 0 for r in per_rank}),
            "run_figures": runs,
        }
    )
    return summary


def round_figures(series: dict[str, common.Series], what: str) -> dict[str, dict[int, float]]:
    """variant -> round -> a run's figure: 'rate' (samples/s) or 'step' (rank 0's median step)."""
    out: dict[str, dict[int, float]] = {}
    for name, s in series.items():
        for extra in s.extra:
            if what == "rate":
                value = extra["figures"]["samples_per_s"]
            else:
                value = median(extra["ranks"][0]["step_s"]) or 0.0
            out.setdefault(name, {})[extra["round"]] = value
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(names) - set(VARIANTS)
    if unknown or BASELINE not in names:
        raise SystemExit(f"unknown variants {sorted(unknown)}, or no {BASELINE}")
    omp = str(args.omp_threads) if args.omp_threads > 0 else None
    runner = Runner(args, omp, names)
    started = time.time()
    with contextlib.ExitStack() as stack:
        if WARM_AGENT_ENV in os.environ:  # every variant but *_cold runs with the default
            stack.enter_context(common.env_var(WARM_AGENT_ENV, None))
        series = common.alternate(
            {name: runner.build(name) for name in names},
            args.repeats,
            warmup=args.warmup,
            check=check,
            settle_s=args.settle,
        )
    runner.log_round(args.repeats - 1)
    took = time.time() - started

    rates = round_figures(series, "rate")
    steps = round_figures(series, "step")
    base_rate = median(list(rates.get(BASELINE, {}).values()))
    base_wall = median(series[BASELINE].seconds)
    results: dict[str, Any] = {}
    for name, s in series.items():
        summary = variant_summary(s, args.keep_steps)
        summary["description"] = VARIANTS[name]
        summary["rate_ratio_vs_torchrun"] = ratio(summary["samples_per_s_median"], base_rate)
        summary["wall_ratio_vs_torchrun"] = ratio(summary["median_s"], base_wall)
        if name == BASELINE:
            n = len(rates.get(name, {}))
            summary["ratio_vs_torchrun"] = {"geomean": 1.0, "rounds": n, "verdict": "baseline"}
            summary["step_ratio_vs_torchrun"] = {"geomean": 1.0, "rounds": n}
        else:
            summary["ratio_vs_torchrun"] = paired(rates, name, BASELINE)
            summary["ratio_vs_torchrun"]["verdict"] = verdict(summary["ratio_vs_torchrun"])
            # torchrun's median step / ours: > 1 is faster, like the rate ratio
            summary["step_ratio_vs_torchrun"] = paired(steps, name, BASELINE, invert=True)
        if DEFAULT in series and name.startswith("ours") and name != DEFAULT:
            summary["ratio_vs_default"] = paired(rates, name, DEFAULT)
            summary["ratio_vs_default"]["verdict"] = verdict(summary["ratio_vs_default"])
        results[name] = summary
    log(f"done in {took / 60:.1f} min")
    return {
        "repeats": args.repeats,
        "warmup_rounds": args.warmup,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "warmup_steps": args.warmup_steps,
        "omp_num_threads": omp,
        "use_gpu": args.gpu,
        "baseline": BASELINE,
        "default": DEFAULT,
        "confidence": CONFIDENCE,
        "bootstrap_resamples": BOOTSTRAP_RESAMPLES,
        "duration_s": round(took, 1),
        "variants": results,
        "notes": (
            "samples/s: rank 0's steady state over all ranks (between barriers, after the "
            "warm-up steps). Ratios are paired by round: the geometric mean over rounds of "
            "a variant's samples/s over bare torchrun's in the same round, with a "
            f"percentile-bootstrap {CONFIDENCE:.0%} CI from {BOOTSTRAP_RESAMPLES:,} "
            "resamples of the rounds; *vs default* pairs with ours_local_script the same "
            "way. Counters are getrusage(RUSAGE_SELF) deltas over each steady-state step "
            "(every thread of the rank), averaged over ranks 0 and 1 and every run; "
            "*faults before*: minor faults from the job's start to the steady state "
            "(import, setup, warm-up steps). Variants *_cold run with "
            f"{WARM_AGENT_ENV}=0 in the driver."
        ),
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Throughput"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    variants = doc["variants"]
    default = doc.get("default", "ours_local_script")
    rows, counters, lineages = [], [], []
    for name, s in variants.items():
        r = s.get("ratio_vs_torchrun") or {}
        rows.append(
            [
                f"`{name}`",
                s.get("description", "-"),
                pages.num(s.get("samples_per_s_median"), 0),
                pages.ci(r),
                r.get("verdict", "-"),
                pages.ci(s.get("step_ratio_vs_torchrun")),
                pages.ci(s.get("ratio_vs_default")) if name != default else "-",
                pages.num(s.get("median_s")),
                pages.num(s.get("wall_ratio_vs_torchrun"), suffix="x"),
                f"{pages.num(s.get('driver_cpu_median_s'))} / {pages.num(s.get('helpers_cpu_median_s'))}",
                f"{s.get('runs')}{pages.errors(s)}",
            ]
        )
        stime = s.get("stime_s_per_step")
        counters.append(
            [
                f"`{name}`",
                f"{pages.num(s.get('step_median_ms'))} / {pages.num(s.get('step_p90_ms'))} / "
                f"{pages.num(s.get('step_p99_ms'))}",
                pages.num(s.get("minflt_per_step"), 1),
                pages.num(s.get("majflt_per_step"), 2),
                pages.num(s.get("nvcsw_per_step"), 1),
                pages.num(s.get("nivcsw_per_step"), 2),
                pages.num(stime * 1000 if isinstance(stime, (int, float)) else None, 2),
                pages.num(s.get("minflt_before_steady"), 0),
                f"{pages.num(s.get('other_cores'), 2)} ({pages.num(s.get('other_cores_max'), 2)})",
                pages.num(s.get("steal_cores"), 2),
                f"{pages.num(s.get('gc_collections_per_run'), 1)} ({pages.num(s.get('gc_full_per_run'), 1)})",
                pages.num(s.get("rss_mib"), 0),
                pages.num(s.get("shared_dirty_mib_before"), 0),
                ", ".join(s.get("threads_seen") or []) or "-",
                ", ".join(map(str, s.get("gc_frozen_seen") or [])) or "-",
            ]
        )
        if s.get("ancestry_seen"):
            lineages.append(f"`{name}`: " + "; ".join(f"`{a}`" for a in s["ancestry_seen"]))
    confidence = doc.get("confidence", 0.95)
    return (
        f"Small CNN, DDP on 2 ranks, {doc.get('steps')} steps x batch {doc.get('batch_size')} "
        f"after {doc.get('warmup_steps')} warm-up steps, "
        f"OMP_NUM_THREADS={doc.get('omp_num_threads')}; {doc.get('repeats')} paired rounds "
        f"(each runs every variant once, the order rotated, after {doc.get('warmup_rounds', 1)} "
        f"dropped warm-up round(s)), {pages.num((doc.get('duration_s') or 0) / 60, 0)} min in all. "
        "*vs torchrun*: the geometric mean over rounds of the variant's samples/s over bare "
        f"torchrun's in the same round, with a bootstrap {confidence:.0%} confidence interval "
        "(resampling rounds); a CI that excludes 1.000x is a difference (*verdict*). *from "
        "median step*: the same from rank 0's median step time (robust to stalls). *vs "
        f"default*: paired the same way with `{default}`. Wall time includes the launch. "
        "*CPU s*: medians per run of the driver's own CPU and of its long-lived descendants' "
        "(such as the warm agent's fork server) during the run.\n\n"
        + pages.table(
            [
                "variant",
                "what",
                "samples/s",
                "vs torchrun (95% CI)",
                "verdict",
                "from median step",
                "vs default",
                "wall s",
                "wall vs torchrun",
                "CPU s: driver / helpers",
                "runs",
            ],
            rows,
        )
        + "\n\nInside the ranks, steady-state steps only, per step (means over ranks 0 and 1 "
        "and every run): `getrusage(RUSAGE_SELF)` deltas, all of the rank's threads. "
        "Copy-on-write faults on a heap inherited from the agent would show as minor faults "
        "per step; thread-pool state as thread counts and involuntary context switches. "
        "*other cores busy*: the machine's busy CPU during rank 0's steady state less both "
        "ranks' own, in cores (mean, and the worst run): anything else that ran, our launcher's "
        "processes included; *steal*: CPU the hypervisor gave to other guests.\n\n"
        + pages.table(
            [
                "variant",
                "step ms p50 / p90 / p99",
                "minor faults",
                "major faults",
                "voluntary ctx sw",
                "involuntary ctx sw",
                "system CPU ms",
                "minor faults before steady state",
                "other cores busy (max)",
                "steal cores",
                "gc collections / run (full)",
                "RSS MiB",
                "shared dirty MiB",
                "threads intra/inter/CPUs/OS",
                "gc-frozen objects",
            ],
            counters,
        )
        + (
            "\n\nA rank's ancestors up to the driver (a warm agent is forked from a fork "
            "server, which shows as one more level):\n\n" + "\n".join(f"- {x}" for x in lineages)
            if lineages
            else ""
        )
        + pages.notes(doc.get("notes"))
        + "\n\n"
        + READING
    )


READING = (
    "Reading it: whether ranks forked from the agent train slower than fresh interpreters is a "
    "question of a few percent; the counters inside the ranks would show a mechanism: minor "
    "faults per step (copy-on-write of the inherited heap), context switches and thread counts "
    "(thread pools), gc collections. None differs against forked ranks: they take fewer minor "
    "faults per step than fresh ones (the inherited pages are never copied in the steady "
    "state), the same threads and affinity, no collection. A one-step-each-in-turn A/B went "
    'further (docs/internals.md, "Ranks are forked, not spawned"): its control, bare '
    "torchrun against itself, moves as much between sessions as any of ours; a process's own "
    "memory layout sets its speed by several percent on this VM, and that, not the fork, is "
    "what the intervals contain."
)


def _throughput_summary_row(doc: dict[str, Any]) -> list[str]:
    """The default's paired ratio with its CI (the slower payload), then the alternatives'."""
    v = doc["variants"]

    def point(name: str) -> float:
        return (v[name].get("ratio_vs_torchrun") or {}).get("geomean") or 0.0

    defaults = [n for n in ("ours_local_script", "ours_local_fn") if n in v]
    default = min(defaults, key=point) if defaults else None
    labels = ["default: ranks forked from the agent"]
    values = [pages.ci(v[default].get("ratio_vs_torchrun"), 2) if default else "-"]
    for suffix, label in (("_spawn", "spawned ranks"), ("_cold", "warm agent off")):
        for name in v:
            if name.startswith("ours") and name.endswith(suffix):
                labels.append(label)
                values.append(pages.ci(v[name].get("ratio_vs_torchrun"), 2))
    rounds = (v[default].get("ratio_vs_torchrun") or {}).get("rounds") if default else None
    return [
        "throughput, DDP CNN",
        f"samples/s / bare torchrun's, geometric mean of {rounds} paired rounds (95% CI): "
        + "; ".join(labels),
        "; ".join(values),
        "-",
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=150, help="timed training steps per run")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=20, help="untimed steps per run")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="0: each launcher's own default",
    )
    parser.add_argument("--gpu", action="store_true", help="use_gpu=True, nccl")
    parser.add_argument(
        "--keep-steps", action="store_true", help="also write every step's time to the JSON"
    )


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    about="a small CNN, DDP, fixed steps: samples/s (rank 0, steady state) of bare torchrun vs "
    "ours, with ranks forked (the default; function and script), with "
    "`--start-method=spawn` and with the warm agent off, in paired rounds with a bootstrap CI "
    "per ratio; per-step times, page faults, context switches, gc and threads inside the ranks",
    measure=measure,
    render=render,
    # 30 rounds of 150 steps: about 35-45 s a round on 2 quiet cores, 20-25 min in all; a
    # multiple of the 5 variants, so each runs as often in every position of the rotation.
    summary=lambda doc: [_throughput_summary_row(doc)],
    options=options,
    defaults={"repeats": 30},
    quick=("--repeats=1", "--warmup=0", "--steps=20", "--warmup-steps=5"),
    headline=True,
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
