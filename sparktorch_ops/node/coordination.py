"""How a barrier task learns its run's layout: the rendezvous port and, with DataFrame input,
its shards and the rows per epoch, told by the driver or agreed among the tasks in the stage.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from typing import Any

from sparktorch_ops.data.shards import (
    ShardFile,
    epoch_rows_path,
    shard_name,
    write_epoch_rows,
    write_schema_file,
    write_shards,
)
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.env import DATA_DIR_ENV, EPOCH_ROWS_FILE_ENV, SCHEMA_FILE_ENV
from sparktorch_ops.wire.messages import (
    DATA,
    IN_STAGE,
    RDZV,
    DataLayout,
    RendezvousPort,
    ShardSizes,
)


def layout_from_driver(
    client: channel.ChannelClient,
    own: RendezvousPort | None,
    *,
    data: bool,
    coordinate_in_stage: bool,
) -> tuple[int, int | None] | None:
    """The rendezvous port (task 0 has its ``own``) and, with ``data`` (DataFrame input),
    the rows per epoch, from the driver; None when the driver says to agree in the stage
    instead (over Connect, where some task could not reach it)."""
    # Over Connect task 0 too waits for its port back: the driver's word that every task
    # reached it, so that none of them waits in the stage for this one.
    hears_port = own is None or own.port is None or coordinate_in_stage
    wanted = {RDZV} if hears_port else set()
    if data:
        wanted.add(DATA)
    port, epoch_rows = (own.port or 0) if own is not None else 0, None
    while wanted:
        kind, payload = client.recv_frame()
        if kind == IN_STAGE and coordinate_in_stage:
            return None
        if kind == RDZV:
            port_message = RendezvousPort.decode(payload)
            if port_message.port is None:
                raise channel.ChannelError(f"no rendezvous store: {port_message.error}")
            port = port_message.port
        elif kind == DATA:
            epoch_rows = _epoch_rows(DataLayout.decode(payload))
        else:
            raise channel.ChannelError(f"expected the run's layout, got frame {kind}")
        wanted.discard(kind)
    return port, epoch_rows


def feed_shards(
    client: channel.ChannelClient, partition: Iterable[Any], workdir: str, ranks: int
) -> None:
    """With the agent started: write the task's shards, report their sizes, and once the
    driver has every task's, hand the ranks the rows per epoch (the file they wait for)."""
    shards = write_task_shards(partition, workdir, ranks)
    client.send_message(ShardSizes(rows=[shard.rows for shard in shards]))
    kind, payload = client.recv_frame()
    while kind == RDZV:  # the driver tells every task the port, task 0 too
        kind, payload = client.recv_frame()
    if kind != DATA:
        raise channel.ChannelError(f"expected the data layout, got frame {kind}")
    write_epoch_rows(os.path.join(workdir, "data"), _epoch_rows(DataLayout.decode(payload)))


def _epoch_rows(layout: DataLayout) -> int:
    if layout.epoch_rows is None:
        raise channel.ChannelError(f"no data layout: {layout.error}")
    return layout.epoch_rows


def agree_in_stage(
    ctx: Any,
    own: RendezvousPort | None,
    shard_rows: list[int] | None,
    relays: bool,
    data: bool,
) -> tuple[int, int | None, bool]:
    """The rendezvous port, rows per epoch and whether any task relays, agreed by the
    tasks themselves: one ``allGather`` of task 0's port and every task's shard sizes."""
    mine = {
        "port": own.port if own is not None else None,
        "error": own.error if own is not None else None,
        "rows": shard_rows,
        "relays": relays,
    }
    gathered = [json.loads(message) for message in ctx.allGather(json.dumps(mine))]
    first = gathered[0]
    if first["port"] is None:
        raise channel.ChannelError(f"no rendezvous store: {first['error']}")
    anyone_relays = any(g["relays"] for g in gathered)
    if not data:
        return int(first["port"]), None, anyone_relays
    layout = DataLayout.for_shards({n: g["rows"] for n, g in enumerate(gathered)})
    return int(first["port"]), _epoch_rows(layout), anyone_relays


def write_task_shards(partition: Iterable[Any], workdir: str, ranks: int) -> list[ShardFile]:
    """The task's partition (Arrow record batches) as one shard file per rank of the task."""
    batches = iter(partition)
    first = next(batches, None)
    if first is None:  # an empty partition: schema-only shards (the driver then refuses)
        return [ShardFile(os.path.join(workdir, shard_name(r)), 0) for r in range(ranks)]
    directory = os.path.join(workdir, "data")
    os.makedirs(directory, exist_ok=True)
    return write_shards(itertools.chain([first], batches), first.schema, directory, ranks)


def shard_env(workdir: str, schema_json: str, streamed: bool) -> dict[str, str]:
    """What the ranks of a node need to find their shard (the worker picks its own by
    ``LOCAL_RANK``) and, when the shards are written while they start (``streamed``), to wait
    for the rows per epoch (:func:`~sparktorch_ops.data.shards.wait_for_epoch_rows`)."""
    directory = os.path.join(workdir, "data")
    os.makedirs(directory, exist_ok=True)
    env = {DATA_DIR_ENV: directory, SCHEMA_FILE_ENV: write_schema_file(schema_json, workdir)}
    if streamed:
        env[EPOCH_ROWS_FILE_ENV] = epoch_rows_path(directory)
    return env
