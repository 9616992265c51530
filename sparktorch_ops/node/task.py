"""What runs inside each Spark barrier task: one node's torchrun agent.

Task 0 hosts the rendezvous store on a port it binds itself (port 0: no bind-and-release race
with other jobs on the host) and keeps it for the whole run, in a child of its warm process (so
the task's Python never imports torch: the warm process's import is the node's only one); every
task learns the port from the driver, to which task 0 reports it over the channel. Each task
first checks that its Python has torch, then starts its agent with the task's GPUs, forwards the
agent's output, and stops the agent's whole process tree when the driver closes the channel
(cancel, timeout, a failed rank elsewhere, or a dead driver).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from sparktorch_ops.node import coordination, netif, package
from sparktorch_ops.node.prefork import (
    HostedStore,
    TorchImportError,
    after_run,
    host_store,
    prestart,
    start_agent,
    stop_run,
)
from sparktorch_ops.node.relay import Relay, RelayedFrame
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.env import EPOCH_ROWS_ENV
from sparktorch_ops.wire.messages import (
    STDERR,
    STDOUT,
    Arrived,
    ExitReport,
    Hello,
    RendezvousPort,
    ShardSizes,
    UnusablePython,
)
from sparktorch_ops.wire.payload import Payload, write_rank_payload
from sparktorch_ops.wire.plan import RunPlan, visible_gpus

_STORE_HOLD_S = 60.0
#: How long a task that coordinates in the stage tries to reach the driver's channel before
#: it relays its ranks' frames instead.
REACH_TIMEOUT_S = 5.0
RETRIED_STAGE = "Spark retried the barrier stage after a failure; sparktorch_ops refuses retries"


class StopSignal:
    """The tasks' own way to stop each other's agents when the driver may not hear of a
    failure until the stage ends (coordinating in the stage): a key in the rendezvous store
    that task 0 hosts. A task whose agent failed sets it; every task polls it."""

    def __init__(self, store: Any, host: str, port: int, run_id: str) -> None:
        if store is None:  # not task 0: a client of task 0's store
            from torch.distributed import TCPStore

            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self._store = store
        self._key = f"sparktorch_ops/{run_id}/stop"
        self._next_check = 0.0

    def set(self, node: int) -> None:
        """Tell every task to stop its agent (best effort: the store may be gone)."""
        try:
            self._store.set(self._key, str(node))
        except Exception:
            pass

    def is_set(self) -> bool:
        """Whether some task said stop (asked of the store at most twice a second)."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + 0.5
        try:
            return bool(self._store.check([self._key]))
        except Exception:
            return False


@dataclass(frozen=True)
class TaskReport:
    """What one barrier task hands back to the driver through ``collect()``.

    Attributes:
        node: the task's partition (its node index).
        host: the task's host.
        exit_code: its agent's exit code (None when the agent never ran or was stopped).
        error: why the task could not run its agent, if so.
        unreachable: why the task could not reach the driver's channel, when it relayed its
            ranks' frames with its result instead (:mod:`sparktorch_ops.node.relay`).
    """

    node: int
    host: str
    exit_code: int | None
    error: str | None = None
    unreachable: str | None = None


@dataclass(frozen=True)
class BarrierTask:
    """The function Spark runs in every barrier task (picklable: the plan, payload, secret).

    The secret reaches the executor inside the task itself (which Spark encrypts when its
    encryption is on) and the ranks through a private file, never an environment variable.
    With DataFrame input (``data_schema``: the Spark schema as JSON) the task's input is its
    partition as Arrow record batches: it writes one shard per rank, reports their sizes and
    learns the rows per epoch before the agent starts.

    The tasks of a classic session learn the rendezvous port and the data layout from the
    driver, which holds the store until it has heard every agent exit. With
    ``coordinate_in_stage`` (Spark Connect, whose client the executors may not reach) a task
    that reached the driver says so (``Arrived``) and learns both from the driver as well once
    every task has; else, as told by the driver, the tasks agree on both among themselves
    (one ``allGather``, which costs Spark's one-second poll). A task that cannot reach the
    driver's channel within :data:`REACH_TIMEOUT_S` serves its ranks with a
    :class:`~sparktorch_ops.node.relay.Relay` and yields the recorded frames after its report. When
    any task relays, the tasks also stop each other's agents (:class:`StopSignal`) and wait for
    each other at a final ``barrier()`` instead of the driver.
    """

    plan: RunPlan
    secret: str = field(repr=False)
    payload: Payload = field(repr=False)
    data_schema: str | None = None
    coordinate_in_stage: bool = False

    def __call__(self, partition: Iterable[Any]) -> Iterator[TaskReport | RelayedFrame]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        node = ctx.partitionId()
        if ctx.attemptNumber() > 0:
            yield TaskReport(node, "", None, RETRIED_STAGE)
            return
        workdir = tempfile.mkdtemp(prefix=f"{self.plan.run_id}-node{node}-")
        try:
            report, relay = self._run_node(ctx, node, partition, workdir)
            yield report
            if relay is not None:
                yield from relay.frames()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _connect(
        self, hello: Hello, workdir: str
    ) -> tuple[channel.ChannelClient, Relay | None, str | None]:
        """The node's connection: to the driver, else (when coordinating in the stage) to a
        relay of its own, with the reason the driver was out of reach."""
        plan = self.plan
        connect = functools.partial(
            channel.ChannelClient.connect,
            plan.channel_address,
            self.secret,
            hello,
            fingerprint=plan.channel_fingerprint,
        )
        if not self.coordinate_in_stage:
            return connect(), None, None
        try:
            return connect(timeout=REACH_TIMEOUT_S), None, None
        except channel.ChannelError as exc:
            relay = Relay(self.secret, os.path.join(workdir, "relay.frames"))
            return channel.ChannelClient.connect(relay.address, self.secret, hello), relay, str(exc)

    def _run_node(
        self, ctx: Any, node: int, partition: Iterable[Any], workdir: str
    ) -> tuple[TaskReport, Relay | None]:
        hosts = [channel.split_address(info.address)[0] for info in ctx.getTaskInfos()]
        node_plan = self.plan.nodes[node]
        gpus = (
            visible_gpus(ctx.resources()["gpu"].addresses, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if node_plan.cuda_visible_devices is not None
            else None
        )
        hello = Hello(role="node", node=node, host=hosts[node], attempt=0, pid=os.getpid())
        # The executor's Python is checked here, in the run's own stage, rather than by a job
        # before it: the warm process's torch import (which a broken torch fails) is then the
        # only one on a fresh worker's critical path, and it overlaps the channel and the
        # tasks' agreement.
        unusable = None if importlib.util.find_spec("torch") else "No module named 'torch'"
        argv, env = self._agent_command(node, hosts[node], hosts[0], gpus, os.devnull, os.devnull)
        if unusable is None:
            prestart(argv, env)
        client, relay, unreachable = self._connect(hello, workdir)
        store = None
        try:
            if unusable is not None:
                return self._unusable(client, relay, node, hosts[node], unusable), relay
            if self.coordinate_in_stage and relay is None:
                client.send_message(Arrived(node=node))
            data_env: dict[str, str] = {}
            shard_rows: list[int] | None = None
            # Told the layout by the driver, the task starts its agent first and writes the
            # shards while the agent and its ranks start (they wait for the rows per epoch);
            # tasks that agree among themselves write first (they share the sizes then).
            streamed = self.data_schema is not None and not self.coordinate_in_stage
            feed: Callable[[], None] | None = None
            if streamed:
                assert self.data_schema is not None
                data_env = coordination.shard_env(workdir, self.data_schema, streamed=True)
                feed = functools.partial(
                    coordination.feed_shards, client, partition, workdir, len(node_plan.ranks)
                )
            elif self.data_schema is not None:
                shards = coordination.write_task_shards(partition, workdir, len(node_plan.ranks))
                shard_rows = [shard.rows for shard in shards]
                client.send_message(ShardSizes(rows=shard_rows))
                data_env = coordination.shard_env(workdir, self.data_schema, streamed=False)
            # The port goes through the driver, which every task already talks to: Spark's
            # allGather() would cost about a second (paid only when coordinating in the stage).
            port_message: RendezvousPort | None = None
            if node == 0:
                try:
                    store, port = host_store(argv, env, hosts[0])
                    port_message = RendezvousPort(port=port)
                except TorchImportError as exc:
                    return self._unusable(client, relay, node, hosts[node], str(exc)), relay
                except Exception as exc:
                    error = f"cannot host the rendezvous store on {hosts[0]}: {exc}"
                    port_message = RendezvousPort(error=error)
                client.send_message(port_message)
                if port_message.error is not None and not self.coordinate_in_stage:
                    return TaskReport(node, hosts[node], None, port_message.error), relay
            anyone_relays = False
            told = None
            if relay is None:
                told = coordination.layout_from_driver(
                    client,
                    port_message,
                    data=self.data_schema is not None and not streamed,
                    coordinate_in_stage=self.coordinate_in_stage,
                )
            if told is None:  # some task could not reach the driver: agree in the stage
                port, epoch_rows, anyone_relays = coordination.agree_in_stage(
                    ctx, port_message, shard_rows, relay is not None, self.data_schema is not None
                )
            else:
                port, epoch_rows = told
            if epoch_rows is not None:
                data_env[EPOCH_ROWS_ENV] = str(epoch_rows)
            endpoint = channel.join_address(hosts[0], port)
            # With every task live the driver stops the agents and holds the store, as on a
            # classic session; a relaying task needs the tasks to do both themselves.
            stop = None
            if anyone_relays:
                in_process = None if isinstance(store, HostedStore) else store
                stop = StopSignal(in_process, hosts[0], port, self.plan.run_id)
            try:
                code = self._run_agent(
                    client, node, hosts[node], endpoint, gpus, workdir, data_env, relay, stop, feed
                )
            except TorchImportError as exc:
                if stop is not None:
                    stop.set(node)
                return self._unusable(client, relay, node, hosts[node], str(exc)), relay
            if stop is not None:
                if code != 0:
                    stop.set(node)
                # Task 0's process hosts the rendezvous store: every task waits here until
                # every agent is done with it.
                ctx.barrier()
            return TaskReport(node, hosts[node], code, unreachable=unreachable), relay
        except channel.ChannelError as exc:  # the driver stopped the run before it started
            return TaskReport(node, hosts[node], None, str(exc), unreachable), relay

        finally:
            client.close()
            if isinstance(store, HostedStore):
                store.close()
            del store
            if relay is not None:
                relay.close()

    def _unusable(
        self,
        client: channel.ChannelClient,
        relay: Relay | None,
        node: int,
        host: str,
        reason: str,
    ) -> TaskReport:
        """This executor's Python cannot run the ranks: tell the driver (which fails the run
        with a ConfigError naming the interpreter) and end the task."""
        client.send_message(UnusablePython(executable=sys.executable, host=host, reason=reason))
        text = f"the executor's Python {sys.executable} cannot import torch: {reason}"
        if relay is not None:
            # The driver hears of it only once the stage is over: end the stage now.
            raise RuntimeError(text)
        return TaskReport(node, host, None, text)

    def _agent_command(
        self,
        node: int,
        host: str,
        endpoint: str,
        gpus: list[str] | None,
        payload_path: str,
        secret_path: str,
        relay: Relay | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """The node's agent argv and environment (the DataFrame input's variables aside)."""
        plan = self.plan
        agent_plan = plan.nodes[node].bind(
            os.environ,
            run_id=plan.run_id,
            channel=relay.address if relay is not None else plan.channel_address,
            fingerprint=plan.channel_fingerprint if relay is None else None,
            payload_path=payload_path,
            secret_path=secret_path,
            launcher_pid=os.getpid(),
            host=host,
            rdzv_endpoint=endpoint,
            gpus=gpus,
            package_root=package.runnable_root(),
            python=sys.executable,
        )
        # Ranks talk over the interface Spark reaches this host on (unless the user chose).
        env = {
            **agent_plan.env,
            **netif.node_socket_env(host, agent_plan.env),
            **package.shipped_env(agent_plan.env),
        }
        return list(agent_plan.argv), env

    def _run_agent(
        self,
        client: channel.ChannelClient,
        node: int,
        host: str,
        endpoint: str,
        gpus: list[str] | None,
        workdir: str,
        data_env: dict[str, str],
        relay: Relay | None,
        stop: StopSignal | None,
        feed: Callable[[], None] | None = None,
    ) -> int | None:
        plan = self.plan
        argv, env = self._agent_command(
            node,
            host,
            endpoint,
            gpus,
            write_rank_payload(self.payload, workdir, in_place=False),
            channel.write_secret_file(workdir, self.secret),
            relay,
        )
        agent = start_agent(
            argv,
            {**env, **data_env},
            workdir,
            on_stdout=_forward(client, STDOUT),
            on_stderr=_forward(client, STDERR),
        )
        if feed is not None:
            try:
                feed()
            except BaseException:
                stop_run(agent, plan.run_id, succeeded=False)
                raise
        # The driver closes the channel when the run is over or must stop.
        watcher = threading.Thread(target=client.wait_closed, daemon=True)
        watcher.start()
        while agent.poll() is None and watcher.is_alive():
            if stop is not None and stop.is_set():
                break
            time.sleep(0.1)
        if agent.poll() is None:
            stop_run(agent, plan.run_id, succeeded=False)
            return agent.poll()
        agent.finish_output()
        code = agent.poll()
        after_run(agent, succeeded=code == 0)
        try:
            client.send_message(ExitReport(exit_code=code, time=time.time()))
        except channel.ChannelError:
            return code
        if node == 0 and stop is None:
            # This task's process hosts the rendezvous store: keep it until the driver has
            # heard from every agent (it then closes the channel), so no agent loses the
            # store while it is still shutting down.
            watcher.join(_STORE_HOLD_S)
        return code


def stage_rows(task: BarrierTask) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """``task`` as a ``mapInArrow`` function: Arrow batches in, rows of :data:`STAGE_DDL`
    out: the task's report, then any relayed frames (a few MiB per batch)."""

    def run(batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        schema = _stage_schema()
        rows: list[dict[str, Any]] = []
        size, node = 0, -1
        batches = iter(batches)
        for item in task(batches):
            if isinstance(item, TaskReport):
                node = item.node
                rows.append(asdict(item))
            else:
                frame = {"peer": item.peer, "kind": item.kind, "frame": item.payload}
                rows.append({"node": node, "time": item.time, **frame})
                size += len(item.payload)
            if size >= _BATCH_BYTES or len(rows) >= _BATCH_ROWS:
                yield pa.RecordBatch.from_pylist(rows, schema=schema)
                rows, size = [], 0
        # Spark reuses a Python worker only once it has read the task's whole input; a run
        # without DataFrame input never reads its one row, and its workers would die with it
        # (each Connect run then paid fresh workers, and their torch import for the store).
        for _ in batches:
            pass
        if rows:
            yield pa.RecordBatch.from_pylist(rows, schema=schema)

    return run


_BATCH_BYTES = 4 << 20
_BATCH_ROWS = 1024
# The stage's columns with their Spark and Arrow types, for STAGE_DDL and the batches' schema.
_STAGE_COLUMNS = (
    ("node", "int"),
    ("host", "string"),
    ("exit_code", "int"),
    ("error", "string"),
    ("unreachable", "string"),
    ("peer", "int"),
    ("kind", "int"),
    ("frame", "binary"),
    ("time", "double"),
)


def _stage_schema() -> Any:
    """The Arrow schema of the stage's rows (:data:`STAGE_DDL`)."""
    import pyarrow as pa

    types = {
        "int": pa.int32(),
        "string": pa.string(),
        "binary": pa.binary(),
        "double": pa.float64(),
    }
    return pa.schema([(name, types[kind]) for name, kind in _STAGE_COLUMNS])


#: A task's report (``peer`` null) or one frame it relayed (``host``, ``exit_code``... null).
STAGE_DDL = ", ".join(f"{name} {kind}" for name, kind in _STAGE_COLUMNS)


def stage_row_item(row: dict[str, Any]) -> tuple[int, TaskReport | RelayedFrame]:
    """One row of the stage (:data:`STAGE_DDL`) as its task's node and what it holds: the
    task's report, or a frame it relayed."""
    if row["peer"] is None:
        report = TaskReport(
            row["node"], row["host"], row["exit_code"], row["error"], row["unreachable"]
        )
        return row["node"], report
    return row["node"], RelayedFrame(row["peer"], row["kind"], row["frame"], row["time"])


def _forward(client: channel.ChannelClient, kind: int) -> Any:
    def emit(lines: list[str]) -> None:
        try:
            client.send(kind, "\n".join(lines).encode("utf-8", errors="replace"))
        except channel.ChannelError:
            pass  # the watcher sees the closed channel and stops the agent

    return emit
