"""Test DAG: the operator's XCom summary, templating, result storage, logs, failure, timeout.

Every task is independent, so one ``dag.test()`` exercises them all (tests/airflow/test_operator.py).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any

import pendulum
from airflow.sdk import DAG

from sparktorch_ops.airflow import TorchDistributorOperator


def report_and_return(word: str, *, out_dir: str, tag: str) -> dict[str, Any]:
    """Each rank logs to stdout and stderr and reports metrics; rank 0's dict is the value."""
    from sparktorch_ops import report

    rank = int(os.environ["RANK"])
    print(f"training started on rank {rank}", flush=True)
    print(f"a note on stderr from rank {rank}", file=sys.stderr, flush=True)
    for step in range(3):
        report(step=step, progress=(step + 1) / 3, loss=1.0 / (step + 1))
    return {
        "rank": rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "word": word,
        "out_dir": out_dir,
        "tag": tag,
        "env_tag": os.environ.get("STO_TAG"),
    }


def return_non_json() -> dict[str, Any]:
    """A value XCom cannot hold as JSON."""
    return {"labels": {3, 1, 2}, "blob": b"\x00\x01binary", "rank": int(os.environ["RANK"])}


def fail_on_rank_one() -> str:
    """Rank 1 raises; rank 0 would succeed."""
    if int(os.environ["RANK"]) == 1:
        print("rank one is about to fail", flush=True)
        raise ValueError("rank one exploded on purpose")
    time.sleep(1)
    return "rank 0 is fine"


def killed_once(directory: str) -> str:
    """Rank 1 of the first attempt dies of a SIGKILL (as from the OOM killer); the next
    attempt of the same task try trains to the end."""
    import signal

    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, "killed")
    if os.environ["RANK"] == "1" and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return "trained after a lost rank"


def sleep_long() -> None:
    """Runs until something stops it."""
    print("training started, sleeping", flush=True)
    time.sleep(300)


with DAG(
    dag_id="sto_ops",
    schedule=None,
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    params={"n": 2, "word": "hello", "out": "/data/out"},
    default_args={"retries": 0},
) as dag:
    TorchDistributorOperator(
        task_id="summary",
        train=report_and_return,
        train_args=["{{ params.word }}-{{ ds_nodash }}"],
        train_kwargs={"out_dir": "{{ params.out }}/{{ ds }}", "tag": "{{ dag.dag_id }}"},
        num_processes="{{ params.n }}",
        env={"STO_TAG": "{{ task.task_id }}-{{ ds }}"},
        spark_conf={"spark.app.name": "{{ dag.dag_id }}"},
        use_gpu=False,
    )
    # No result_location: the default one, under AIRFLOW_HOME.
    TorchDistributorOperator(
        task_id="non_json",
        train=return_non_json,
        num_processes=1,
        use_gpu=False,
    )
    TorchDistributorOperator(
        task_id="fails",
        train=fail_on_rank_one,
        num_processes=2,
        use_gpu=False,
    )
    TorchDistributorOperator(
        task_id="attempts",
        train=killed_once,
        train_args=["/tmp/sto-ops-attempts/{{ run_id }}"],
        num_processes=2,
        use_gpu=False,
        max_failures=1,
    )
    TorchDistributorOperator(
        task_id="times_out",
        train=sleep_long,
        num_processes=2,
        use_gpu=False,
        execution_timeout=datetime.timedelta(seconds=8),
    )
