"""What every benchmark shares: the one runner (:func:`main`), the alternating rounds
(:func:`alternate`), the environment, Spark, bare torchrun and memory helpers.

A benchmark declares a :class:`pages.Benchmark`; ``python benchmarks/<name>.py`` runs
``common.main(BENCH)``, which parses the common options and the benchmark's own, measures,
writes ``benchmarks/results/<name>.json`` and prints the benchmark's section as the page shows
it. Every results file has one shape: ``benchmark`` (its name), ``machine``
(:func:`machine_info`), ``argv``, then the benchmark's settings (``repeats``...) and figures;
where variants alternate, ``variants`` maps each name to :meth:`Series.summary` and the
benchmark's own figures of it, and ``notes`` says how it was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pages
import psutil

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
JOBS_SCRIPT = BENCH_DIR / "jobs.py"


def prepare_environment() -> None:
    """The environment every variant runs in (set before Spark or any rank starts).

    Loopback Spark with this interpreter on the executors, and no ``PYTHONUNBUFFERED``: bare
    torchrun then runs its ranks with Python's default buffering, as users get it (ours runs
    the rank process with ``-u`` regardless, so that its lines arrive live).
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.pop("PYTHONUNBUFFERED", None)
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))


def quiet_logger(name: str = "bench.quiet") -> logging.Logger:
    """A logger that accepts INFO (so records are built, as in a pipeline) and drops them."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


# -- machine ---------------------------------------------------------------------------------
def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, memory, versions, load and date: what a figure depends on."""
    gpus: list[str] = []
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cores": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "gpus": gpus,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "pyspark": _version("pyspark"),
        "sparktorch_ops": _version("sparktorch-ops"),
        "git_commit": _git_commit(),
        "java": os.environ.get("JAVA_HOME"),
    }


# -- statistics and output -------------------------------------------------------------------
def median(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


@dataclass
class Series:
    """The timings of one variant: seconds of the runs that worked, and the errors."""

    name: str
    seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    extra: list[dict[str, Any]] = field(default_factory=list)
    driver_cpu: list[float] = field(default_factory=list)
    tree_cpu: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Median, min, max and the raw figures."""
        return {
            "median_s": median(self.seconds),
            "min_s": min(self.seconds) if self.seconds else None,
            "max_s": max(self.seconds) if self.seconds else None,
            "runs": len(self.seconds),
            "seconds": [round(s, 4) for s in self.seconds],
            "driver_cpu_median_s": median(self.driver_cpu),
            "tree_cpu_median_s": median(self.tree_cpu),
            "errors": self.errors,
        }


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, None when either is missing."""
    if value is None or not base:
        return None
    return value / base


def write_results(
    path: Path, name: str, payload: dict[str, Any], machine: dict[str, Any]
) -> dict[str, Any]:
    """Write a results file (the machine and the command line included); return its document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": name, "machine": machine, "argv": sys.argv[1:], **payload}
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def main(bench: pages.Benchmark, argv: list[str] | None = None) -> int:
    """Run one benchmark: its options, its measurement, its JSON, its section on the console.

    Exit status 1 when a variant has no run that worked.
    """
    parser = argparse.ArgumentParser(
        description=sys.modules[bench.measure.__module__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds first")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds of pause between runs")
    parser.add_argument("--timeout", type=float, default=600, help="per run, seconds")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the smallest run of every part ({' '.join(bench.quick)}), to quick_<name>.json",
    )
    parser.add_argument("--name", default=bench.name, help="results file name (no .json)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR / bench.folder, help="results folder"
    )
    if bench.options is not None:
        bench.options(parser)
    parser.set_defaults(**bench.defaults)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args([*bench.quick, *argv] if "--quick" in argv else argv)
    if args.quick and args.name == bench.name:  # never over the committed figures
        args.name = f"quick_{bench.name}"
    machine = machine_info()
    doc = write_results(args.out / f"{args.name}.json", bench.name, bench.measure(args), machine)
    print("\n" + pages.section(bench, doc), flush=True)
    variants = doc.get("variants") or {}
    return 1 if any(v.get("runs") == 0 for v in variants.values() if isinstance(v, dict)) else 0


def log(message: str) -> None:
    """A progress line on stderr, timestamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- running variants ------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took (wall clock), and what it returned."""
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def alternate(
    variants: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    warmup: int = 1,
    check: Callable[[str, Any], dict[str, Any] | None] | None = None,
    settle_s: float = 0.5,
    before_each: Callable[[str], Any] | None = None,
    each_round: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    order: Callable[[list[str]], list[str]] = list,
) -> dict[str, Series]:
    """Run every variant once per round, ``repeats`` rounds, rotating the order each round.

    Warm-up rounds (page cache, Spark's Python workers, the driver's own imports) are run and
    discarded. A variant that raises is recorded as an error, and the others go on.

    Args:
        variants: name -> a function that runs the variant once.
        repeats: measured rounds.
        warmup: discarded rounds first.
        check: called with (name, returned value); may return extra figures to keep (a
            ``seconds`` figure replaces the wall time, for variants timed from elsewhere, such
            as a process's start), and raises when the value is wrong (an error of that run).
        settle_s: pause between runs, so one run's exit does not overlap the next's start.
        before_each: called (untimed) with the variant's name before each of its runs, e.g.
            to call :func:`touch_python_workers`.
        each_round: a context for each round (e.g. servers started fresh for it).
        order: the round's rotated order -> the order to run (for variants that must follow
            another of the same round).
    """
    series = {name: Series(name) for name in variants}
    names = list(variants)
    for round_index in range(-warmup, repeats):
        shift = round_index % len(names)
        with each_round():
            for name in order(names[shift:] + names[:shift]):
                gc.collect()
                if before_each is not None:
                    before_each(name)
                time.sleep(settle_s)
                label = "warm-up" if round_index < 0 else f"round {round_index + 1}/{repeats}"
                try:
                    cpu_before = os.times()
                    seconds, value = timed(variants[name])
                    cpu_after = os.times()
                    extra = (check(name, value) if check is not None else None) or {}
                except Exception as exc:
                    log(f"{label} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    if round_index >= 0:
                        series[name].errors.append(f"{type(exc).__name__}: {str(exc)[:2000]}")
                    continue
                seconds = extra.pop("seconds", seconds)
                log(f"{label} {name}: {seconds:.2f} s")
                if round_index >= 0:
                    series[name].seconds.append(seconds)
                    driver, tree = cpu_seconds(cpu_before, cpu_after)
                    series[name].driver_cpu.append(driver)
                    series[name].tree_cpu.append(tree)
                    if extra:
                        series[name].extra.append(extra)
    return series


def cpu_seconds(before: os.times_result, after: os.times_result) -> tuple[float, float]:
    """(this process's CPU seconds, plus those of the descendants it reaped) between two times.

    A child's CPU time is added to its parent's when the parent waits for it, so for a launcher
    whose every process is waited for by its parent (bare torchrun, ours and pyspark's in local
    mode) the second figure is the CPU of the whole process tree. Spark's Python workers are
    the JVM's children: barrier-mode ranks are not in it.
    """
    driver = (after.user - before.user) + (after.system - before.system)
    children = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return driver, driver + children


def run_with_timeout(fn: Callable[[], Any], timeout: float, on_timeout: Callable[[], None]) -> Any:
    """Run ``fn`` on a thread; after ``timeout`` seconds call ``on_timeout`` and raise.

    For launchers without a timeout of their own (pyspark's TorchDistributor): ``on_timeout``
    must make ``fn`` return (cancel the Spark jobs, kill the processes).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        on_timeout()
        thread.join(60)
        raise TimeoutError(f"gave up after {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set (or, with None, remove) an environment variable of this process for a block only.

    For switches that sparktorch_ops reads at each run in the launching process, such as
    :data:`WARM_AGENT_ENV`; the previous value (or its absence) is restored afterwards.
    """
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def executor_env(session: Any, name: str, value: str) -> Iterator[None]:
    """Give the Python tasks of Spark jobs submitted in this block ``name=value``.

    ``spark.executorEnv.NAME`` reaches Spark's Python workers through
    ``SparkContext.environment`` (pyspark copies those settings into it when the context
    starts, and sends that dict with every Python function of a job), so setting the entry for
    a block is what a session built with ``spark.executorEnv.NAME=value`` gives those jobs.
    Spark keeps one pool of Python workers per environment: the jobs of the block get their
    own workers, which :func:`touch_python_workers` under the same block keeps alive.
    """
    environment = session.sparkContext.environment
    previous = environment.get(name)
    environment[name] = value
    try:
        yield
    finally:
        if previous is None:
            environment.pop(name, None)
        else:
            environment[name] = previous


WARM_AGENT_ENV = "SPARKTORCH_OPS_WARM_AGENT"  # "0": no warm agent (read at each run)


# -- bare torchrun ---------------------------------------------------------------------------
def torchrun_argv(script: Path | str, args: Sequence[str], nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N script args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


def run_torchrun(
    script: Path | str,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    capture: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run bare torchrun; stdout captured (or sent to /dev/null). Raises on a non-zero exit."""
    proc = subprocess.run(
        torchrun_argv(script, args, nproc),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def probe_seconds(code: str, repeats: int = 3) -> float | None:
    """Median seconds of ``python -c code`` (an interpreter start plus the imports in it)."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        if result.returncode != 0:
            return None
        samples.append(time.perf_counter() - started)
    return median(samples)


# -- Spark -----------------------------------------------------------------------------------
def start_spark(master: str = "local[2]", app_name: str = "sparktorch-ops-bench") -> Any:
    """A loopback SparkSession, warmed with a small job so that its Python workers exist."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.ui.port", "0")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    slots = session.sparkContext.defaultParallelism
    session.sparkContext.parallelize(range(slots), slots).map(lambda x: x * 2).collect()
    return session


def warm_python_workers_option(parser: argparse.ArgumentParser) -> None:
    """``--no-warm-python-workers``: whether :func:`touch_python_workers` runs before each run."""
    parser.add_argument(
        "--no-warm-python-workers",
        dest="warm_python_workers",
        action="store_false",
        help="let Spark reap its idle Python workers between runs (barrier runs then start cold)",
    )


def touch_python_workers(session: Any) -> None:
    """Run a tiny job on every slot, so Spark's idle Python workers are not reaped.

    Spark stops a Python worker after a minute without tasks, and a benchmark round of all
    variants can take longer than that: without this, barrier runs would get fresh workers
    (and pay their start and imports) at random, depending on the order of the round.
    """
    sc = session.sparkContext
    slots = sc.defaultParallelism
    sc.setLocalProperty("spark.job.description", "benchmark: keep the Python workers")
    try:
        sc.parallelize(range(slots), slots).count()
    finally:
        sc.setLocalProperty("spark.job.description", None)


def ours(**options: Any) -> Any:
    """Our TorchDistributor as the benchmarks run it: 2 ranks, local mode, CPU, a logger that
    drops the lines (built, as in a pipeline); ``options`` change any of these."""
    from sparktorch_ops import TorchDistributor

    defaults = {"num_processes": 2, "local_mode": True, "use_gpu": False, "logger": quiet_logger()}
    return TorchDistributor(**{**defaults, **options})


def pyspark_distributor(local_mode: bool, num_processes: int = 2) -> Any:
    """pyspark's own TorchDistributor on the active session, on CPU."""
    from pyspark.ml.torch.distributor import TorchDistributor as SparkTorchDistributor

    return SparkTorchDistributor(num_processes=num_processes, local_mode=local_mode, use_gpu=False)


def pyspark_run(session: Any, call: Callable[[], Any], timeout: float) -> Any:
    """``call()`` (a run of pyspark's TorchDistributor, which has no timeout of its own); after
    ``timeout`` seconds the session's jobs are cancelled and pyspark's rank processes killed."""

    def on_timeout() -> None:
        session.sparkContext.cancelAllJobs()
        kill_descendants("torch_run_process_wrapper")
        kill_descendants("torch.distributed.run")

    return run_with_timeout(call, timeout, on_timeout)


def ship_by_value_for_pyspark(module: Any) -> None:
    """pyspark pickles functions by reference; its ranks cannot import our benchmark modules."""
    from pyspark import cloudpickle as spark_cloudpickle

    with contextlib.suppress(ValueError):
        spark_cloudpickle.register_pickle_by_value(module)


def kill_descendants(marker: str) -> int:
    """SIGKILL our descendants whose command line contains ``marker``; return how many."""
    killed = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            if marker in " ".join(proc.cmdline()):
                proc.kill()
                killed += 1
        except psutil.Error:
            continue
    return killed


def python_workers(root: int | None = None) -> set[int]:
    """Pids of Spark's Python workers (children of ``pyspark.daemon``) under ``root`` (default:
    this driver): a run that finds them gone pays for new ones."""
    found: set[int] = set()
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "pyspark.daemon" in " ".join(proc.cmdline()) and proc.parent().name() != "java":
                    found.add(proc.pid)
    return found


# -- memory ----------------------------------------------------------------------------------
def rss_mib(pid: int | None = None) -> float:
    """Resident set size of a process (default: this one) in MiB."""
    return psutil.Process(pid).memory_info().rss / 2**20


class RssSampler:
    """Samples this process's RSS on a thread; ``peak_mib`` is the highest seen.

    Use as a context manager around a run. The interval trades precision for CPU: at 10 ms a
    sample costs well under 1% of a core.
    """

    def __init__(self, interval: float = 0.01, pid: int | None = None) -> None:
        self.interval = interval
        self._proc = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            mib = self._proc.memory_info().rss / 2**20
            self.samples.append((time.time(), mib))
            self.peak_mib = max(self.peak_mib, mib)
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        mib = self._proc.memory_info().rss / 2**20
        self.peak_mib = max(self.peak_mib, mib)


# -- instrumentation (breakdown runs only) ---------------------------------------------------
class Recorder:
    """Points in time of one breakdown run (from a run's phase events, and rank marks)."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def mark(self, label: str, when: float | None = None) -> None:
        """Record a point in time."""
        self.marks.append((label, time.time() if when is None else when))
