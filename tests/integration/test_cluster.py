"""Barrier mode on a real Spark standalone cluster (master + 2 workers on 127.0.0.1).

Each driver runs in its own process: one SparkContext per process.
"""

from __future__ import annotations

import sys
from pathlib import Path

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


def test_code_shipping_on_the_standalone_cluster(
    standalone_cluster: Cluster, tmp_path: Path
) -> None:
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
    result, output = run_driver(
        tmp_path,
        SESSION.format(master=standalone_cluster.master_url)
        + f"""
import os, sys
sys.path.insert(0, {str(tmp_path / "userlib")!r})  # importable on the driver only
import helpers
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

# No start_timeout: the first run right after getOrCreate() waits for the executors to register.
d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark)
out = {{}}
out["main"] = d.run(main_fn, 1, b=2)
out["closure"] = d.run(closure)
out["module"] = d.run(helpers.from_module, 4, offset=1)
out["script"] = d.run({str(tmp_path / "only_on_driver.py")!r}, "--lr=0.5")
out["executors"] = sorted(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().keySet().toString().split(","))
emit(out)
""",
    )
    assert result["main"] == {"sum": 3, "world": 2, "host": "127.0.0.1"}, output
    assert result["closure"] == 14
    assert result["module"] == {"value": 41, "rank": 0}
    script_line = result["script"].strip()
    assert script_line.startswith("script") and "--lr=0.5" in script_line
    assert str(tmp_path) not in script_line  # ran from the shipped copy, not the driver's file


def _python(version: str) -> str | None:
    path = Path.home() / ".pyenv" / "versions"
    for candidate in sorted(path.glob(f"{version}*/bin/python{version}")):
        return str(candidate)
    return None


def test_executor_python_problems_are_clear_errors(tmp_path: Path) -> None:
    """Sequential sessions in one driver: wrong Python version, no torch, dynamic allocation,
    encryption. Each must fail before launch, naming what to set."""
    other_version = _python("3.12")
    no_torch = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else None
    if other_version is None or no_torch is None:
        pytest.skip("needs a Python 3.12 and a system python3 without torch on this machine")
    result, output = run_driver(
        tmp_path,
        f"""
import os, time
from pyspark.sql import SparkSession
from sparktorch_ops import TorchDistributor, ConfigError

def attempt(python, **conf):
    os.environ["PYSPARK_PYTHON"] = python
    builder = SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
    for key, value in conf.items():
        builder = builder.config(key.replace("_", "."), value)
    spark = builder.getOrCreate()
    started = time.monotonic()
    try:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).run(print)
        return {{"error": None}}
    except ConfigError as exc:
        return {{"error": str(exc), "argument": exc.argument, "seconds": time.monotonic() - started}}
    finally:
        spark.stop()

out = {{}}
out["version"] = attempt({other_version!r})
out["no_torch"] = attempt({no_torch!r})
out["dynamic"] = attempt({sys.executable!r}, spark_dynamicAllocation_enabled="true",
                         spark_shuffle_service_enabled="false")
out["crypto"] = attempt({sys.executable!r}, spark_authenticate="true",
                        spark_authenticate_secret="s", spark_network_crypto_enabled="true")
emit(out)
""",
    )
    version, no_torch_result = result["version"], result["no_torch"]
    assert version["argument"].startswith("PYSPARK_PYTHON"), output
    assert "another Python version" in version["error"] or "runs Python 3.12" in version["error"]
    assert no_torch_result["argument"].startswith("PYSPARK_PYTHON")
    assert "torch" in no_torch_result["error"] and "PYSPARK_PYTHON" in no_torch_result["error"]
    assert result["dynamic"]["argument"] == "local_mode"
    assert "dynamicAllocation" in result["dynamic"]["error"]
    assert result["crypto"]["argument"] == "allow_unencrypted_channel"
    for case in result.values():
        assert case["seconds"] < 60


def test_gpu_assignment_with_fake_discovery_scripts(tmp_path: Path) -> None:
    """Like Spark's own tests: discovery scripts print fake GPU addresses; each rank must see
    exactly its task's GPUs (barrier) or the same first-N driver GPUs (local mode)."""
    worker_script = tmp_path / "worker_gpus.sh"
    worker_script.write_text('#!/bin/bash\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    driver_script = tmp_path / "driver_gpus.sh"
    driver_script.write_text(
        '#!/bin/bash\necho \'{"name": "gpu", "addresses": ["5", "6", "7"]}\'\n'
    )
    for script in (worker_script, driver_script):
        script.chmod(0o755)
    result, output = run_driver(
        tmp_path,
        f"""
import os
from pyspark.sql import SparkSession
from sparktorch_ops import TorchDistributor
spark = (SparkSession.builder.master("local-cluster[2,1,1024]")
         .config("spark.driver.host", "127.0.0.1")
         .config("spark.worker.resource.gpu.amount", "2")
         .config("spark.worker.resource.gpu.discoveryScript", {str(worker_script)!r})
         .config("spark.executor.resource.gpu.amount", "2")
         .config("spark.task.resource.gpu.amount", "2")
         .config("spark.driver.resource.gpu.amount", "3")
         .config("spark.driver.resource.gpu.discoveryScript", {str(driver_script)!r})
         .getOrCreate())

def layout():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    mine = {{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "GROUP_RANK")}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    return everyone

out = {{}}
out["barrier"] = TorchDistributor(
    num_processes=4, local_mode=False, use_gpu=True, spark=spark, start_timeout=120
).run(layout)
out["local"] = TorchDistributor(num_processes=2, local_mode=True, use_gpu=True, spark=spark).run(layout)
try:
    TorchDistributor(num_processes=6, local_mode=False, use_gpu=True, spark=spark).run(layout)
except Exception as exc:
    out["too_many"] = [type(exc).__name__, str(exc)]
emit(out)
""",
    )
    barrier = result["barrier"]
    assert [r["RANK"] for r in barrier] == ["0", "1", "2", "3"], output
    assert sorted(r["LOCAL_RANK"] for r in barrier) == ["0", "0", "1", "1"]
    assert {r["CUDA_VISIBLE_DEVICES"] for r in barrier} == {"0,1"}
    assert sorted(r["GROUP_RANK"] for r in barrier) == ["0", "0", "1", "1"]
    local = result["local"]
    assert [(r["LOCAL_RANK"], r["CUDA_VISIBLE_DEVICES"]) for r in local] == [
        ("0", "5,6"),
        ("1", "5,6"),
    ]
    assert result["too_many"][0] == "ResourceError"
    assert "num_processes" in result["too_many"][1]


def test_a_fresh_application_waits_for_its_executors_but_not_for_missing_ones(
    tmp_path: Path,
) -> None:
    """Executors register seconds after getOrCreate(): a run launched at once must wait for them
    (no start_timeout needed), and a run needing more slots than the cluster will ever have must
    still fail once every expected executor is there, not after Spark's whole start-up wait."""
    result, output = run_driver(
        tmp_path,
        """
import time
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
    import os
    return int(os.environ["WORLD_SIZE"])

def stop(spark):
    # local-cluster's own shutdown can race with its master relaunching executors; that is
    # Spark's business, not what this test checks.
    try:
        spark.stop()
    except Exception as exc:
        out.setdefault("stop_errors", []).append(repr(exc)[:300])

out = {}
spark = fresh_session()
out["executors_at_launch"] = int(spark.sparkContext._jsc.sc().getExecutorIds().size())
out["world"] = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).run(world)
stop(spark)

spark = fresh_session(**{"spark.scheduler.maxRegisteredResourcesWaitingTime": "600s"})
started = time.monotonic()
try:
    TorchDistributor(num_processes=3, local_mode=False, use_gpu=False, spark=spark).run(world)
except ResourceError as exc:
    out["too_many"] = {"argument": exc.argument, "error": str(exc),
                       "seconds": time.monotonic() - started}
emit(out)
stop(spark)
""",
    )
    assert result["world"] == 2, output
    too_many = result["too_many"]
    assert too_many["argument"] == "num_processes"
    assert "needs 3 barrier task slots" in too_many["error"] and "has 2" in too_many["error"]
    # Bound only to prove it did not sit out the 600 s start-up wait.
    assert too_many["seconds"] < 120
