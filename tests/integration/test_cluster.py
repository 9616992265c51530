"""Barrier mode on a real Spark standalone cluster (master + 2 workers on 127.0.0.1).

Each driver runs in its own process: one SparkContext per process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster
from tests.support.driver import run_driver

pytestmark = pytest.mark.cluster

SESSION = """
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master({master!r}).appName("sparktorch-cluster-test")
         .config("spark.driver.host", "127.0.0.1").config("spark.executor.memory", "1g")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
"""


STANDALONE_PROGRAM = """
import os, sys
sys.path.insert(0, {userlib!r})  # importable on the driver only
import helpers
from pyspark.sql import functions as F
from sparktorch_ops import TorchDistributor

def main_fn(a, b=1):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dist.destroy_process_group()
    return {{"sum": a + b, "world": world, "host": os.environ["SPARKTORCH_OPS_HOST"]}}

factor = 7
def closure():
    return factor * int(os.environ["WORLD_SIZE"])

def shard_ids(batch_size):
    import torch.distributed as dist
    from sparktorch_ops.data import partition_loader
    dist.init_process_group("gloo")
    ids, batches, aligned = [], 0, True
    for batch in partition_loader(batch_size, columns=["id", "x"]):
        batches += 1
        ids += batch["id"].tolist()
        aligned &= bool((batch["x"] == batch["id"].float() / 2).all())
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {{"ids": ids, "batches": batches, "aligned": aligned}})
    dist.destroy_process_group()
    return out

# No start_timeout: the first run right after getOrCreate() waits for the executors to register.
d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
out = {{}}
out["main"] = d.run(main_fn, 1, b=2)
out["closure"] = d.run(closure)
out["module"] = d.run(helpers.from_module, 4, offset=1)
out["script"] = d.run({script!r}, "--lr=0.5")
out["executors"] = sorted(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().keySet().toString().split(","))
frame = spark.range(1000, numPartitions=5).withColumn("x", (F.col("id") / 2).cast("float"))
result = d.launch_on_dataframe(shard_ids, frame, 100)
out["dataframe"] = {{"ranks": result.value, "input": result.input}}
spark.stop()

def trained():
    import sparktorch_ops, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {{"sum": total.item(), "package": sparktorch_ops.__file__, "python": sys.executable}}

# Then one application per executors' Python: torch and pyspark only, then a broken
# sparktorch_ops installed as well.
out["shipped"] = {{}}
for name, python in {pythons!r}.items():
    os.environ["PYSPARK_PYTHON"] = python  # the executors' Python of this application
    spark = (SparkSession.builder.master({master!r}).config("spark.driver.host", "127.0.0.1")
             .config("spark.executor.memory", "1g").getOrCreate())
    try:
        d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
        out["shipped"][name] = d.run(trained)
    finally:
        spark.stop()
emit(out)
"""


@pytest.fixture(scope="module")
def standalone_runs(
    standalone_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], str, Path]:
    """One driver program on the standalone cluster, its runs checked by the tests below:
    (what it emitted, its output, its directory). Its last two applications run their
    executors on interpreters with torch and pyspark only, then with a broken sparktorch_ops
    installed as well (tests/support/worker_env.py)."""
    from harness.procs import measuring_coverage
    from tests.support import worker_env

    tmp_path = tmp_path_factory.mktemp("standalone-driver")
    coverage = measuring_coverage()
    pythons = {
        "missing": worker_env.build(tmp_path / "missing", broken=False, coverage=coverage),
        "broken": worker_env.build(tmp_path / "broken", broken=True, coverage=coverage),
    }
    (tmp_path / "userlib").mkdir()
    (tmp_path / "userlib" / "helpers.py").write_text(
        "import os\n"
        "def scale(x):\n"
        "    return x * 10\n"
        "def from_module(x, *, offset=0):\n"
        "    return {'value': scale(x) + offset, 'rank': int(os.environ['RANK'])}\n"
    )
    (tmp_path / "only_on_driver.py").write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '0':\n"
        "    print('script', __file__ != sys.argv[0] or __file__, sys.argv[1:])\n"
    )
    program = STANDALONE_PROGRAM.format(
        userlib=str(tmp_path / "userlib"),
        script=str(tmp_path / "only_on_driver.py"),
        pythons=pythons,
        master=standalone_cluster.master_url,
    )
    result, output = run_driver(
        tmp_path, SESSION.format(master=standalone_cluster.master_url) + program
    )
    return result, output, tmp_path


def test_code_shipping_on_the_standalone_cluster(
    standalone_runs: tuple[dict[str, Any], str, Path],
) -> None:
    result, output, tmp_path = standalone_runs
    assert result["main"] == {"sum": 3, "world": 2, "host": "127.0.0.1"}, output
    assert result["closure"] == 14
    assert result["module"] == {"value": 41, "rank": 0}
    script_line = result["script"].strip()
    assert script_line.startswith("script") and "--lr=0.5" in script_line
    assert str(tmp_path) not in script_line  # ran from the shipped copy, not the driver's file


def test_executors_with_torch_but_no_working_sparktorch_ops_train_with_the_drivers_copy(
    standalone_runs: tuple[dict[str, Any], str, Path],
) -> None:
    """Workers whose Python has torch and pyspark only, then one with a broken sparktorch_ops
    installed: both train in barrier mode, agents and ranks on the executors' Python, importing
    the copy the driver shipped (unpacked in the application's files, not site-packages)."""
    result, output, tmp_path = standalone_runs
    for name in ("missing", "broken"):
        ran = result["shipped"][name]
        assert ran["sum"] == 3.0, output[-3000:]
        assert ran["python"] == str(tmp_path / name / "bin" / "python")  # the executors' own
        shipped = Path(ran["package"]).parents[1]
        assert shipped.name.startswith("sparktorch_ops-") and "site-packages" not in str(shipped)
        assert (shipped / "sparktorch_ops" / "node" / "task.py").read_bytes() == (
            Path(__file__).parents[2] / "sparktorch_ops" / "node" / "task.py"
        ).read_bytes()


def test_dataframe_input_on_the_standalone_cluster(
    standalone_runs: tuple[dict[str, Any], str, Path],
) -> None:
    """A DataFrame of uneven partitions reaches both barrier tasks on two workers: every row on
    exactly one rank, equal batches, features aligned with their row."""
    result, output, _ = standalone_runs
    ranks = result["dataframe"]["ranks"]
    first, second = (set(r["ids"]) for r in ranks)
    assert first.isdisjoint(second) and first | second == set(range(1000)), output[-3000:]
    assert ranks[0]["batches"] == ranks[1]["batches"] and all(r["aligned"] for r in ranks)
    assert result["dataframe"]["input"]["rows"] == 1000
    assert result["dataframe"]["input"]["columns"] == ["id", "x"]


ATTEMPTS = """
import os, sys, time
from pyspark.sql import SparkSession
from sparktorch_ops import TorchDistributor, ConfigError
from sparktorch_ops.wire.env import FINGERPRINT_ENV

# The session that starts the JVM passes its settings as Java system properties, which every
# later session of the process inherits: each case states the settings the others change.
NEUTRAL = {"spark.dynamicAllocation.enabled": "false", "spark.authenticate": "false",
           "spark.network.crypto.enabled": "false", "spark.ssl.enabled": "false"}

def session(python, conf):
    os.environ["PYSPARK_PYTHON"] = python
    builder = SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
    for key, value in {**NEUTRAL, **conf}.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()

def attempt(python, conf):
    spark = session(python, conf)
    started = time.monotonic()
    try:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).run(print)
        return {"error": None}
    except ConfigError as exc:
        return {"error": str(exc), "argument": exc.argument, "seconds": time.monotonic() - started}
    finally:
        spark.stop()

def all_reduce():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"sum": t.item(), "pinned": os.environ.get(FINGERPRINT_ENV, "")}

def encrypted():
    spark = session(sys.executable, {"spark.authenticate": "true", "spark.authenticate.secret": "s",
                                     "spark.network.crypto.enabled": "true"})
    out = {}
    for opt_out in (False, True):
        opened = []
        d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark,
                             allow_unencrypted_channel=opt_out,
                             on_event=lambda e: opened.append(e.detail.get("tls"))
                             if e.name == "channel_open" else None)
        out[str(opt_out)] = {"value": d.run(all_reduce), "tls": opened}
    spark.stop()
    return out

refused = {name: attempt(python, conf) for name, (python, conf) in CASES.items()}
emit({"refused": refused, "encrypted": encrypted()})
"""


def _python_version(python: str) -> tuple[int, int] | None:
    try:
        proc = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 or len(proc.stdout.split()) != 2:
        return None
    major, minor = proc.stdout.split()
    return int(major), int(minor)


def _other_cpython() -> tuple[str, str] | None:
    """A CPython 3.10-3.13 other than this one's minor version, under ~/.pyenv/versions or on
    PATH (nearest minor first): (interpreter, "3.x"), or None."""
    mine = sys.version_info.minor
    for minor in sorted({10, 11, 12, 13} - {mine}, key=lambda m: (abs(m - mine), -m)):
        name = f"python3.{minor}"
        versions = Path.home() / ".pyenv" / "versions"
        candidates = [
            str(p) for p in sorted(versions.glob(f"3.{minor}.*/bin/{name}"), reverse=True)
        ]
        candidates += [found] if (found := shutil.which(name)) else []
        for candidate in candidates:  # a pyenv shim may name a version it cannot run
            if _python_version(candidate) == (3, minor):
                return candidate, f"3.{minor}"
    return None


@pytest.fixture(scope="module")
def fresh_session_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], str, str]:
    """One driver, barrier runs on fresh local[2] sessions. First a run per case, each of
    which must fail with a ConfigError within seconds: dynamic allocation on (before launch);
    executors on a venv of this Python without torch, on one whose torch raises on import, and
    on another CPython minor version (when this machine has one), each found by the run's own
    barrier tasks. Then a session with Spark's authentication and encryption on. Returns
    {"refused": each case's ConfigError, "encrypted": the encrypted session's runs}, the
    driver's output and the torch-less interpreter."""
    tmp_path = tmp_path_factory.mktemp("fresh-session-runs")
    venv = tmp_path / "no-torch-venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    bare = str(venv / "bin" / "python")
    no_torch = subprocess.run([bare, "-c", "import torch"], capture_output=True, timeout=60)
    assert no_torch.returncode != 0, "the throwaway venv can import torch"
    assert _python_version(bare) == sys.version_info[:2]
    broken_venv = tmp_path / "broken-torch-venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(broken_venv)], check=True, timeout=120)
    (site,) = broken_venv.glob("lib/python3.*/site-packages")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: bad ELF')\n")
    broken = str(broken_venv / "bin" / "python")
    dynamic = {"spark.dynamicAllocation.enabled": "true", "spark.shuffle.service.enabled": "false"}
    cases = {
        "dynamic": (sys.executable, dynamic),
        "no_torch": (bare, {}),
        "broken_torch": (broken, {}),
    }
    other = _other_cpython()
    if other is not None:
        cases["version"] = (other[0], {})
    result, output = run_driver(tmp_path, f"CASES = {cases!r}\n" + ATTEMPTS)
    for name, case in result["refused"].items():
        assert case["error"] is not None, f"{name}: the barrier run did not fail\n{output[-3000:]}"
        assert case["seconds"] < 60, f"{name}: failed only after {case['seconds']:.0f} s"
    return result, output, bare


def test_dynamic_allocation_is_a_clear_error(
    fresh_session_runs: tuple[dict[str, Any], str, str],
) -> None:
    """Dynamic allocation fails before launch, naming the argument to change."""
    runs, output, _ = fresh_session_runs
    result = runs["refused"]
    assert result["dynamic"]["argument"] == "local_mode", output[-3000:]
    assert "dynamicAllocation" in result["dynamic"]["error"]


def test_spark_encryption_puts_the_channel_under_tls(
    fresh_session_runs: tuple[dict[str, Any], str, str],
) -> None:
    """spark.network.crypto.enabled=true: the barrier run's channel is TLS, pinned by the
    fingerprint the ranks carry, and the run returns rank 0's value; the explicit opt-out keeps
    it plain."""
    runs, output, _ = fresh_session_runs
    encrypted, plain = runs["encrypted"]["False"], runs["encrypted"]["True"]
    assert encrypted["tls"] == [True], output[-3000:]
    assert encrypted["value"]["sum"] == 3.0 and len(encrypted["value"]["pinned"]) == 64
    assert plain["tls"] == [False] and plain["value"] == {"sum": 3.0, "pinned": ""}


def test_executor_python_without_torch_is_a_clear_error(
    fresh_session_runs: tuple[dict[str, Any], str, str],
) -> None:
    """Executors on a fresh venv of the same Python (no torch, no sparktorch_ops): the run's
    barrier tasks find it before their agents start, and the run fails naming PYSPARK_PYTHON,
    the interpreter and what is missing; one whose torch raises on import likewise, with the
    import's error."""
    runs, output, bare = fresh_session_runs
    result = runs["refused"]
    case = result["no_torch"]
    assert case["argument"].startswith("PYSPARK_PYTHON"), output[-3000:]
    assert "PYSPARK_PYTHON" in case["error"] and "No module named 'torch'" in case["error"]
    assert bare in case["error"]  # the interpreter that lacks it
    broken = result["broken_torch"]
    assert broken["argument"].startswith("PYSPARK_PYTHON"), output[-3000:]
    assert "ImportError: libtorch_cpu.so: bad ELF" in broken["error"]
    assert "broken-torch-venv" in broken["error"]


def test_executor_python_of_another_version_is_a_clear_error(
    fresh_session_runs: tuple[dict[str, Any], str, str],
) -> None:
    """Executors on another CPython minor version than the driver: Spark's workers refuse to
    run the barrier tasks, and the run fails naming PYSPARK_PYTHON. Needs such an interpreter
    on this machine (PATH or pyenv)."""
    other = _other_cpython()
    if other is None:
        pytest.skip(
            "no CPython 3.10-3.13 other than this one's version on PATH or in ~/.pyenv/versions"
        )
    runs, output, _ = fresh_session_runs
    case = runs["refused"]["version"]
    assert case["argument"].startswith("PYSPARK_PYTHON"), output[-3000:]
    assert "PYSPARK_PYTHON" in case["error"]
    assert "another Python version" in case["error"] or f"runs Python {other[1]}" in case["error"]


LOCAL_CLUSTER_PROGRAM = """
import os, time
from pyspark.sql import SparkSession
from sparktorch_ops import TorchDistributor, ResourceError

def fresh_session(**conf):
    builder = (SparkSession.builder.master("local-cluster[2,1,1024]")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.ui.showConsoleProgress", "false"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()

def world():
    return int(os.environ["WORLD_SIZE"])

def layout():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    mine = {{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "GROUP_RANK")}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return everyone

def warm_agents():
    # Every rank's Python worker (its launcher), warm process and any other group's variables.
    import psutil
    import torch.distributed as dist
    agent = psutil.Process().parent().parent()  # rank < supervisor < agent < warm < worker
    warm = psutil.Process(agent.ppid())
    mine = {{"worker": warm.ppid(), "warm": warm.pid,
             "stale": sorted(k for k in ("NODE_RANK", "PYSPARK_TORCH_DISTRIBUTOR_RDZV_ID") if k in os.environ)}}
    dist.init_process_group("gloo")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return everyone

def pyspark_workers():
    import psutil
    import torch.distributed as dist
    dist.init_process_group("gloo")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [p.pid for p in psutil.Process().parents()])
    dist.destroy_process_group()
    return everyone

def stop(spark):
    # local-cluster's own shutdown can race with its master relaunching executors; that is
    # Spark's business, not what these tests check.
    try:
        spark.stop()
    except Exception as exc:
        out.setdefault("stop_errors", []).append(repr(exc)[:300])

out = {{}}
# One application serves every check: it is launched on at once (its executors still
# registering), may wait 600 s for them (a run that can never fit must not), and has fake GPUs:
# 2 per worker (each task takes both), 3 on the driver, CUDA_VISIBLE_DEVICES=3,4,5 preset on the
# executors.
spark = fresh_session(**{{
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "600s",
    "spark.worker.resource.gpu.amount": "2",
    "spark.worker.resource.gpu.discoveryScript": {worker_script!r},
    "spark.executor.resource.gpu.amount": "2",
    "spark.task.resource.gpu.amount": "2",
    "spark.driver.resource.gpu.amount": "3",
    "spark.driver.resource.gpu.discoveryScript": {driver_script!r},
    "spark.executorEnv.CUDA_VISIBLE_DEVICES": "3,4,5",
}})
out["executors_at_launch"] = int(spark.sparkContext._jsc.sc().getExecutorIds().size())
out["world"] = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).run(world)
started = time.monotonic()
try:
    TorchDistributor(num_processes=3, local_mode=False, use_gpu=False, spark=spark).run(world)
except ResourceError as exc:
    out["too_many"] = {{"argument": exc.argument, "error": str(exc),
                       "seconds": time.monotonic() - started}}
# pyspark's TorchDistributor leaves its group's variables in the Python worker its task ran in.
# Trained on a DataFrame, its tasks and ours take their Python workers from the same pool: with
# one core per executor, one worker each.
from pyspark.ml.torch.distributor import TorchDistributor as PysparkDistributor
rows = spark.range(0, 100, 1, numPartitions=2).selectExpr("cast(id as float) as x")
ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
out["warm_before"] = ours.train_on_dataframe(warm_agents, rows)
out["pyspark_ancestors"] = PysparkDistributor(
    num_processes=2, local_mode=False, use_gpu=False
)._train_on_dataframe(pyspark_workers, rows)
out["warm_after"] = ours.train_on_dataframe(warm_agents, rows)
gpus = out["gpus"] = {{}}
gpus["barrier"] = TorchDistributor(
    num_processes=4, local_mode=False, use_gpu=True, spark=spark, start_timeout=120
).run(layout)
gpus["local"] = TorchDistributor(num_processes=2, local_mode=True, use_gpu=True, spark=spark).run(layout)
os.environ["CUDA_VISIBLE_DEVICES"] = "3,4,5"
gpus["local_preset"] = TorchDistributor(
    num_processes=2, local_mode=True, use_gpu=True, spark=spark
).run(layout)
del os.environ["CUDA_VISIBLE_DEVICES"]
try:
    TorchDistributor(num_processes=6, local_mode=False, use_gpu=True, spark=spark).run(layout)
except Exception as exc:
    gpus["too_many"] = [type(exc).__name__, str(exc)]
emit(out)
stop(spark)
"""


@pytest.fixture(scope="module")
def local_cluster_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One driver program, one ``local-cluster[2,1,1024]`` application for every check below:
    launched on as soon as it is created, allowed to wait 600 s for its executors (checked by
    the start-up test), with fake GPU discovery scripts, 2 GPUs per worker and 3 on the
    driver."""
    tmp_path = tmp_path_factory.mktemp("local-cluster-driver")
    worker_script = tmp_path / "worker_gpus.sh"
    worker_script.write_text('#!/bin/bash\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    driver_script = tmp_path / "driver_gpus.sh"
    driver_script.write_text(
        '#!/bin/bash\necho \'{"name": "gpu", "addresses": ["0", "1", "2"]}\'\n'
    )
    for script in (worker_script, driver_script):
        script.chmod(0o755)
    program = LOCAL_CLUSTER_PROGRAM.format(
        worker_script=str(worker_script), driver_script=str(driver_script)
    )
    return run_driver(tmp_path, program, timeout=420)


def test_gpu_assignment_with_fake_discovery_scripts(
    local_cluster_runs: tuple[dict[str, Any], str],
) -> None:
    """Like Spark's own tests: discovery scripts print fake GPU addresses; each rank must see
    exactly its task's GPUs (barrier) or the same first-N driver GPUs (local mode), and where
    the process has a preset CUDA_VISIBLE_DEVICES=3,4,5 (the executors here), Spark's
    addresses 0,1 index into it: the ranks see 3,4, as pyspark's do."""
    result, output = local_cluster_runs
    barrier = result["gpus"]["barrier"]
    assert [r["RANK"] for r in barrier] == ["0", "1", "2", "3"], output
    assert sorted(r["LOCAL_RANK"] for r in barrier) == ["0", "0", "1", "1"]
    assert {r["CUDA_VISIBLE_DEVICES"] for r in barrier} == {"3,4"}
    assert sorted(r["GROUP_RANK"] for r in barrier) == ["0", "0", "1", "1"]
    local = result["gpus"]["local"]
    assert [(r["LOCAL_RANK"], r["CUDA_VISIBLE_DEVICES"]) for r in local] == [
        ("0", "0,1"),
        ("1", "0,1"),
    ]
    preset = result["gpus"]["local_preset"]
    assert [(r["LOCAL_RANK"], r["CUDA_VISIBLE_DEVICES"]) for r in preset] == [
        ("0", "3,4"),
        ("1", "3,4"),
    ]
    assert result["gpus"]["too_many"][0] == "ResourceError"
    assert "num_processes" in result["gpus"]["too_many"][1]


def test_a_pyspark_torchdistributor_run_between_ours_keeps_our_warm_agents(
    local_cluster_runs: tuple[dict[str, Any], str],
) -> None:
    """pyspark's TorchDistributor sets RANK, MASTER_PORT, NODE_RANK, CUDA_VISIBLE_DEVICES...
    in the Spark Python worker its task runs in, and they stay there. Our next run in that
    worker neither passes another group's to its ranks nor takes them for a new environment
    (which would replace the worker's warm agent: a fresh torch import in the run)."""
    result, output = local_cluster_runs
    before, after = result["warm_before"], result["warm_after"]
    workers = {rank["worker"] for rank in before}
    assert len(workers) == 2, output
    # The premise: pyspark's ranks ran under the very workers that keep our warm agents.
    assert all(workers & set(ancestors) for ancestors in result["pyspark_ancestors"]), output
    by_worker = {rank["worker"]: rank["warm"] for rank in before}
    assert {rank["worker"]: rank["warm"] for rank in after} == by_worker
    assert [rank["stale"] for rank in after] == [[], []]


def test_a_fresh_application_waits_for_its_executors_but_not_for_missing_ones(
    local_cluster_runs: tuple[dict[str, Any], str],
) -> None:
    """Executors register seconds after getOrCreate(): a run launched at once must wait for them
    (no start_timeout needed), and a run needing more slots than the cluster will ever have must
    still fail once every expected executor is there, not after Spark's whole start-up wait."""
    result, output = local_cluster_runs
    assert result["world"] == 2, output
    too_many = result["too_many"]
    assert too_many["argument"] == "num_processes"
    assert "needs 3 barrier task slots" in too_many["error"] and "has 2" in too_many["error"]
    # Bound only to prove it did not sit out the 600 s start-up wait.
    assert too_many["seconds"] < 120
