"""Barrier mode on a shared local[2] session."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from harness.procs import ENV_CONTRACT
from sparktorch_ops import ResourceError, TorchDistributor, TrainingFailedError
from sparktorch_ops.wire.env import CHANNEL_ENV

ENV_KEYS = ENV_CONTRACT


def gather_env(tag: str, *, delay_rank: int = 1) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {key: os.environ.get(key) for key in ENV_KEYS}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == delay_rank:
        time.sleep(1.5)
    return {"tag": tag, "rank": rank, "envs": everyone}


def test_barrier_env_contract_and_rank0_value(spark: Any) -> None:
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).launch(
        gather_env, "b1", delay_rank=1
    )
    assert result.value["tag"] == "b1" and result.value["rank"] == 0
    envs = result.value["envs"]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["LOCAL_RANK"] for e in envs} == {"0"}  # one rank per task
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"1"}
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}  # spark.task.cpus
    assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "1"]
    assert result.mode == "barrier" and result.app_id == spark.sparkContext.applicationId
    assert result.ui_url and result.ui_url.startswith("http")


def exit_3_on_rank1() -> str:
    if os.environ["RANK"] == "1":
        print("rank 1 gives up", flush=True)
        os._exit(3)
    time.sleep(0.5)
    return "rank 0 done"


def test_rank_exiting_3_fails_fast_even_though_rank0_succeeds(spark: Any) -> None:
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).run(
            exit_3_on_rank1
        )
    elapsed = time.monotonic() - started
    first = info.value.first_failure
    assert first is not None and first.rank == 1 and first.exit_code == 3
    assert "rank 1 gives up" in first.output_tail
    assert elapsed < 120, "must not wait out torchrun's 300 s exit barrier"


def test_too_few_slots_fail_before_launch_within_seconds(spark: Any) -> None:
    started = time.monotonic()
    with pytest.raises(
        ResourceError, match="needs 3 barrier task slots at once but the cluster has 2"
    ) as info:
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=False, spark=spark).run(print)
    assert info.value.argument == "num_processes"
    assert time.monotonic() - started < 30


def test_use_gpu_without_task_gpu_amount_is_a_resource_error(spark: Any) -> None:
    with pytest.raises(ResourceError, match="use_gpu=False"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True, spark=spark).run(print)


def world_and_port() -> tuple[int, str]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    port = os.environ["MASTER_PORT"]
    dist.destroy_process_group()
    return dist.is_available() and int(os.environ["WORLD_SIZE"]), port


def test_concurrent_local_runs_do_not_collide() -> None:
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
                world_and_port
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]
    assert {value[0] for value in results.values()} == {2}
    assert len({value[1] for value in results.values()}) == 4  # four distinct rendezvous ports


def quarter_gib_bytes() -> bytes | None:
    if int(os.environ["RANK"]) != 0:
        return None
    return bytes(range(256)) * (1 << 20)  # 256 MiB


@pytest.mark.large_transfer  # the one test at this size; the others send ~40 MiB
def test_a_256_mib_value_from_an_executor_arrives_whole(spark: Any) -> None:
    value = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False, spark=spark).run(
        quarter_gib_bytes
    )
    assert isinstance(value, bytes) and len(value) == 256 << 20
    assert value[:256] == bytes(range(256)) and value[-256:] == bytes(range(256))


def _world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def test_the_dry_run_plans_what_the_run_does(spark: Any) -> None:
    """``plan()`` and the run plan from the same facts: the same plan but for what only a
    launch learns (the run's id and its channel's address)."""
    import json

    planned: list[dict[str, Any]] = []
    distributor = TorchDistributor(
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        spark=spark,
        on_event=lambda event: (
            planned.append(event.detail["plan"]) if event.name == "planned" else None
        ),
    )
    dry = distributor.plan(_world_size).to_dict()
    assert distributor.run(_world_size) == 2
    [ran] = planned

    def known(plan: dict[str, Any]) -> str:
        plan = json.loads(json.dumps(plan))
        address = plan.pop("channel_address")
        for node in plan["nodes"]:
            assert node["env"][CHANNEL_ENV] == address
            node["env"][CHANNEL_ENV] = "<channel>"
        return json.dumps(plan, sort_keys=True).replace(plan["run_id"], "<run_id>")

    assert ran["channel_address"] != dry["channel_address"] == "<unknown>"
    assert known(ran) == known(dry)
