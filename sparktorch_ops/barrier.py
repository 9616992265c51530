"""What runs inside each Spark barrier task: one node's torchrun agent.

Task 0 hosts the rendezvous store on a port it binds itself (port 0: no bind-and-release race
with other jobs on the host) and keeps it for the whole run; every task learns the port from the
driver, to which task 0 reports it over the channel. Each task then starts its agent with the
task's GPUs, forwards the agent's output, and stops the agent's whole process tree when the
driver closes the channel (cancel, timeout, a failed rank elsewhere, or a dead driver).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sparktorch_ops import channel
from sparktorch_ops.agent import LAUNCHER_PID_ENV
from sparktorch_ops.payload import Payload, write_rank_payload
from sparktorch_ops.planning import RUN_ID_ENV, agent_argv, agent_env
from sparktorch_ops.process import AgentProcess, marked_processes, terminate_processes

_STORE_HOLD_S = 60.0
RETRIED_STAGE = "Spark retried the barrier stage after a failure; sparktorch_ops refuses retries"


def _host_rendezvous_store(host: str) -> tuple[Any, int]:
    """A TCPStore server on a port the OS picks, kept open by this process."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    return store, int(store.port)


@dataclass(frozen=True)
class BarrierTask:
    """The function Spark runs in every barrier task (picklable, holds the whole plan)."""

    run_id: str
    channel_address: str
    token: str
    payload: Payload
    num_tasks: int
    ranks_per_task: int
    max_restarts: int
    omp_threads: int
    use_gpu: bool
    join_timeout: float | None
    torchrun_args: tuple[str, ...] = ()
    user_env: dict[str, str] = field(default_factory=dict)

    def __call__(self, _: Iterable[Any]) -> Iterator[dict[str, Any]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        node = ctx.partitionId()
        if ctx.attemptNumber() > 0:
            yield {"node": node, "host": "", "exit_code": None, "error": RETRIED_STAGE}
            return
        hosts = [channel.split_address(info.address)[0] for info in ctx.getTaskInfos()]
        gpus = list(ctx.resources()["gpu"].addresses) if self.use_gpu else None
        client = channel.ChannelClient.connect(
            self.channel_address,
            self.token,
            {"role": "node", "node": node, "host": hosts[node], "attempt": 0, "pid": os.getpid()},
        )
        store = None
        try:
            # The port goes through the driver, which every task already talks to: Spark's
            # allGather() would cost about a second.
            if node == 0:
                try:
                    store, port = _host_rendezvous_store(hosts[0])
                except Exception as exc:
                    error = f"cannot host the rendezvous store on {hosts[0]}: {exc}"
                    client.send_json(channel.RDZV, {"error": error})
                    yield {"node": node, "host": hosts[node], "exit_code": None, "error": error}
                    return
                client.send_json(channel.RDZV, {"port": port})
            else:
                kind, payload = client.recv_frame()
                if kind != channel.RDZV:
                    raise channel.ChannelError(f"expected the rendezvous port, got frame {kind}")
                port = int(json.loads(payload)["port"])
            endpoint = channel.join_address(hosts[0], port)
            code = self._run_agent(client, node, hosts[node], endpoint, gpus)
            yield {"node": node, "host": hosts[node], "exit_code": code, "error": None}
        except channel.ChannelError as exc:  # the driver stopped the run before it started
            yield {"node": node, "host": hosts[node], "exit_code": None, "error": str(exc)}
        finally:
            client.close()
            del store

    def _run_agent(
        self,
        client: channel.ChannelClient,
        node: int,
        host: str,
        endpoint: str,
        gpus: list[str] | None,
    ) -> int | None:
        workdir = tempfile.mkdtemp(prefix=f"{self.run_id}-node{node}-")
        try:
            env = agent_env(
                os.environ,
                self.user_env,
                run_id=self.run_id,
                channel=self.channel_address,
                token=self.token,
                payload_path=write_rank_payload(self.payload, workdir, in_place=False),
                host=host,
                omp_threads=self.omp_threads,
                cuda_visible_devices=",".join(gpus) if gpus is not None else None,
            )
            env[LAUNCHER_PID_ENV] = str(os.getpid())
            argv = agent_argv(
                python=sys.executable,
                run_id=self.run_id,
                nnodes=self.num_tasks,
                nproc_per_node=self.ranks_per_task,
                rdzv_endpoint=endpoint,
                local_addr=host,
                max_restarts=self.max_restarts,
                is_rdzv_host=False,
                join_timeout=self.join_timeout,
                extra_args=self.torchrun_args,
            )
            agent = AgentProcess(
                argv,
                env,
                workdir,
                on_stdout=_forward(client, channel.STDOUT),
                on_stderr=_forward(client, channel.STDERR),
            )
            # The driver closes the channel when the run is over or must stop.
            watcher = threading.Thread(target=client.wait_closed, daemon=True)
            watcher.start()
            while agent.poll() is None and watcher.is_alive():
                time.sleep(0.1)
            if agent.poll() is None:
                agent.terminate(grace=3.0)
                terminate_processes(marked_processes(RUN_ID_ENV, self.run_id), grace=1.0)
                return agent.poll()
            agent.finish_output()
            code = agent.poll()
            try:
                client.send_json(channel.EXIT, {"exit_code": code, "time": time.time()})
            except channel.ChannelError:
                return code
            if node == 0:
                # This task's process hosts the rendezvous store: keep it until the driver has
                # heard from every agent (it then closes the channel), so no agent loses the
                # store while it is still shutting down.
                watcher.join(_STORE_HOLD_S)
            return code
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def _forward(client: channel.ChannelClient, kind: int) -> Any:
    def emit(lines: list[str]) -> None:
        try:
            client.send(kind, "\n".join(lines).encode("utf-8", errors="replace"))
        except channel.ChannelError:
            pass  # the watcher sees the closed channel and stops the agent

    return emit
