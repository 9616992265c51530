"""Launch overhead: a trivial 2-rank gloo all-reduce under each launcher, alternating.

Variants (one of each per round, the order rotated every round, after a discarded warm-up
round): bare ``torchrun`` running the job as a script; ours in local mode (function and
script); ours in barrier mode on a warm ``local[2]`` session; pyspark's TorchDistributor in
local and barrier mode on the same session. Reports medians and ratios to bare torchrun.

Ours' default runs use the warm agent (a fork server that has imported torch, started by the
first run of a driver process; later runs' agents are forked from it): this benchmark is one
driver, so after the warm-up round they are warm. The ``*_cold`` variants run with it off,
side by side: ``SPARKTORCH_OPS_WARM_AGENT=0`` in this process for the local ones (for that
run only), and for ``ours_barrier_fn_cold`` in the environment of the Spark Python tasks,
which is what ``spark.executorEnv.SPARKTORCH_OPS_WARM_AGENT=0`` gives them (see
``common.executor_env``; Spark then keeps a separate pool of Python workers for them, kept
warm like the others).

Then a breakdown: one instrumented run per variant (``--breakdown-runs``) in which every rank
writes ``time.time()`` marks (function start, after ``import torch``, after
``init_process_group``, end) and its process chain with start times read from ``/proc``, and,
for ours, the driver's own steps come from the run's public phase events (``on_event``: job
packed, Spark preflight, channel open, launcher started, hellos, result arrival, exits, drain,
teardown); no private name is patched. Probes
(``python -c "import torch"`` and the like) are measured separately and used only to split the
agent's start-up, which is marked as inferred.

    python benchmarks/launch.py --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import pages
from common import JOBS_SCRIPT, Recorder, log, median, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()

import jobs

NAME = "launch"
DEFAULT_VARIANTS = (
    "torchrun",
    "ours_local_fn",
    "ours_local_script",
    "ours_local_fn_cold",
    "ours_local_script_cold",
    "ours_barrier_fn",
    "ours_barrier_fn_max_failures",
    "ours_barrier_fn_cold",
    "pyspark_local_fn",
    "pyspark_barrier_fn",
)
OPTIONAL_VARIANTS = ("ours_barrier_script", "pyspark_local_script")
LOCAL_VARIANTS = ("torchrun", "ours_local_fn", "ours_local_script")  # --gpu runs these
COLD = "_cold"  # suffix: the same variant with the warm agent off
TARGETS = {"local": 0.3, "barrier": 0.6}  # issue 16's goals, for ours' default (warm) runs
DESIGN_TARGETS = {"local": 1.15, "barrier": 1.5}  # the earlier goals (DESIGN.md section 6)
PYSPARK_MEASURED = {"local": 1.3, "barrier": 2.8}  # DESIGN.md section 6, item 13


def variant_mode(name: str) -> str | None:
    """'local', 'barrier' or None (bare torchrun)."""
    if "local" in name:
        return "local"
    if "barrier" in name:
        return "barrier"
    return None


class Launchers:
    """Builds the run-once callables of every variant."""

    def __init__(self, session: Any, use_gpu: bool, timeout: float) -> None:
        self.session = session
        self.use_gpu = use_gpu
        self.timeout = timeout
        self.logger = common.quiet_logger()
        self.on_event: Callable[[Any], None] | None = None  # set for breakdown runs only

    def ours(self, local_mode: bool, **options: Any) -> Any:

        return common.ours(
            local_mode=local_mode,
            use_gpu=self.use_gpu,
            spark=None if local_mode else self.session,
            timeout=self.timeout,
            on_event=self.on_event,
            **options,
        )

    def pyspark(self, local_mode: bool, call: Callable[[Any], Any]) -> Any:
        distributor = common.pyspark_distributor(local_mode)
        return common.pyspark_run(self.session, lambda: call(distributor), self.timeout)

    def build(self, name: str, timings_dir: str | None = None) -> Callable[[], Any]:
        run = self._build(name.removesuffix(COLD), timings_dir)
        if name.endswith(COLD):
            run = self.cold(name, run)
        if "barrier" not in name:
            return run

        def census() -> Any:
            # Spark kills Python workers idle for a minute; a run that gets fresh ones pays
            # their start (and, for ours, the preflight's import of torch) again.
            before = common.python_workers()
            value = run()
            return {"value": value, "new_python_workers": len(common.python_workers() - before)}

        return census

    def cold(self, name: str, run: Callable[[], Any]) -> Callable[[], Any]:
        """``run`` with the warm agent off: in this process (local) or the Python tasks (barrier)."""

        def cold_run() -> Any:
            if "barrier" in name:
                with common.executor_env(self.session, common.WARM_AGENT_ENV, "0"):
                    return run()
            with common.env_var(common.WARM_AGENT_ENV, "0"):
                return run()

        return cold_run

    def touch(self) -> None:
        """Keep both pools of Spark Python workers alive: the default one and the cold one's."""
        common.touch_python_workers(self.session)
        with common.executor_env(self.session, common.WARM_AGENT_ENV, "0"):
            common.touch_python_workers(self.session)

    def _build(self, name: str, timings_dir: str | None = None) -> Callable[[], Any]:
        script_args = ["allreduce"] + (["--gpu"] if self.use_gpu else [])
        if timings_dir:
            script_args += ["--timings-dir", timings_dir]
        fn = functools.partial(jobs.allreduce, timings_dir, self.use_gpu)
        script = str(JOBS_SCRIPT)
        if name == "torchrun":
            return lambda: common.run_torchrun(JOBS_SCRIPT, script_args, timeout=self.timeout)
        if name == "ours_local_fn":
            return lambda: self.ours(True).run(fn)
        if name == "ours_local_script":
            return lambda: self.ours(True).run(script, *script_args)
        if name == "ours_barrier_fn":
            return lambda: self.ours(False).run(fn)
        if name == "ours_barrier_fn_max_failures":  # what attempts cost a run that never fails
            return lambda: self.ours(False, max_failures=2).run(fn)
        if name == "ours_barrier_script":
            return lambda: self.ours(False).run(script, *script_args)
        if name == "pyspark_local_fn":
            return lambda: self.pyspark(True, lambda d: d.run(fn))
        if name == "pyspark_barrier_fn":
            return lambda: self.pyspark(False, lambda d: d.run(fn))
        if name == "pyspark_local_script":
            return lambda: self.pyspark(True, lambda d: d.run(script, *script_args))
        raise ValueError(f"unknown variant {name!r}")


def check_value(name: str, value: Any) -> dict[str, Any] | None:
    """A function run must return the all-reduced 3.0 (1 + 2); others are not checked."""
    extra = None
    if isinstance(value, dict) and "new_python_workers" in value:
        extra = {"new_python_workers": value["new_python_workers"]}
        value = value["value"]
    if name.removesuffix(COLD).endswith("_fn") and value != 3.0:
        raise AssertionError(f"{name} returned {value!r}, expected 3.0")
    return extra


# -- breakdown -------------------------------------------------------------------------------
# Events seen once per rank or node: the latest one is the one on the critical path.
PER_PEER_EVENTS = (
    "supervisor_connected",
    "worker_connected",
    "rank_exited",
    "node_connected",
    "node_exited",
)


def event_recorder(recorder: Recorder) -> Callable[[Any], None]:
    """An ``on_event`` hook that marks every phase event of a run of ours."""

    def on_event(event: Any) -> None:
        where = event.rank if event.rank is not None else event.node
        per_peer = event.name in PER_PEER_EVENTS and where is not None
        label = f"{event.name} {where}" if per_peer else event.name
        recorder.mark(label, event.time)

    return on_event


def _find(
    chain: list[dict[str, Any]], *needles: str, topmost: bool = False
) -> dict[str, Any] | None:
    """The first entry (newest first, or the topmost) whose name or command line has a needle.

    Our supervisors and ranks are forked from the agent: they share its command line and are
    told apart by their process names (``torch-sup-N``, ``torch-rank-N``).
    """
    found = [e for e in chain if any(n in e["cmdline"] or n in e["name"] for n in needles)]
    if not found:
        return None
    return found[-1] if topmost else found[0]


def rank_events(records: list[dict[str, Any]]) -> dict[str, float]:
    """Absolute times of each rank-side event, the latest over ranks (the critical path)."""
    per_event: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            per_event.setdefault(name, []).append(value)

    for record in records:
        chain = record["chain"]
        user = chain[0]
        agent = _find(chain, "sparktorch_ops.node.agent", "torch.distributed.run", topmost=True)
        add("agent process start", agent["start"] if agent else None)
        wrapper = _find(chain, "torch_run_process_wrapper")
        add("pyspark wrapper start", wrapper["start"] if wrapper else None)
        supervisor = _find(chain, "torch-sup-")
        add("rank supervisor start", supervisor["start"] if supervisor else None)
        add("rank process start", user["start"])
        for mark, value in record["marks"].items():
            add(mark, value)
    return {name: max(values) for name, values in per_event.items()}


def one_breakdown(launchers: Launchers, name: str) -> dict[str, Any]:
    """One instrumented run of a variant: its timeline, relative to the call."""
    timings_dir = tempfile.mkdtemp(prefix="sparktorch-bench-")
    recorder = Recorder()
    try:
        if name.startswith("ours"):
            launchers.on_event = event_recorder(recorder)
        run = launchers.build(name, timings_dir)
        started = time.time()
        value = run()
        ended = time.time()
        extra = check_value(name, value)
        records = [
            json.loads(path.read_text()) for path in sorted(Path(timings_dir).glob("rank*.json"))
        ]
    finally:
        launchers.on_event = None
        shutil.rmtree(timings_dir, ignore_errors=True)
    events = {k: v - started for k, v in rank_events(records).items()}
    for label, when in recorder.marks:
        events.setdefault(label, when - started)
    for prefix in PER_PEER_EVENTS:
        found = [when - started for label, when in recorder.marks if label.startswith(prefix)]
        if found:
            events[f"{prefix} (last)"] = max(found)
    events["returned"] = ended - started
    return {"events": events, "ranks": len(records), **(extra or {})}


PROC = "measured (/proc, 10 ms ticks)"
MEASURED = "measured"
POLLED = "measured (driver polls every 50 ms)"

# Where each family's timeline is cut: "event | how it is known | the phase that ends there";
# "@name" stands for the steps of [name] (a rank's own, or ours' agent to the ranks' exits).
_CHECKPOINTS = """
[rank]
torch_imported | measured | rank: import torch
pg_ready | measured | rendezvous: init_process_group
fn_end | measured | user function: all-reduce + destroy_process_group
[ours_ranks]
rank supervisor start | proc | torchrun agent: interpreter and import torch (cold only), rendezvous, fork
supervisor_connected (last) | measured | supervisor: channel hello
rank process start | proc | supervisor: fork the rank process
worker_connected (last) | measured | rank: channel hello
fn_start | measured | rank: read the payload, unpickle, until the function runs
@rank
result_received | measured | rank 0: pickle and send the result
rank_exited (last) | measured | ranks exit, supervisors report
[torchrun]
agent process start | proc | exec of the torchrun process
rank process start | proc | torchrun agent: interpreter, import torch, rendezvous, spawn
fn_start | measured | rank: interpreter, argparse, until the function runs
@rank
returned | measured | ranks exit, torchrun notices and exits, subprocess returns
[ours_local]
payload_packed | measured | driver: build the job (pickle the function / read the script)
channel_open | measured | driver: open the channel
launcher_started | measured | driver: plan, payload file, start the agent (Popen)
agent process start | proc | agent process start (exec; warm: forked by the fork server)
@ours_ranks
finishing | polled | torchrun agent notices the exits and exits
drained | measured | driver: drain the channel
launcher_finished | measured | driver: unpickle, close the channel, teardown (process tree, sweep, workdir)
returned | measured | driver: build the RunResult
[ours_barrier]
payload_packed | measured | driver: build the job (pickle the function / read the script)
slots_ready | measured | driver: Spark conf and slot checks
launcher_started | measured | driver: channel, plan, submit the barrier job
node_connected (last) | measured | Spark: barrier tasks start, hello; task 0 hosts the store, port via the driver
agent process start | proc | task: payload file, start (or fork) the agent
@ours_ranks
node_exited (last) | measured | torchrun agents notice the exits, exit barrier, exit
finishing | polled | driver releases the store; task 0 ends, the Spark job completes (polled)
drained | measured | driver: drain the channel
launcher_finished | measured | driver: unpickle, close, wait for the job's end
returned | measured | driver: build the RunResult
[pyspark_local]
pyspark wrapper start | proc | pyspark: pickle to a file, start its wrapper process
agent process start | proc | wrapper: interpreter, start torchrun
rank process start | proc | torchrun agent: interpreter, import torch, rendezvous, spawn
fn_start | measured | rank: interpreter, import pyspark's cloudpickle, unpickle
@rank
returned | measured | ranks write the output file and exit, torchrun + wrapper exit, driver reads
[pyspark_barrier]
pyspark wrapper start | proc | pyspark: log server (sleeps 1 s), Spark job, task setup, wrapper
agent process start | proc | wrapper: interpreter, start torchrun
rank process start | proc | torchrun agent: interpreter, import torch, rendezvous, spawn
fn_start | measured | rank: interpreter, import pyspark's cloudpickle, unpickle
@rank
returned | measured | ranks exit, torchrun + wrapper exit, Arrow result, Spark job ends
"""
HOW = {"proc": PROC, "measured": MEASURED, "polled": POLLED}
CHECKPOINTS: dict[str, list[tuple[str, str, str]]] = {}
for _line in _CHECKPOINTS.strip().splitlines():
    if _line.startswith("["):
        _steps = CHECKPOINTS.setdefault(_line.strip("[]"), [])
    elif _line.startswith("@"):
        _steps.extend(CHECKPOINTS[_line[1:]])
    else:
        _event, _how, _description = (part.strip() for part in _line.split("|", 2))
        _steps.append((_event, _description, HOW[_how]))
del CHECKPOINTS["rank"], CHECKPOINTS["ours_ranks"]


def family(name: str) -> str:
    """The checkpoint list a variant uses."""
    for prefix in ("ours_local", "ours_barrier", "pyspark_local", "pyspark_barrier"):
        if name.startswith(prefix):
            return prefix
    return "torchrun"


def phases(name: str, events: dict[str, float]) -> list[tuple[str, float | None, str]]:
    """The timeline cut at consecutive checkpoints: (phase, seconds, how it was obtained).

    A checkpoint that was not seen merges its phase into the next one (marked '+').
    The phases add up to the total.
    """
    rows: list[tuple[str, float | None, str]] = []
    previous = 0.0
    merged = False
    for event, description, how in CHECKPOINTS[family(name)]:
        if event not in events:
            merged = True
            continue
        seconds = events[event] - previous
        rows.append((("+ " if merged else "") + description, round(seconds, 3) + 0.0, how))
        previous = events[event]
        merged = False
    rows.append(("total", events.get("returned"), MEASURED))
    return rows


def probes() -> dict[str, float | None]:
    """Interpreter and import costs, each a fresh ``python -c`` (median of 3)."""
    codes = {
        "python -c pass": "pass",
        "import torch": "import torch",
        "import torch.distributed.run": "import torch.distributed.run",
        "import sparktorch_ops.rank.bootstrap (in the agent, before it forks ranks)": (
            "import sparktorch_ops.rank.bootstrap"
        ),
        "import sparktorch_ops.distributor (driver)": "import sparktorch_ops.distributor",
        "from pyspark import cloudpickle (pyspark's rank)": "from pyspark import cloudpickle",
    }
    return {label: common.probe_seconds(code) for label, code in codes.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = {*DEFAULT_VARIANTS, *OPTIONAL_VARIANTS}
    known |= {v + COLD for v in known if v.startswith("ours")}
    if set(variants) - known:
        raise SystemExit(f"unknown variants: {', '.join(sorted(set(variants) - known))}")
    if args.gpu:
        variants = [v for v in variants if v.removesuffix(COLD) in LOCAL_VARIANTS]
    session = None
    if any(v.startswith("pyspark") or "barrier" in v for v in variants):
        log("starting a local[2] SparkSession")
        session = common.start_spark("local[2]")
        common.ship_by_value_for_pyspark(jobs)
    launchers = Launchers(session, args.gpu, args.timeout)

    def touch() -> None:
        if session is None or not args.warm_python_workers:
            return
        if any("barrier" in v and v.endswith(COLD) for v in variants):
            launchers.touch()
        else:
            common.touch_python_workers(session)

    if common.WARM_AGENT_ENV in os.environ:  # the default variants run with the default
        log(f"ignoring {common.WARM_AGENT_ENV}={os.environ.pop(common.WARM_AGENT_ENV)}")

    series = common.alternate(
        {name: launchers.build(name) for name in variants},
        args.repeats,
        warmup=args.warmup,
        check=check_value,
        settle_s=args.settle,
        before_each=lambda _name: touch(),
    )
    base = median(series["torchrun"].seconds) if "torchrun" in series else None
    results: dict[str, Any] = {}
    for name in variants:
        summary = series[name].summary()
        mode = variant_mode(name)
        summary["ratio_vs_torchrun"] = ratio(summary["median_s"], base)
        ours = name.startswith("ours")
        summary["warm_agent"] = (not name.endswith(COLD)) if ours else None
        summary["target_ratio"] = TARGETS.get(mode or "") if ours else None
        summary["design_target_ratio"] = DESIGN_TARGETS.get(mode or "") if ours else None
        if name.endswith(COLD) and name.removesuffix(COLD) in series:
            warm = series[name.removesuffix(COLD)]
            summary["cold_over_warm"] = ratio(summary["median_s"], median(warm.seconds))
        if "barrier" in name:
            summary["new_python_workers"] = [
                e.get("new_python_workers") for e in series[name].extra
            ]
        results[name] = summary
    breakdown: dict[str, Any] = {}
    if args.breakdown_runs > 0:
        for name in variants:
            runs = []
            for index in range(args.breakdown_runs):
                try:
                    touch()
                    runs.append(one_breakdown(launchers, name))
                except Exception as exc:
                    log(f"breakdown {name} run {index + 1}: FAILED {type(exc).__name__}: {exc}")
            if not runs:
                breakdown[name] = {"error": "every instrumented run failed"}
                continue
            labels = sorted({k for run in runs for k in run["events"]})
            events = {k: median([r["events"][k] for r in runs if k in r["events"]]) for k in labels}
            breakdown[name] = {
                "events_s": dict(sorted(events.items(), key=lambda kv: kv[1] or 0.0)),
                "phases": [
                    {"phase": p, "seconds": s, "how": how}
                    for p, s, how in phases(
                        name, {k: v for k, v in events.items() if v is not None}
                    )
                ],
                "runs": len(runs),
            }
        breakdown["_probes"] = probes()
        breakdown["_notes"] = (
            "Rank-side marks are time.time() in the rank; process starts come from /proc (10 ms "
            "ticks) against a boot time from /proc/uptime; driver steps of ours are timed by "
            "wrapping them in the benchmark process. Events are the latest over ranks. The "
            "agent phase includes its interpreter and `import torch.distributed.run` (see the "
            "probes) plus the rendezvous store and the spawning of ranks: that split is inferred "
            "from the probes, not measured inside the agent."
        )
    if session is not None:
        session.stop()
    return {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "use_gpu": args.gpu,
        "warm_python_workers": args.warm_python_workers,
        "variants": results,
        "baseline": "torchrun",
        "targets": TARGETS,
        "design_targets": DESIGN_TARGETS,
        "warm_agent_env": common.WARM_AGENT_ENV,
        "pyspark_reference": PYSPARK_MEASURED,
        "breakdown": breakdown,
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "Launch"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    rows = []
    for name, s in doc["variants"].items():
        target, design = s.get("target_ratio"), s.get("design_target_ratio")
        ratio = s.get("ratio_vs_torchrun")
        warm = s.get("warm_agent")
        rows.append(
            [
                f"`{name}`",
                "-" if warm is None else ("off" if not warm else "default"),
                pages.num(s.get("median_s")),
                pages.spread(s),
                pages.num(ratio, suffix="x"),
                pages.num(s.get("cold_over_warm"), suffix="x"),
                pages.met(ratio, target, at_most=True) if target else "",
                pages.met(ratio, design, at_most=True) if design else "",
                str(sum(s["new_python_workers"])) if "new_python_workers" in s else "-",
                f"{s.get('runs')}{pages.errors(s)}",
            ]
        )
    out = [
        f"Trivial 2-rank all-reduce, from the call to its return; median of {doc.get('repeats')} "
        f"(after {doc.get('warmup', 0)} warm-up round). Barrier variants run on `local[2]`"
        + (" with warm Python workers." if doc.get("warm_python_workers") else "."),
        pages.table(
            [
                "variant",
                "warm agent",
                "seconds",
                "min-max s",
                "vs torchrun",
                "cold / warm",
                "target (issue 16)",
                "earlier target",
                "fresh workers",
                "runs",
            ],
            rows,
        ),
        "*warm agent*: `off` runs with `SPARKTORCH_OPS_WARM_AGENT=0` (local: in the driver for "
        "that run; barrier: in the Spark Python tasks' environment, as "
        "`spark.executorEnv.SPARKTORCH_OPS_WARM_AGENT=0` gives it), side by side with the "
        "default, which is warm after the first run of the driver; *cold / warm*: its median "
        "over the default variant's. *target (issue 16)*: local <= 0.3x, barrier <= 0.6x of "
        "bare torchrun; *earlier target*: local <= 1.15x, barrier <= 1.5x. "
        "*fresh workers*: barrier runs that found Spark's Python workers gone (Spark stops them "
        "after a minute idle) and paid for new ones.",
    ]
    reference = doc.get("pyspark_reference")
    if reference:
        out.append(
            "pyspark's TorchDistributor as measured earlier (DESIGN.md section 6): "
            + ", ".join(f"{mode} {ratio}x" for mode, ratio in reference.items())
            + " of bare torchrun."
        )
    breakdown = doc.get("breakdown", {})
    for name, b in breakdown.items():
        if name.startswith("_") or "phases" not in b:
            continue
        phase_rows = [[p["phase"], pages.num(p["seconds"]), p["how"]] for p in b["phases"]]
        out.append(f"<details><summary>Where the time goes: <code>{name}</code></summary>\n")
        out.append(pages.table(["phase", "seconds", "how"], phase_rows))
        out.append("</details>")
    probes = breakdown.get("_probes")
    if probes:
        out.append("What single steps cost on this machine (one process each, seconds):")
        out.append(pages.table(["step", "seconds"], [[k, pages.num(v)] for k, v in probes.items()]))
    out.append(READING)
    return "\n\n".join(out) + pages.notes(breakdown.get("_notes"))


READING = (
    "Reading it: ranks are forked (through their supervisors) from the torchrun agent, which "
    "has already imported torch (DESIGN section 9), and after a driver's (or Spark Python "
    "worker's) first run the agent itself is forked from the warm agent, a fork server that "
    "imported torch once. What is left is torchrun's own work (rendezvous, starting and "
    "watching the workers, the exit) and ours (channel, Spark job); with 2+ nodes the agents "
    "poll the rendezvous in proportion to their number instead of every second. The `*_cold` "
    "variants, run side by side with `SPARKTORCH_OPS_WARM_AGENT=0`, pay the agent's "
    "interpreter and `import torch` (two at once on 2 cores in barrier mode)."
)


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline rows: each mode's slower default against bare torchrun."""
    rows = []
    v = doc["variants"]
    for mode in ("local", "barrier"):
        ours = [
            s
            for name, s in v.items()
            if name.startswith(f"ours_{mode}_") and not name.endswith("_cold")
        ]
        if not ours:
            continue
        worst = max(ours, key=lambda s: s.get("ratio_vs_torchrun") or 0.0)
        ratio = worst.get("ratio_vs_torchrun")
        target = worst.get("target_ratio")
        cold = [
            s.get("ratio_vs_torchrun")
            for name, s in v.items()
            if name.startswith(f"ours_{mode}_")
            and name.endswith("_cold")
            and s.get("ratio_vs_torchrun") is not None
        ]
        cold_text = f"warm agent off: {pages.num(max(cold), suffix='x')}; " if cold else ""
        pyspark = v.get(f"pyspark_{mode}_fn", {}).get("ratio_vs_torchrun")
        rows.append(
            [
                f"launch, {mode} mode (trivial all-reduce)",
                f"time / bare torchrun's ({cold_text}pyspark's: {pages.num(pyspark, suffix='x')})",
                pages.num(ratio, suffix="x"),
                pages.met(ratio, target, at_most=True),
            ]
        )
    return rows


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated; also {', '.join(OPTIONAL_VARIANTS)}",
    )
    parser.add_argument(
        "--breakdown-runs", type=int, default=1, help="instrumented runs per variant (0: none)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="use_gpu=True, nccl (torchrun and ours local only)"
    )
    common.warm_python_workers_option(parser)


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"timeout": 300},
    headline=True,
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
