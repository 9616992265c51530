"""Served vs one-off: the example retraining flow (``flows/retrain_digits.py``) run once with
``--once`` and run as a served deployment on a real Prefect server; and how soon cancelling a
served training run through the API ends its ranks, in local and in barrier mode.

The benchmark starts ``prefect server start`` on 127.0.0.1 (a free port, its database under a
temporary ``PREFECT_HOME``: the server's services run, as in production), then alternates,
round by round (the order rotated every round):

- ``once_ephemeral``: ``python flows/retrain_digits.py --once --state TMP --epochs N`` as a
  user types it, without ``PREFECT_API_URL``: the command starts Prefect's ephemeral server
  (its database primed by an untimed run first). The whole command is timed.
- ``once_server``: the same command with ``PREFECT_API_URL`` pointed at the benchmark's server.
- ``served``: the flow served by ``python flows/retrain_digits.py --name bench --cron ...``
  (a cron that does not fire) on that server; a flow run is created from the deployment (with a
  fresh ``state``) and timed from the request until the API reports it Completed (polled every
  0.2 s). The runner is up already; it picks the run up on its poll (``--poll``, Prefect's
  default when not given) and starts the flow run's own process. ``pickup_s`` (created ->
  started) and ``run_s`` (started -> ended) are the server's timestamps.
- ``cancel_local`` / ``cancel_barrier``: a 2-rank training that sleeps (the ``sleepy-training``
  flow of ``tests/prefect/served_flow.py``, served by ``python tests/prefect/served_flow.py
  bench``) in local mode and in barrier mode (an embedded ``local[2]`` Spark) is cancelled
  (``set_flow_run_state(Cancelling(), force=True)``) once both ranks run; timed from the
  request until the last process carrying the run's marker (``SPARKTORCH_OPS_RUN_ID``) is gone.
  ``all_gone_s``: until every process the flow run started (its own, Spark's JVM and Python
  workers, the agents and ranks) is gone; ``cancelled_s``: until the API reports Cancelled.

Every run gets a fresh state directory (so every run appends the same day, trains from scratch
and registers version 1); every process started here is in a process group of its own and
killed at the end. The server and the runners are ``harness/prefect_served.py``'s.

    python benchmarks/served_flow.py --epochs 1
    python benchmarks/served_flow.py --epochs 2 --repeats 3 --poll 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import common
import pages
from common import Series, log, median, ratio

if __name__ == "__main__":  # not in a Spark worker that imports this module for a function
    common.prepare_environment()
sys.path.insert(0, str(common.ROOT))

from harness.prefect_served import (
    PrefectServer,
    ServedFlow,
    prefect_env,
    prefect_server,
    serve_flow_script,
    spawned_processes,
    wait_for,
    wait_for_deployment,
    wait_for_final_state,
)
from harness.procs import processes_with_marker

NAME = "served_flow"
ROOT = common.ROOT
FLOW_SCRIPT = ROOT / "flows" / "retrain_digits.py"
SLEEPY_SCRIPT = ROOT / "tests" / "prefect" / "served_flow.py"
VARIANTS = ("once_ephemeral", "once_server", "served", "cancel_local", "cancel_barrier")
#: A schedule that does not fire during the benchmark: only the runs created here run.
NEVER_NOW = "0 3 1 1 *"
#: Changes to the environment of every process the benchmark starts (MLflow: each run's state).
ENV_CHANGES: dict[str, str | None] = {
    "MLFLOW_TRACKING_URI": None,
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def bench_env(workdir: Path, extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """``prefect_env`` (Prefect's home under ``workdir``, no ``PREFECT_API_URL``) with
    ``ENV_CHANGES``; ``extra`` last (None removes a variable)."""
    return prefect_env(workdir, {**ENV_CHANGES, **(extra or {})})


def run_command(
    command: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a command in a process group of its own, output captured; the group is killed after
    it exits (or at the timeout, which raises)."""
    cwd.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        list(command),
        cwd=str(cwd),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"{command[1:3]} still running after {timeout:g} s") from exc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        if process.returncode is None:
            process.communicate()
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def serve(
    script: Path, args: Sequence[str], workdir: Path, api_url: str, poll: float | None
) -> contextlib.AbstractContextManager[ServedFlow]:
    """``python script *args`` served against ``api_url`` from ``workdir``, the runner polling
    every ``poll`` seconds (Prefect's default when None)."""
    poll_env = {"PREFECT_RUNNER_POLL_FREQUENCY": None if poll is None else f"{poll:g}"}
    changes = {**ENV_CHANGES, **poll_env}
    return serve_flow_script(
        script, args, api_url=api_url, workdir=workdir, cwd=workdir, env=changes
    )


# -- the variants ----------------------------------------------------------------------------
class Bench:
    """The server, both runners and a scratch directory; one method per variant, each returning
    (the measured seconds, extra figures)."""

    def __init__(self, args: argparse.Namespace, workdir: Path, server: PrefectServer) -> None:
        self.args = args
        self.workdir = workdir
        self.server = server
        self.retrain: ServedFlow | None = None
        self.sleepy: ServedFlow | None = None
        self.count = 0

    def fresh_dir(self, label: str) -> Path:
        """A new empty directory for one run."""
        self.count += 1
        path = self.workdir / f"{self.count:03d}-{label}"
        path.mkdir()
        return path

    def once(self, via_server: bool) -> tuple[float, dict[str, Any]]:
        """``retrain_digits.py --once``: the command, timed whole."""
        run_dir = self.fresh_dir("once")
        home = self.workdir / ("once-server" if via_server else "once-ephemeral")
        extra = {"PREFECT_API_URL": self.server.url} if via_server else None
        command = [sys.executable, str(FLOW_SCRIPT), "--once", "--state", str(run_dir / "state")]
        command += ["--epochs", str(self.args.epochs)]
        started = time.perf_counter()
        done = run_command(command, run_dir, bench_env(home, extra), self.args.timeout)
        seconds = time.perf_counter() - started
        if done.returncode != 0 or "digits-cnn v1 accuracy" not in done.stdout:
            raise RuntimeError(f"exit {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
        return seconds, {}

    def prime_ephemeral(self) -> None:
        """One trivial flow on the ephemeral server, untimed: its database exists after."""
        home = self.workdir / "once-ephemeral"
        code = "from prefect import flow\nflow(lambda: 1)()"
        done = run_command([sys.executable, "-c", code], home, bench_env(home), self.args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"priming failed: {(done.stdout + done.stderr)[-3000:]}")

    def served(self, client: Any) -> tuple[float, dict[str, Any]]:
        """A run of the served deployment: request -> Completed."""
        assert self.retrain is not None
        retrain = self.retrain
        deployment = wait_for_deployment(client, "retrain-digits/bench", retrain, timeout=180)
        state = self.fresh_dir("served") / "state"
        started = time.perf_counter()
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"state": str(state)}
        )
        final = wait_for_final_state(client, flow_run.id, self.args.timeout, interval=0.2)
        seconds = time.perf_counter() - started
        if not final.is_completed():
            raise RuntimeError(f"{final.name}: {final.message}")
        ended = client.read_flow_run(flow_run.id)
        extra = {
            "pickup_s": (ended.start_time - ended.created).total_seconds(),
            "run_s": (ended.end_time - ended.start_time).total_seconds(),
        }
        # Untimed: the flow run's process exits before the next run.
        wait_for(lambda: not spawned_processes(retrain), 120, "the flow run's processes to exit")
        return seconds, extra

    def cancel(self, client: Any, local_mode: bool) -> tuple[float, dict[str, Any]]:
        """Cancel a served sleepy run once both ranks run: request -> last rank gone."""
        from prefect.states import Cancelling

        assert self.sleepy is not None
        sleepy = self.sleepy
        deployment = wait_for_deployment(client, "sleepy-training/bench", sleepy, timeout=180)
        markers = self.fresh_dir("cancel")
        requested_run = time.perf_counter()
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"marker_dir": str(markers), "local_mode": local_mode}
        )
        wait_for(
            lambda: (markers / "rank0").exists() and (markers / "rank1").exists(),
            self.args.timeout,
            "both ranks",
        )
        ranks_started_s = time.perf_counter() - requested_run
        run_id = (markers / "rank0").read_text()
        before = len(spawned_processes(sleepy))
        requested = time.perf_counter()
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)

        def since() -> float:
            return time.perf_counter() - requested

        wait_for(lambda: not processes_with_marker(run_id), 60, "the ranks gone", 0.05)
        ranks_gone_s = since()
        wait_for(lambda: not spawned_processes(sleepy), 60, "the flow run's processes gone", 0.1)
        all_gone_s = since()
        final = wait_for_final_state(client, flow_run.id, 60, interval=0.2)
        if not final.is_cancelled():
            raise RuntimeError(f"ended {final.name}, not Cancelled: {final.message}")
        return ranks_gone_s, {
            "all_gone_s": all_gone_s,
            "cancelled_s": since(),
            "ranks_started_s": ranks_started_s,
            "processes": before,
        }


def _extra_median(s: Series, key: str) -> float | None:
    return median([e[key] for e in s.extra if e.get(key) is not None])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants: {sorted(unknown)}")
    workdir = Path(tempfile.mkdtemp(prefix="served-flow-bench-"))
    try:
        log(f"starting a Prefect server (scratch: {workdir})")
        with prefect_server(workdir / "server", env=ENV_CHANGES) as server:
            log(f"server up at {server.url}")
            bench = Bench(args, workdir, server)
            with contextlib.ExitStack() as stack:
                if "served" in variants:
                    serve_args = ["--name", "bench", "--cron", NEVER_NOW]
                    serve_args += ["--epochs", str(args.epochs)]
                    serve_args += ["--state", str(workdir / "unused-state")]
                    bench.retrain = stack.enter_context(
                        serve(
                            FLOW_SCRIPT,
                            serve_args,
                            workdir / "serve-retrain",
                            server.url,
                            args.poll,
                        )
                    )
                if any(v.startswith("cancel_") for v in variants):
                    bench.sleepy = stack.enter_context(
                        serve(
                            SLEEPY_SCRIPT,
                            ["bench"],
                            workdir / "serve-sleepy",
                            server.url,
                            args.poll,
                        )
                    )
                if "once_ephemeral" in variants:
                    log("priming the ephemeral server's database (untimed)")
                    bench.prime_ephemeral()
                with (
                    temporary_settings({PREFECT_API_URL: server.url}),
                    get_client(sync_client=True) as client,
                ):
                    calls: dict[str, Callable[[], tuple[float, dict[str, Any]]]] = {
                        "once_ephemeral": lambda: bench.once(via_server=False),
                        "once_server": lambda: bench.once(via_server=True),
                        "served": lambda: bench.served(client),
                        "cancel_local": lambda: bench.cancel(client, local_mode=True),
                        "cancel_barrier": lambda: bench.cancel(client, local_mode=False),
                    }
                    series = common.alternate(
                        {name: calls[name] for name in variants},
                        args.repeats,
                        warmup=args.warmup,
                        check=lambda _name, value: {"seconds": value[0], **value[1]},
                        settle_s=args.settle,
                    )
    finally:
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    results: dict[str, Any] = {}
    for name, s in series.items():
        summary = s.summary()
        summary.pop("driver_cpu_median_s", None)
        summary.pop("tree_cpu_median_s", None)
        summary["extra"] = s.extra
        for key in ("pickup_s", "run_s", "all_gone_s", "cancelled_s", "ranks_started_s"):
            value = _extra_median(s, key)
            if value is not None:
                summary[f"{key.removesuffix('_s')}_median_s"] = value
        results[name] = summary

    def med(name: str) -> float | None:
        return results.get(name, {}).get("median_s")

    return {
        "epochs": args.epochs,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "poll_frequency_s": args.poll,
        "variants": results,
        "summary": {
            "served_over_once_ephemeral": ratio(med("served"), med("once_ephemeral")),
            "served_over_once_server": ratio(med("served"), med("once_server")),
        },
        "notes": (
            "once_*: the whole `retrain_digits.py --once` command (interpreter, imports, the "
            "ephemeral server for once_ephemeral); served: from create_flow_run_from_deployment "
            "until the API reports Completed, the runner already serving (pickup = created -> "
            "started, run = started -> ended, server timestamps); cancel_*: from the cancel "
            "request until the last process with the run's marker is gone (all_gone: every "
            "process the flow run started; Cancelled: the API's final state)."
        ),
    }


# -- its section of benchmarks/README.md (run_all.py collects it) --------------------------
TITLE = "The example flow served by Prefect"


def render(doc: dict[str, Any]) -> str:
    """This benchmark\'s section of benchmarks/README.md, from its JSON."""
    labels = {
        "once_ephemeral": "`--once` command, whole (ephemeral server)",
        "once_server": "`--once` command, whole (against the server)",
        "served": "deployment run: request -> Completed",
        "cancel_local": "cancel (API) -> last rank gone, local mode",
        "cancel_barrier": "cancel (API) -> last rank gone, barrier mode",
    }
    ratios = [
        [name, pages.num(value, suffix="x")] for name, value in (doc.get("summary") or {}).items()
    ]
    out = [
        f"`flows/retrain_digits.py` ({doc.get('epochs')} epoch), median of {doc.get('repeats')}.",
        pages.measured(labels, doc["variants"]),
        pages.table(["ratio of medians", "x"], ratios),
    ]
    return "\n\n".join(out) + pages.notes(doc.get("notes"))


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """README's headline row: the served flow over the same flow run once."""
    ratio = doc.get("summary", {}).get("served_over_once_server")
    if ratio is None:
        return []
    return [
        [
            "example flow served by Prefect",
            "served flow / `--once` (same server)",
            pages.num(ratio, suffix="x"),
            "-",
        ]
    ]


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument(
        "--poll",
        type=float,
        default=None,
        help="the runners' PREFECT_RUNNER_POLL_FREQUENCY, s (default: Prefect's own)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")


BENCH = pages.Benchmark(
    name=NAME,
    title=TITLE,
    measure=measure,
    render=render,
    summary=summary_rows,
    options=options,
    defaults={"repeats": 1, "warmup": 0, "timeout": 900, "settle": 2.0},
    quick=("--repeats=1", "--warmup=0", "--epochs=1"),
)

if __name__ == "__main__":
    sys.exit(common.main(BENCH))
