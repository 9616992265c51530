"""Pure planning: exact argv, env, GPU selection and layout."""

from __future__ import annotations

import pytest

from sparktorch_ops.driver import planning
from sparktorch_ops.errors import ConfigError, ResourceError
from sparktorch_ops.wire import env as wire_env
from sparktorch_ops.wire import plan as run_plan


def test_local_agent_argv_is_exact() -> None:
    argv = planning.agent_argv(
        python="/py",
        run_id="run1",
        nnodes=1,
        nproc_per_node=4,
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        is_rdzv_host=None,
        join_timeout=None,
        extra_args=("--monitor-interval=0.5",),
    )
    assert argv == (
        "/py", "-m", "sparktorch_ops.node.agent", "run1",
        "--nnodes=1", "--nproc-per-node=4", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=run1", "--max-restarts=0",
        "--local-addr=127.0.0.1", "--run-path", "--start-method=fork",
        "--monitor-interval=0.5", planning.BOOTSTRAP_SCRIPT, "run1",
    )  # fmt: skip
    assert planning.BOOTSTRAP_SCRIPT.endswith("/sparktorch_ops/rank/bootstrap.py")


def test_barrier_agent_argv_never_hosts_the_store_and_bounds_the_join() -> None:
    argv = planning.agent_argv(
        python="/py",
        run_id="r",
        nnodes=3,
        nproc_per_node=2,
        rdzv_endpoint="10.0.0.5:41234",
        local_addr="10.0.0.7",
        max_restarts=2,
        is_rdzv_host=False,
        join_timeout=45.5,
        extra_args=(),
    )
    assert argv == (
        "/py", "-m", "sparktorch_ops.node.agent", "r",
        "--nnodes=3", "--nproc-per-node=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.5:41234", "--rdzv-id=r", "--max-restarts=2",
        "--local-addr=10.0.0.7", "--rdzv-conf=is_host=false,join_timeout=45",
        "--run-path", "--start-method=fork", planning.BOOTSTRAP_SCRIPT, "r",
    )  # fmt: skip


def test_agent_env_layers_user_env_and_run_settings() -> None:
    env = run_plan.agent_env(
        {"PATH": "/bin", "KEEP": "1"},
        {"MY_VAR": "x"},
        run_id="r",
        channel="127.0.0.1:5",
        fingerprint="ab12",
        secret_path="/tmp/s",
        payload_path="/tmp/p",
        host="h",
        omp_threads=4,
        cuda_visible_devices="2,3",
    )
    assert env == {
        "PATH": "/bin",
        "KEEP": "1",
        "MY_VAR": "x",
        "OMP_NUM_THREADS": "4",
        "CUDA_VISIBLE_DEVICES": "2,3",
        wire_env.RUN_ID_ENV: "r",
        wire_env.CHANNEL_ENV: "127.0.0.1:5",
        wire_env.SECRET_FILE_ENV: "/tmp/s",
        wire_env.FINGERPRINT_ENV: "ab12",
        wire_env.PAYLOAD_ENV: "/tmp/p",
        wire_env.NODE_HOST_ENV: "h",
    }


def _agent_env(base: dict, user: dict, omp_threads: int | None = None) -> dict[str, str]:
    """``agent_env`` for a CPU node with the run's settings fixed (the first test spells them)."""
    return run_plan.agent_env(
        base,
        user,
        run_id="r",
        channel="c",
        fingerprint=None,
        secret_path="s",
        payload_path="p",
        host="h",
        omp_threads=omp_threads,
        cuda_visible_devices=None,
    )


def test_agent_env_drops_another_torch_groups_variables() -> None:
    # What pyspark's TorchDistributor leaves in the Spark Python worker its task ran in.
    pyspark_left = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.9",
        "MASTER_PORT": "57803",
        "PYSPARK_TORCH_DISTRIBUTOR_RDZV_ID": "5744261a",
    }
    env = _agent_env({"PATH": "/bin", **pyspark_left}, {"NODE_RANK": "mine"})
    assert set(pyspark_left) <= wire_env.TORCH_GROUP_VARIABLES
    assert {k: env.get(k) for k in pyspark_left} == {
        **dict.fromkeys(pyspark_left),
        "NODE_RANK": "mine",  # the user's env= still wins
    }
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize(
    ("base", "user"), [({}, {"OMP_NUM_THREADS": "3"}), ({"OMP_NUM_THREADS": "3"}, {})]
)
def test_an_omp_setting_already_there_wins(base: dict, user: dict) -> None:
    env = _agent_env(base, user, omp_threads=8)
    assert env["OMP_NUM_THREADS"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize(
    ("task_cpus", "ranks", "expected"), [(1, 1, 1), (4, 1, 4), (8, 2, 4), (1, 4, 1)]
)
def test_barrier_omp_threads(task_cpus: int, ranks: int, expected: int) -> None:
    assert planning.barrier_omp_threads(task_cpus, ranks) == expected


def test_local_omp_threads_share_the_cores() -> None:
    assert planning.local_omp_threads(8, 2) == 4
    assert planning.local_omp_threads(2, 4) == 1
    assert planning.local_omp_threads(None, 2) == 1


def test_barrier_layout() -> None:
    assert planning.barrier_layout(4, False, None) == run_plan.BarrierLayout(4, 1)
    assert planning.barrier_layout(4, True, 2.0) == run_plan.BarrierLayout(2, 2)
    assert planning.barrier_layout(3, True, 1.0) == run_plan.BarrierLayout(3, 1)


def test_barrier_layout_rejects_missing_fractional_and_uneven_gpu_amounts() -> None:
    with pytest.raises(ResourceError, match="use_gpu=False"):
        planning.barrier_layout(2, True, None)
    with pytest.raises(ResourceError, match="fractional"):
        planning.barrier_layout(2, True, 0.5)
    with pytest.raises(ConfigError, match="not a multiple") as info:
        planning.barrier_layout(3, True, 2.0)
    assert info.value.argument == "num_processes"


def test_local_gpus_prefer_spark_then_cuda_visible_devices_then_machine() -> None:
    select = planning.select_local_gpus
    assert select(
        2, spark_driver_gpus=["5", "6", "7"], cuda_visible_devices=None, device_count=8
    ) == ["5", "6"]
    # As in pyspark: Spark's addresses index into a preset CUDA_VISIBLE_DEVICES.
    assert select(
        2, spark_driver_gpus=["0", "1", "2"], cuda_visible_devices="3,4,5", device_count=8
    ) == ["3", "4"]
    assert select(2, spark_driver_gpus=None, cuda_visible_devices="3, 1,2", device_count=8) == [
        "3",
        "1",
    ]
    assert select(3, spark_driver_gpus=None, cuda_visible_devices=None, device_count=4) == [
        "0",
        "1",
        "2",
    ]
    assert select(1, spark_driver_gpus=None, cuda_visible_devices="", device_count=1) == ["0"]


def test_local_gpus_errors_say_what_to_do() -> None:
    with pytest.raises(ResourceError, match="use_gpu=False") as info:
        planning.select_local_gpus(
            1, spark_driver_gpus=None, cuda_visible_devices=None, device_count=0
        )
    assert info.value.argument == "use_gpu"
    with pytest.raises(ResourceError, match="need 3 GPUs but CUDA_VISIBLE_DEVICES has 2") as info:
        planning.select_local_gpus(
            3, spark_driver_gpus=None, cuda_visible_devices="0,1", device_count=8
        )
    assert info.value.argument == "num_processes"


def test_spark_gpu_addresses_index_into_a_preset_cuda_visible_devices() -> None:
    assert run_plan.visible_gpus(["0", "1"], "3,4,5") == ["3", "4"]
    assert run_plan.visible_gpus(["2", "0"], " 3, 4 ,5") == ["5", "3"]
    assert run_plan.visible_gpus(["0", "1"], None) == ["0", "1"]
    assert run_plan.visible_gpus(["GPU-1f2e"], "") == ["GPU-1f2e"]
    for address in ("3", "GPU-1f2e", "-1"):
        with pytest.raises(ResourceError, match="not an index into CUDA_VISIBLE_DEVICES") as info:
            run_plan.visible_gpus([address], "3,4,5")
        assert info.value.argument == "use_gpu"


def test_slot_check() -> None:
    planning.check_slots(2, 2, waited=False)
    with pytest.raises(
        ResourceError, match="needs 6 barrier task slots at once but the cluster has 2"
    ) as info:
        planning.check_slots(6, 2, waited=False)
    assert "start_timeout" in str(info.value)
    assert info.value.argument == "num_processes"
