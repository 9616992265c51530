"""What runs inside each Spark barrier task: one node's torchrun agent.

Task 0 hosts the rendezvous store on a port it binds itself (port 0: no bind-and-release race
with other jobs on the host) and keeps it for the whole run; every task learns the port from the
driver, to which task 0 reports it over the channel. Each task then starts its agent with the
task's GPUs, forwards the agent's output, and stops the agent's whole process tree when the
driver closes the channel (cancel, timeout, a failed rank elsewhere, or a dead driver).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from sparktorch_ops import channel, netif
from sparktorch_ops.data import (
    DATA_DIR_ENV,
    EPOCH_ROWS_ENV,
    SCHEMA_FILE_ENV,
    ShardFile,
    shard_name,
    write_schema_file,
    write_shards,
)
from sparktorch_ops.messages import (
    DATA,
    RDZV,
    STDERR,
    STDOUT,
    DataLayout,
    ExitReport,
    Hello,
    RendezvousPort,
    ShardSizes,
)
from sparktorch_ops.payload import Payload, write_rank_payload
from sparktorch_ops.planning import RUN_ID_ENV, RunPlan
from sparktorch_ops.process import AgentProcess, marked_processes, terminate_processes

_STORE_HOLD_S = 60.0
RETRIED_STAGE = "Spark retried the barrier stage after a failure; sparktorch_ops refuses retries"


def _host_rendezvous_store(host: str) -> tuple[Any, int]:
    """A TCPStore server on a port the OS picks, kept open by this process."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    return store, int(store.port)


@dataclass(frozen=True)
class TaskReport:
    """What one barrier task hands back to the driver through ``collect()``.

    Attributes:
        node: the task's partition (its node index).
        host: the task's host.
        exit_code: its agent's exit code (None when the agent never ran or was stopped).
        error: why the task could not run its agent, if so.
    """

    node: int
    host: str
    exit_code: int | None
    error: str | None = None


@dataclass(frozen=True)
class BarrierTask:
    """The function Spark runs in every barrier task (picklable: the plan, payload, secret).

    The secret reaches the executor inside the task itself (which Spark encrypts when its
    encryption is on) and the ranks through a private file, never an environment variable.
    With DataFrame input (``data_schema``: the Spark schema as JSON) the task's input is its
    partition as Arrow record batches: it writes one shard per rank, reports their sizes and
    learns the rows per epoch from the driver before the agent starts.
    """

    plan: RunPlan
    secret: str = field(repr=False)
    payload: Payload = field(repr=False)
    data_schema: str | None = None

    def __call__(self, partition: Iterable[Any]) -> Iterator[TaskReport]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        node = ctx.partitionId()
        if ctx.attemptNumber() > 0:
            yield TaskReport(node, "", None, RETRIED_STAGE)
            return
        hosts = [channel.split_address(info.address)[0] for info in ctx.getTaskInfos()]
        node_plan = self.plan.nodes[node]
        gpus = (
            list(ctx.resources()["gpu"].addresses)
            if node_plan.cuda_visible_devices is not None
            else None
        )
        client = channel.ChannelClient.connect(
            self.plan.channel_address,
            self.secret,
            Hello(role="node", node=node, host=hosts[node], attempt=0, pid=os.getpid()),
            fingerprint=self.plan.channel_fingerprint,
        )
        workdir = tempfile.mkdtemp(prefix=f"{self.plan.run_id}-node{node}-")
        store = None
        try:
            data_env: dict[str, str] = {}
            if self.data_schema is not None:
                shards = _write_shards(partition, workdir, len(node_plan.ranks))
                client.send_message(ShardSizes(rows=[shard.rows for shard in shards]))
                data_env = shard_env(workdir, self.data_schema, shards)
            # The port goes through the driver, which every task already talks to: Spark's
            # allGather() would cost about a second.
            if node == 0:
                try:
                    store, port = _host_rendezvous_store(hosts[0])
                except Exception as exc:
                    error = f"cannot host the rendezvous store on {hosts[0]}: {exc}"
                    client.send_message(RendezvousPort(error=error))
                    yield TaskReport(node, hosts[node], None, error)
                    return
                client.send_message(RendezvousPort(port=port))
            wanted = {RDZV} if node != 0 else set()
            if self.data_schema is not None:
                wanted.add(DATA)
            while wanted:
                kind, payload = client.recv_frame()
                if kind == RDZV:
                    port_message = RendezvousPort.decode(payload)
                    if port_message.port is None:
                        raise channel.ChannelError(f"no rendezvous store: {port_message.error}")
                    port = port_message.port
                elif kind == DATA:
                    layout = DataLayout.decode(payload)
                    if layout.epoch_rows is None:
                        raise channel.ChannelError(f"no data layout: {layout.error}")
                    data_env[EPOCH_ROWS_ENV] = str(layout.epoch_rows)
                else:
                    raise channel.ChannelError(f"expected the run's layout, got frame {kind}")
                wanted.discard(kind)
            endpoint = channel.join_address(hosts[0], port)
            code = self._run_agent(client, node, hosts[node], endpoint, gpus, workdir, data_env)
            yield TaskReport(node, hosts[node], code)
        except channel.ChannelError as exc:  # the driver stopped the run before it started
            yield TaskReport(node, hosts[node], None, str(exc))
        finally:
            client.close()
            del store
            shutil.rmtree(workdir, ignore_errors=True)

    def _run_agent(
        self,
        client: channel.ChannelClient,
        node: int,
        host: str,
        endpoint: str,
        gpus: list[str] | None,
        workdir: str,
        data_env: dict[str, str],
    ) -> int | None:
        plan = self.plan
        agent_plan = plan.nodes[node].bind(
            os.environ,
            run_id=plan.run_id,
            channel=plan.channel_address,
            fingerprint=plan.channel_fingerprint,
            payload_path=write_rank_payload(self.payload, workdir, in_place=False),
            secret_path=channel.write_secret_file(workdir, self.secret),
            launcher_pid=os.getpid(),
            host=host,
            rdzv_endpoint=endpoint,
            gpus=gpus,
        )
        # Ranks talk over the interface Spark reaches this host on (unless the user chose).
        env = {**agent_plan.env, **netif.node_socket_env(host, agent_plan.env), **data_env}
        agent = AgentProcess(
            agent_plan.argv,
            env,
            workdir,
            on_stdout=_forward(client, STDOUT),
            on_stderr=_forward(client, STDERR),
        )
        # The driver closes the channel when the run is over or must stop.
        watcher = threading.Thread(target=client.wait_closed, daemon=True)
        watcher.start()
        while agent.poll() is None and watcher.is_alive():
            time.sleep(0.1)
        if agent.poll() is None:
            agent.terminate(grace=3.0)
            terminate_processes(marked_processes(RUN_ID_ENV, plan.run_id), grace=1.0)
            return agent.poll()
        agent.finish_output()
        code = agent.poll()
        try:
            client.send_message(ExitReport(exit_code=code, time=time.time()))
        except channel.ChannelError:
            return code
        if node == 0:
            # This task's process hosts the rendezvous store: keep it until the driver has
            # heard from every agent (it then closes the channel), so no agent loses the
            # store while it is still shutting down.
            watcher.join(_STORE_HOLD_S)
        return code


def _write_shards(partition: Iterable[Any], workdir: str, ranks: int) -> list[ShardFile]:
    """The task's partition (Arrow record batches) as one shard file per rank of the task."""
    batches = iter(partition)
    first = next(batches, None)
    if first is None:  # an empty partition: schema-only shards (the driver then refuses)
        return [ShardFile(os.path.join(workdir, shard_name(r)), 0) for r in range(ranks)]
    directory = os.path.join(workdir, "data")
    os.makedirs(directory, exist_ok=True)
    return write_shards(itertools.chain([first], batches), first.schema, directory, ranks)


def shard_env(workdir: str, schema_json: str, shards: list[ShardFile]) -> dict[str, str]:
    """What the ranks of a node need to find their shard (the worker picks its own by
    ``LOCAL_RANK``), before the rows per epoch are known."""
    directory = os.path.dirname(shards[0].path)
    return {
        DATA_DIR_ENV: directory,
        SCHEMA_FILE_ENV: write_schema_file(schema_json, workdir),
    }


def data_task_reports(task: BarrierTask) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """``task`` as a ``mapInArrow`` function: Arrow batches in, its reports out as batches."""

    def run(batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for report in task(batches):
            yield pa.RecordBatch.from_pylist([asdict(report)], schema=_report_schema())

    return run


def _report_schema() -> Any:
    """The Arrow schema of a :class:`TaskReport` row (:data:`REPORT_DDL`)."""
    import pyarrow as pa

    fields = [("node", pa.int32()), ("host", pa.string())]
    return pa.schema([*fields, ("exit_code", pa.int32()), ("error", pa.string())])


REPORT_DDL = "node int, host string, exit_code int, error string"


def _forward(client: channel.ChannelClient, kind: int) -> Any:
    def emit(lines: list[str]) -> None:
        try:
            client.send(kind, "\n".join(lines).encode("utf-8", errors="replace"))
        except channel.ChannelError:
            pass  # the watcher sees the closed channel and stops the agent

    return emit
