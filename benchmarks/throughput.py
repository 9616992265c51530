"""Training throughput: a small CNN, DDP on 2 ranks, fixed steps; ours vs bare torchrun.

Do ranks forked from our torchrun agent (the default: the agent has imported torch, the rank
supervisors and the ranks are forked from it) train slower than the fresh interpreters bare
``torchrun`` starts? The difference is a few percent at most, below the noise of a 2-core
machine, so the variants are paired:

- the same code (``jobs.train_cnn``) runs under every variant: bare ``torchrun`` (the
  baseline), ours in local mode as the default (script payload and function payload), ours
  with ``torchrun_args=["--start-method=spawn"]`` (each rank supervisor a fresh interpreter,
  the rank forked from it, so nothing is inherited from the agent) and ours with the warm
  agent off (``SPARKTORCH_OPS_WARM_AGENT=0`` in this process for that variant's run only;
  sparktorch_ops reads it at each run);
- paired rounds: every round runs each variant once, in an order rotated every round, after
  discarded warm-up rounds, so drift of a shared machine hits all of them alike; each round
  gives a paired ratio (variant's samples/s / torchrun's in the same round), and the figure is
  the geometric mean of those ratios with a bootstrap 95% confidence interval (resampling
  rounds). A CI that excludes 1.00 is a difference; its half-width is the resolution reached;
- the CPU the driver and its long-lived descendants (a warm agent's fork server) used during
  each run, so a run disturbed by our own processes shows as such.

What the ranks do inside (faults, context switches, threads, memory shared with the agent)
was measured once and is in docs/internals.md ("Ranks are forked, not spawned").
``SPARKTORCH_OPS_WARM_AGENT``, if set when this starts, is removed for the default variants.

Rank 0's steady state (``--steps`` steps after ``--warmup-steps`` untimed ones, between two
barriers) gives samples/s over all ranks. Both launchers get the same ``OMP_NUM_THREADS``
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
import statistics
import sys
import time
from collections.abc import Callable, Sequence
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


# -- statistics ------------------------------------------------------------------------------
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
    """Builds each variant's run-once callable.

    ``common.alternate`` calls every variant once per round, so a variant's n-th call is round
    ``n - warmup`` (negative: a warm-up round).
    """

    def __init__(self, args: argparse.Namespace, omp: str | None, names: list[str]) -> None:
        self.args = args
        self.env = {"OMP_NUM_THREADS": omp} if omp else {}
        self.calls = dict.fromkeys(names, 0)
        self.logger = common.quiet_logger()

    def script_args(self) -> list[str]:
        a = self.args
        argv = ["cnn", f"--steps={a.steps}", f"--batch-size={a.batch_size}"]
        return argv + [f"--warmup={a.warmup_steps}"] + (["--gpu"] if a.gpu else [])

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

    def launch(self, name: str) -> dict[str, Any]:
        a = self.args
        script = str(JOBS_SCRIPT)
        if name == "torchrun":
            proc = common.run_torchrun(
                JOBS_SCRIPT, self.script_args(), env=self.env, timeout=a.timeout
            )
            return parse_figures(proc.stdout)
        if name == "ours_local_fn":
            fn = functools.partial(jobs.train_cnn, a.steps, a.batch_size, a.warmup_steps, a.gpu)
            return dict(self.ours().run(fn))
        if name == "ours_local_script_spawn":
            return parse_figures(self.ours("--start-method=spawn").run(script, *self.script_args()))
        if name == "ours_local_script_cold":
            with common.env_var(WARM_AGENT_ENV, "0"):
                return parse_figures(self.ours().run(script, *self.script_args()))
        return parse_figures(self.ours().run(script, *self.script_args()))

    def build(self, name: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            round_index = self.calls[name] - self.args.warmup
            self.calls[name] += 1
            started = time.time()
            load1 = os.getloadavg()[0]
            helpers = helper_cpu()
            figures = self.launch(name)
            return {
                "round": round_index,
                "started": started,
                "load1": load1,
                "helpers_cpu_s": sum(
                    max(0.0, seconds - helpers[pid]) for pid, seconds in helper_cpu(helpers).items()
                ),
                "figures": figures,
            }

        return run


def check(name: str, value: Any) -> dict[str, Any]:
    """A run's figures must come from 2 ranks."""
    figures = value.get("figures") if isinstance(value, dict) else None
    if not isinstance(figures, dict) or figures.get("world_size") != 2:
        raise AssertionError(f"{name}: unexpected figures {figures!r}")
    return dict(value)


# -- summaries -------------------------------------------------------------------------------
def variant_summary(series: common.Series) -> dict[str, Any]:
    """Medians of one variant, and every run's own figures."""
    summary = series.summary()
    runs = [
        {
            "round": extra["round"],
            "started": round(extra["started"], 2),
            "load1": extra["load1"],
            "helpers_cpu_s": round(extra["helpers_cpu_s"], 3),
            "wall_s": round(wall, 3),
            "samples_per_s": round(extra["figures"]["samples_per_s"], 1),
            "timed_s": round(extra["figures"]["timed_s"], 3),
            "step_median_ms": round(1000 * extra["figures"]["step_median_s"], 3),
        }
        for extra, wall in zip(series.extra, series.seconds, strict=True)
    ]
    summary.update(
        {
            "samples_per_s_median": median([r["samples_per_s"] for r in runs]),
            "samples_per_s": [r["samples_per_s"] for r in runs],
            "step_median_ms": median([r["step_median_ms"] for r in runs]),
            "helpers_cpu_median_s": median([r["helpers_cpu_s"] for r in runs]),
            "run_figures": runs,
        }
    )
    return summary


def round_figures(series: dict[str, common.Series], what: str) -> dict[str, dict[int, float]]:
    """variant -> round -> a run's figure: ``samples_per_s`` or rank 0's ``step_median_s``."""
    return {
        name: {extra["round"]: extra["figures"][what] for extra in s.extra}
        for name, s in series.items()
    }


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
    took = time.time() - started

    rates = round_figures(series, "samples_per_s")
    steps = round_figures(series, "step_median_s")
    base_rate = median(list(rates.get(BASELINE, {}).values()))
    base_wall = median(series[BASELINE].seconds)
    results: dict[str, Any] = {}
    for name, s in series.items():
        summary = variant_summary(s)
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
            "way. Variants *_cold run with "
            f"{WARM_AGENT_ENV}=0 in the driver."
        ),
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Throughput"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    variants = doc["variants"]
    default = doc.get("default", "ours_local_script")
    cols: list[pages.Column] = [
        ("variant", pages.name),
        ("what", lambda _n, s: s.get("description", "-")),
        ("samples/s", pages.field_("samples_per_s_median", 0)),
        ("vs torchrun (95% CI)", lambda _n, s: pages.ci(s.get("ratio_vs_torchrun"))),
        ("verdict", lambda _n, s: (s.get("ratio_vs_torchrun") or {}).get("verdict", "-")),
        ("from median step", lambda _n, s: pages.ci(s.get("step_ratio_vs_torchrun"))),
        ("vs default", lambda n, s: pages.ci(s.get("ratio_vs_default")) if n != default else "-"),
        ("wall s", pages.field_("median_s")),
        ("wall vs torchrun", pages.field_("wall_ratio_vs_torchrun", suffix="x")),
        (
            "CPU s: driver / helpers",
            lambda _n, s: (
                f"{pages.num(s.get('driver_cpu_median_s'))} / "
                f"{pages.num(s.get('helpers_cpu_median_s'))}"
            ),
        ),
        ("runs", lambda _n, s: f"{s.get('runs')}{pages.errors(s)}"),
    ]
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
        + pages.columns(cols, variants)
        + pages.notes(doc.get("notes"))
        + "\n\n"
        + READING
    )


READING = (
    "Reading it: whether ranks forked from the agent train slower than fresh interpreters is a "
    "question of a few percent. What the ranks do inside was measured once (docs/internals.md, "
    '"Ranks are forked, not spawned"): forked ranks take fewer minor faults per step than '
    "fresh ones (the inherited pages are never copied in the steady state), the same threads "
    "and affinity, no collection; and a one-step-each-in-turn A/B's control, bare torchrun "
    "against itself, moves as much between sessions as any of ours: a process's own memory "
    "layout sets its speed by several percent on this VM, and that, not the fork, is what the "
    "intervals contain."
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


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
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
