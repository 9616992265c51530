"""Kill paths on the real standalone cluster: nothing of the run may survive on the workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cluster import Cluster
from tests.support.driver import run_driver

pytestmark = pytest.mark.cluster

PROGRAM = """
import os, signal, threading, time
from pathlib import Path
import psutil
from pyspark.sql import SparkSession
from sparktorch_ops import TorchDistributor
from sparktorch_ops.wire.env import RUN_ID_ENV
from tests.faults.training import long_training, fail_after_ready, steps_losing_an_executor
from harness.procs import wait_until_gone, warm_processes

spark = (SparkSession.builder.master({master!r}).config("spark.driver.host", "127.0.0.1")
         .config("spark.executor.memory", "1g").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")

def scenario(name, fn, kill):
    ready = Path({tmp!r}) / name
    ready.mkdir()
    d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark, start_timeout=120)
    outcome = {{}}
    def go():
        try:
            outcome["value"] = d.run(fn, str(ready), *([] if fn is long_training else ["raise"]))
        except BaseException as exc:
            outcome["error"] = type(exc).__name__
            outcome["message"] = str(exc)[:500]
    thread = threading.Thread(target=go)
    thread.start()
    deadline = time.monotonic() + 120
    while not all((ready / f"rank{{r}}.pid").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "ranks never started"
        time.sleep(0.1)
    pids = {{r: int((ready / f"rank{{r}}.pid").read_text()) for r in (0, 1)}}
    run_id = psutil.Process(pids[0]).environ()[RUN_ID_ENV]
    started = time.monotonic()
    kill(d, pids)
    thread.join(180)
    outcome["ended"] = not thread.is_alive()
    outcome["seconds"] = time.monotonic() - started
    outcome["left"] = [" ".join(p.cmdline())[:200] for p in wait_until_gone(run_id, timeout=30)]
    # No run here succeeds: no warm agent may be left on the workers either.
    deadline = time.monotonic() + 30
    while warm_on_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    outcome["warm_left"] = [p.pid for p in warm_on_workers()]
    return outcome

def warm_on_workers():
    found = []
    for proc in warm_processes():
        try:
            if any("CoarseGrainedExecutorBackend" in " ".join(a.cmdline()) for a in proc.parents()):
                found.append(proc)
        except psutil.Error:
            pass
    return found

def ancestor(pid, text):
    # The topmost match: forked ranks and supervisors share their agent's command line.
    return [p for p in psutil.Process(pid).parents() if text in " ".join(p.cmdline())][-1]

out = {{}}
out["raise"] = scenario("raise", fail_after_ready, lambda d, pids: None)
out["rank_kill"] = scenario("rank_kill", long_training, lambda d, pids: os.kill(pids[1], signal.SIGKILL))
out["agent_kill"] = scenario("agent_kill", long_training,
                             lambda d, pids: ancestor(pids[0], "sparktorch_ops.node.agent").kill())
out["cancel"] = scenario("cancel", long_training, lambda d, pids: d.cancel())
out["executor_kill"] = scenario("executor_kill", long_training,
                                lambda d, pids: ancestor(pids[1], "CoarseGrainedExecutorBackend").kill())

def attempts(name, whole_worker, **options):
    # max_failures=1: rank 1's executor (or its whole worker) is SIGKILLed after step 2's
    # checkpoint; the call returns the resumed training.
    folder = Path({tmp!r}) / name
    folder.mkdir()
    d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark,
                         max_failures=1, checkpoint_dir=str(folder / "checkpoints"), **options)
    outcome = {{}}
    try:
        if whole_worker:  # DataFrame input: laid out again over the ranks of attempt 2
            frame = spark.range(1000, numPartitions=4)
            result = d.launch_on_dataframe(steps_losing_an_executor, frame, 6, str(folder), True, True)
        else:
            result = d.launch(steps_losing_an_executor, 6, str(folder))
    except BaseException as exc:
        outcome["error"] = f"{{type(exc).__name__}}: {{str(exc)[:3000]}}"
        return outcome
    outcome["value"] = result.value
    outcome["attempts"] = [a.to_dict() for a in result.attempts]
    outcome["steps"] = sorted({{m.step for m in result.metrics if m.rank == 0}})
    killed = float((folder / "killed").read_text())
    restarted = min(p.stat().st_mtime for p in folder.glob("later.rank*"))
    outcome["training_again_after_s"] = restarted - killed
    outcome["left"] = [" ".join(p.cmdline())[:200] for p in wait_until_gone(result.run_id, timeout=30)]
    return outcome

def slots():
    jsc = spark.sparkContext._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))

def wait_for_slots(predicate, what):
    deadline = time.monotonic() + 120
    while not predicate(slots()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)

# Both executors (the one killed above comes back), then one SIGKILLed while no run holds it:
# the next run starts while the worker relaunches it, and waits for it instead of failing.
wait_for_slots(lambda n: n == 2, "the killed executor was never replaced")
idle = [p for p in psutil.process_iter(["cmdline"])
        if "CoarseGrainedExecutorBackend" in " ".join(p.info["cmdline"] or [])][0]
idle.kill()
wait_for_slots(lambda n: n == 1, "the driver never saw the executor go")
slots_at_start = slots()
out["executor_lost_then_replaced"] = attempts("executor_lost_then_replaced", False)
out["executor_lost_then_replaced"]["slots_at_start"] = slots_at_start
# Last: the cluster keeps one worker (this test's fixture runs after every other test).
out["worker_lost"] = attempts("worker_lost", True, min_processes=1)
emit(out)
"""


def test_kill_paths_on_the_standalone_cluster(
    doomed_standalone_cluster: Cluster, tmp_path: Path
) -> None:
    result, output = run_driver(
        tmp_path,
        PROGRAM.format(master=doomed_standalone_cluster.master_url, tmp=str(tmp_path)),
        timeout=900,
    )
    expected = {
        "raise": "TrainingFailedError",
        "rank_kill": "TrainingFailedError",
        "agent_kill": "TrainingFailedError",
        "cancel": "TrainingCancelledError",
        "executor_kill": "TrainingFailedError",
    }
    for name, error in expected.items():
        case = result[name]
        assert case["ended"], (name, output[-4000:])
        assert case.get("error") == error, (name, case)
        assert case["left"] == [], (name, case["left"])
        assert case["warm_left"] == [], (name, case["warm_left"])
    assert "rank 1 raised on purpose" in result["raise"]["message"]

    # max_failures=1: the executor under rank 1 SIGKILLed after step 2's checkpoint; the
    # worker relaunches it and the second attempt resumes on both ranks.
    # It started while the worker relaunched an executor killed just before: it waited for it.
    replaced = result["executor_lost_then_replaced"]
    assert "error" not in replaced, (replaced, output[-4000:])
    assert replaced["slots_at_start"] == 1
    assert replaced["value"]["start"] == 2 and replaced["value"]["ran"] == [3, 4, 5]
    assert replaced["value"]["total"] == 15.0 and replaced["value"]["world"] == 2
    assert replaced["steps"] == [0, 1, 2, 3, 4, 5]  # every step's metric
    first, second = replaced["attempts"]
    # Which side tells first depends on the machine's speed: the task's connection dropping
    # ("was lost"), the rank's signal, or Spark's job error ("lost an executor").
    assert any(cause in first["cause"] for cause in ("was lost", "SIGKILL", "lost an executor"))
    assert (second["resumed_from"], second["num_processes"], second["cause"]) == (2, 2, None)
    assert replaced["left"] == []
    # The worker killed with its executor: no slot comes back, and min_processes=1 lets the
    # second attempt run on one rank, from the checkpoint, with every row of the DataFrame.
    lost = result["worker_lost"]
    assert "error" not in lost, (lost, output[-4000:])
    assert lost["value"]["world"] == 1 and lost["value"]["rows"] == 1000
    assert lost["value"]["start"] == 2 and lost["value"]["total"] == 15.0
    assert [a["num_processes"] for a in lost["attempts"]] == [2, 1]
    assert lost["left"] == []
    print(
        "\nexecutor SIGKILLed -> ranks training again: "
        f"{replaced['training_again_after_s']:.1f} s (replaced), "
        f"{lost['training_again_after_s']:.1f} s (worker lost: one rank, without waiting for it)"
    )
