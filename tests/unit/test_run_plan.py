"""The run plan of both launchers, by exact equality, and its dry-run view."""

from __future__ import annotations

import json

import pytest

from sparktorch_ops.driver import planning
from sparktorch_ops.driver.planning import RunFacts, plan_run
from sparktorch_ops.errors import ResourceError
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire import env as wire_env
from sparktorch_ops.wire import plan as run_plan
from sparktorch_ops.wire.plan import (
    NODE_HOST,
    NODE_PYTHON,
    PAYLOAD_PATH,
    RDZV_ENDPOINT,
    TASK_GPUS,
    UNKNOWN,
)

FACTS = RunFacts(
    run_id="run1",
    python="/py",
    channel_address="10.0.0.1:5000",
    driver_host="driver",
    cpu_count=8,
    task_cpus=4,
)
BOOT = planning.BOOTSTRAP_SCRIPT


def test_local_plan_is_one_node_with_every_rank() -> None:
    spec = LaunchSpec(num_processes=4, use_gpu=False, env={"A": "1"}, max_restarts=1)
    plan = plan_run(spec, "train (function)", FACTS)
    (node,) = plan.nodes
    assert (plan.mode, plan.layout.num_tasks, plan.layout.ranks_per_task) == ("local", 1, 4)
    assert node.ranks == (0, 1, 2, 3)
    assert node.argv == (
        "/py", "-m", "sparktorch_ops.node.agent", "run1", "--nnodes=1", "--nproc-per-node=4",
        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=run1",
        "--max-restarts=1", "--local-addr=127.0.0.1", "--run-path", "--start-method=fork",
        BOOT, "run1",
    )  # fmt: skip
    assert (node.host, node.cuda_visible_devices, node.omp_threads) == ("driver", None, 2)
    agent = node.bind(
        {"PATH": "/bin"}, run_id="run1", channel=plan.channel_address,
        fingerprint=None, payload_path="/w/payload.pkl", secret_path="/w/channel.secret",
        launcher_pid=42,
    )  # fmt: skip
    assert agent.argv == node.argv
    assert agent.env == {
        "PATH": "/bin",
        "A": "1",
        wire_env.RUN_ID_ENV: "run1",
        wire_env.CHANNEL_ENV: "10.0.0.1:5000",
        wire_env.SECRET_FILE_ENV: "/w/channel.secret",
        wire_env.PAYLOAD_ENV: "/w/payload.pkl",
        wire_env.NODE_HOST_ENV: "driver",
        wire_env.LAUNCHER_PID_ENV: "42",
        "OMP_NUM_THREADS": "2",
        wire_env.UNSHARED_STORE_ENV: "1",  # max_restarts=1
    }


def test_local_gpu_plan_pins_the_chosen_gpus() -> None:
    spec = LaunchSpec(num_processes=2, use_gpu=True)
    facts = RunFacts(run_id="r", python="/py", local_gpus=("3", "5"), cpu_count=2)
    (node,) = plan_run(spec, "f", facts).nodes
    assert node.cuda_visible_devices == "3,5"
    unknown = plan_run(spec, "f", RunFacts(run_id="r", python="/py")).nodes[0]
    assert unknown.cuda_visible_devices == UNKNOWN and unknown.omp_threads is None


def test_barrier_plan_has_one_node_per_task_with_placeholders_bound_in_the_task() -> None:
    spec = LaunchSpec(num_processes=4, local_mode=False, use_gpu=True, start_timeout=30)
    facts = RunFacts(
        run_id="r", python="/py", channel_address="d:1", task_cpus=4, task_gpu_amount=2
    )
    plan = plan_run(spec, "f", facts)
    assert [n.ranks for n in plan.nodes] == [(0, 1), (2, 3)]
    node = plan.nodes[1]
    assert node.argv == (
        NODE_PYTHON, "-m", "sparktorch_ops.node.agent", "r", "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={RDZV_ENDPOINT}", "--rdzv-id=r",
        "--max-restarts=0", f"--local-addr={NODE_HOST}", "--rdzv-conf=is_host=false,join_timeout=30",
        "--run-path", "--start-method=fork", planning.TASK_BOOTSTRAP_SCRIPT, "r",
    )  # fmt: skip
    assert (node.host, node.cuda_visible_devices, node.omp_threads) == (NODE_HOST, TASK_GPUS, 2)
    agent = node.bind(
        {"OMP_NUM_THREADS": "3"}, run_id="r", channel="d:1", fingerprint="f1",
        payload_path="/p", secret_path="/s", launcher_pid=7, host="w2", rdzv_endpoint="w0:999",
        gpus=["0", "1"], package_root="/copy", python="/executor/python",
    )  # fmt: skip
    assert "--rdzv-endpoint=w0:999" in agent.argv and "--local-addr=w2" in agent.argv
    # The task's own Python and copy of the package run the agent and the ranks, wherever
    # the driver's lie.
    assert agent.argv[0] == "/executor/python"
    assert agent.argv[-2] == "/copy/sparktorch_ops/rank/bootstrap.py"
    assert agent.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert agent.env[wire_env.NODE_HOST_ENV] == "w2"
    assert agent.env["OMP_NUM_THREADS"] == "3"  # the node's own setting wins
    assert agent.env[wire_env.FINGERPRINT_ENV] == "f1"
    assert agent.env[wire_env.SECRET_FILE_ENV] == "/s"
    with pytest.raises(ValueError, match="unfilled placeholder"):
        node.bind(
            {}, run_id="r", channel="d:1", fingerprint=None, payload_path="/p",
            secret_path="/s", launcher_pid=7,
        )  # fmt: skip


def test_barrier_plan_without_a_gpu_amount_is_the_same_resource_error_as_a_run() -> None:
    spec = LaunchSpec(num_processes=2, local_mode=False, use_gpu=True)
    with pytest.raises(ResourceError, match="use_gpu=False"):
        plan_run(spec, "f", RunFacts(run_id="r", python="/py"))


def test_dry_run_view_is_json_and_never_holds_the_secret() -> None:
    spec = LaunchSpec(num_processes=2, local_mode=False, use_gpu=False, env={"X": "y"})
    view = plan_run(spec, "train.py --lr=1 (script)", FACTS).to_dict()
    text = json.dumps(view)
    assert view["nodes_count"] == 2 and view["payload"] == "train.py --lr=1 (script)"
    assert view["nodes"][0]["env"][wire_env.SECRET_FILE_ENV] == run_plan.SECRET_PATH
    assert wire_env.FINGERPRINT_ENV not in view["nodes"][0]["env"] and not view["channel_tls"]
    assert view["nodes"][0]["env"][wire_env.PAYLOAD_ENV] == PAYLOAD_PATH
    assert view["nodes"][1]["env"]["X"] == "y"
    assert PAYLOAD_PATH in view["placeholders"]
    assert json.loads(text) == view


def test_bind_fills_placeholders_even_over_a_nested_runs_variables() -> None:
    spec = LaunchSpec(num_processes=2, local_mode=False, use_gpu=False)
    node = plan_run(spec, "f", FACTS).nodes[0]
    outer = {wire_env.PAYLOAD_ENV: "/outer/payload.pkl", wire_env.NODE_HOST_ENV: "outer"}
    agent = node.bind(
        outer, run_id="run1", channel="d:1", fingerprint=None, payload_path="/p",
        secret_path="/s", launcher_pid=1, host="w0", rdzv_endpoint="w0:1", package_root="/c",
        python="/p",
    )  # fmt: skip
    assert agent.env[wire_env.PAYLOAD_ENV] == "/p" and agent.env[wire_env.NODE_HOST_ENV] == "w0"


def test_checkpoint_options_and_restarts_reach_every_rank_env() -> None:
    from sparktorch_ops.driver.planning import run_env
    from sparktorch_ops.wire.env import CHECKPOINT_DIR_ENV, UNSHARED_STORE_ENV, WARM_START_ENV

    spec = LaunchSpec(checkpoint_dir="file:///shared/ck", max_restarts=1, env={"A": "1"})
    assert run_env(spec) == {
        "A": "1",
        CHECKPOINT_DIR_ENV: "file:///shared/ck",
        UNSHARED_STORE_ENV: "1",  # each restart attempt gets its own store
    }
    assert run_env(LaunchSpec(env={"A": "1"})) == {"A": "1"}
    assert WARM_START_ENV not in run_env(spec)
    # The user's own setting of the store switch is kept.
    assert (
        run_env(LaunchSpec(max_restarts=2, env={UNSHARED_STORE_ENV: "0"}))[UNSHARED_STORE_ENV]
        == "0"
    )
