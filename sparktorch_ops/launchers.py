"""The two ways a run's agents start: on the driver, or in Spark barrier tasks.

Both expose the same small surface to the run loop in :mod:`sparktorch_ops.distributor`:
``poll()`` (None while running, else the overall exit status and a note) and ``teardown()``
(idempotent: stop everything of the run).
"""

from __future__ import annotations

import contextvars
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from sparktorch_ops import spark as spark_support
from sparktorch_ops.agent import LAUNCHER_PID_ENV
from sparktorch_ops.barrier import BarrierTask
from sparktorch_ops.collector import RunCollector
from sparktorch_ops.payload import Payload, write_rank_payload
from sparktorch_ops.planning import (
    RUN_ID_ENV,
    BarrierLayout,
    agent_argv,
    agent_env,
    barrier_omp_threads,
    local_omp_threads,
)
from sparktorch_ops.process import AgentProcess, marked_processes, terminate_processes
from sparktorch_ops.spec import LaunchSpec

if TYPE_CHECKING:
    from pyspark import SparkContext


class LocalLauncher:
    """One torchrun agent on the driver, with N ranks."""

    def __init__(
        self,
        spec: LaunchSpec,
        run_id: str,
        payload: Payload,
        channel_address: str,
        token: str,
        collector: RunCollector,
        gpus: list[str] | None,
    ) -> None:
        self._run_id = run_id
        self._workdir = tempfile.mkdtemp(prefix=f"{run_id}-")
        host = socket.gethostname()
        env = agent_env(
            os.environ,
            spec.env,
            run_id=run_id,
            channel=channel_address,
            token=token,
            payload_path=write_rank_payload(payload, self._workdir, in_place=True),
            host=host,
            omp_threads=local_omp_threads(os.cpu_count(), spec.num_processes),
            cuda_visible_devices=",".join(gpus) if gpus is not None else None,
        )
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        argv = agent_argv(
            python=sys.executable,
            run_id=run_id,
            nnodes=1,
            nproc_per_node=spec.num_processes,
            rdzv_endpoint="127.0.0.1:0",
            local_addr="127.0.0.1",
            max_restarts=spec.max_restarts,
            is_rdzv_host=None,
            join_timeout=spec.start_timeout,
            extra_args=spec.torchrun_args,
        )
        self._agent = AgentProcess(
            argv,
            env,
            None,
            on_stdout=collector.agent_output(0, host, stderr=False),
            on_stderr=collector.agent_output(0, host, stderr=True),
        )

    def poll(self) -> tuple[int, str] | None:
        code = self._agent.poll()
        if code is None:
            return None
        self._agent.finish_output()
        return code, "" if code == 0 else f"torchrun exited with code {code}"

    def finish(self) -> None:
        """After the run, however it ended: no straggler, no work directory."""
        self.teardown()

    def teardown(self) -> None:
        self._agent.terminate(grace=3.0)
        terminate_processes(marked_processes(RUN_ID_ENV, self._run_id), grace=1.0)
        shutil.rmtree(self._workdir, ignore_errors=True)


class BarrierLauncher:
    """One Spark barrier stage; each task runs one agent (see :mod:`sparktorch_ops.barrier`)."""

    def __init__(
        self,
        spec: LaunchSpec,
        run_id: str,
        payload: Payload,
        channel_address: str,
        token: str,
        sc: SparkContext,
        layout: BarrierLayout,
    ) -> None:
        self._sc = sc
        self._tag = run_id
        self._records: list[dict[str, Any]] | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        task = BarrierTask(
            run_id=run_id,
            channel_address=channel_address,
            token=token,
            payload=payload,
            num_tasks=layout.num_tasks,
            ranks_per_task=layout.ranks_per_task,
            max_restarts=spec.max_restarts,
            omp_threads=barrier_omp_threads(spark_support.task_cpus(sc), layout.ranks_per_task),
            use_gpu=spec.use_gpu,
            join_timeout=spec.start_timeout,
            torchrun_args=spec.torchrun_args,
            user_env=dict(spec.env),
        )
        rdd = sc.parallelize(range(layout.num_tasks), layout.num_tasks).barrier()
        description = f"sparktorch_ops {run_id}: {spec.num_processes} ranks"
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run,
            args=(self._run_job, rdd, task, description),
            name=f"{run_id}-job",
            daemon=True,
        )
        self._thread.start()

    def _run_job(self, rdd: Any, task: BarrierTask, description: str) -> None:
        sc = self._sc
        try:
            sc.addJobTag(self._tag)
            sc.setInterruptOnCancel(True)
            sc.setLocalProperty("spark.job.description", description)
            self._records = rdd.mapPartitions(task).collect()
        except BaseException as exc:  # reported by poll()
            self._error = exc
        finally:
            try:
                sc.removeJobTag(self._tag)
            except Exception:
                pass
            self._done.set()

    def poll(self) -> tuple[int, str] | None:
        if not self._done.is_set():
            return None
        if self._error is not None:
            return 1, f"the Spark job failed: {_first_line(self._error)}"
        records = self._records or []
        notes = [f"task {r['node']}: {r['error']}" for r in records if r.get("error")]
        failed = [r for r in records if r.get("exit_code") != 0]
        if not failed:
            return 0, ""
        notes += [
            f"torchrun on task {r['node']} ({r['host']}) exited with code {r['exit_code']}"
            for r in failed
            if not r.get("error")
        ]
        return 1, "; ".join(notes)

    def teardown(self) -> None:
        if self._done.is_set():
            return
        try:
            self._sc.cancelJobsWithTag(self._tag)
        except Exception:  # the channel closing stops the tasks' agents all the same
            pass
        self._wait_stopped(5.0)

    def finish(self) -> None:
        """After the run, however it ended: wait (bounded) for the Spark job to be over."""
        self._wait_stopped(30.0)

    def _wait_stopped(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
