"""Barrier mode over Spark Connect, against a real Connect server on local[2].

Each behaviour runs twice where it matters: with the executors reaching this process's channel
(live logs and metrics) and with the channel advertised at an address they cannot reach
(``channel_host`` in TEST-NET-1), where every task relays its ranks' frames with its result.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.procs import wait_until_gone
from sparktorch_ops import (
    ConfigError,
    ResourceError,
    TorchDistributor,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingTimeoutError,
)
from tests.support.connect_server import ConnectServer
from tests.support.records import Collect

UNREACHABLE = "192.0.2.1"  # TEST-NET-1: no executor reaches it
REACH = {"live": None, "relayed": UNREACHABLE}
RELAYED_NOTE = "could not reach this client's channel"


@pytest.fixture(scope="module")
def connect(connect_server: ConnectServer) -> Iterator[Any]:
    """A Spark Connect session to the server (beside the classic session of other tests)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = ConnectSession.builder.remote(connect_server.url).getOrCreate()
    yield session
    if connect_server.process.poll() is None:
        session.stop()
    else:  # the module's last test killed the server: stop() would retry it for minutes
        session.client.close()


def ranks_on(connect: Any, reach: str, **options: Any) -> TorchDistributor:
    """Two barrier ranks over the Connect session, the channel reachable or not."""
    return TorchDistributor(
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        spark=connect,
        channel_host=REACH[reach],
        **options,
    )


def _logger(name: str) -> tuple[logging.Logger, Collect]:
    logger = logging.getLogger(f"tests.connect.{name}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    collect = Collect()
    logger.handlers = [collect]
    return logger, collect


def all_reduce_and_report(scale: int) -> float:
    import torch
    import torch.distributed as dist

    from sparktorch_ops import report

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    for step in range(3):
        report(step, loss=1.0 / (step + 1), rank_seen=float(dist.get_rank()))
    print(f"rank {dist.get_rank()} sees {total.item()}", flush=True)
    dist.destroy_process_group()
    return total.item() * scale


@pytest.mark.parametrize("reach", ["live", "relayed"])
def test_value_lines_and_metrics(connect: Any, reach: str) -> None:
    logger, collect = _logger(f"value-{reach}")
    result = ranks_on(connect, reach, logger=logger).launch(all_reduce_and_report, 10)
    assert result.value == 30.0
    assert result.exit_codes == {0: 0, 1: 0} and result.mode == "barrier"
    assert [(m.rank, m.step) for m in result.metrics if m.rank == 0] == [(0, 0), (0, 1), (0, 2)]
    assert {m.rank for m in result.metrics} == {0, 1}
    messages = collect.messages()
    assert any("rank 0 sees 3.0" in m for m in messages)
    assert any("rank 1 sees 3.0" in m for m in messages)
    assert result.app_id is not None and result.app_id.startswith("local-")
    notes = [m for m in messages if RELAYED_NOTE in m]
    if reach == "live":
        assert notes == []
    else:  # said once, with the reason and what to do
        assert len(notes) == 1 and "channel_host" in notes[0] and UNREACHABLE in notes[0]
        rank_lines = [r for r in collect.records if "sees 3.0" in r.getMessage()]
        assert all(r.levelno == logging.INFO for r in rank_lines)


def spark_python_worker() -> int:
    """The pid of the Spark Python worker whose task started this rank: the process below
    pyspark's daemon, which is the one below the server's JVM (read from /proc: the server's
    Python has no psutil)."""

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])

    chain = [parent(os.getpid())]
    while chain[-1] > 1:
        chain.append(parent(chain[-1]))
    names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in chain[:-1]]
    return chain[names.index("java") - 2]


def test_a_run_leaves_the_servers_python_workers_alive_for_the_next(connect: Any) -> None:
    # Spark reuses a Python worker only once its task read its whole input: a task that left
    # its input row unread had its worker killed, and every run paid fresh ones.
    first = ranks_on(connect, "live").run(spark_python_worker)
    assert psutil.pid_exists(first) and psutil.Process(first).status() != psutil.STATUS_ZOMBIE
    second = ranks_on(connect, "live").run(spark_python_worker)
    assert psutil.pid_exists(second)


def where_the_package_comes_from() -> dict[str, str]:
    import sparktorch_ops

    return {"package": sparktorch_ops.__file__, "python": sys.executable}


def test_ranks_import_the_clients_copy_over_a_broken_installed_one(
    connect: Any, connect_server: ConnectServer
) -> None:
    """The server's Python workers have a broken sparktorch_ops installed (the fixture): the
    run trains with the copy the client shipped as an artifact, on the executors' Python."""
    found = ranks_on(connect, "live").run(where_the_package_comes_from)
    assert found["python"] == connect_server.executor_python
    shipped = Path(found["package"]).parents[1]
    assert shipped.name.startswith("sparktorch_ops-") and "site-packages" not in str(shipped)
    here = Path(__file__).parents[2] / "sparktorch_ops" / "checkpoint" / "saving.py"
    assert (shipped / "sparktorch_ops" / "checkpoint" / "saving.py").read_bytes() == (
        here.read_bytes()
    )


def fail_on_rank_1() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot go on")
    time.sleep(1)
    return "rank 0 done"


@pytest.mark.parametrize("reach", ["live", "relayed"])
def test_a_failing_rank_is_named_with_its_traceback(connect: Any, reach: str) -> None:
    with pytest.raises(TrainingFailedError) as info:
        ranks_on(connect, reach).run(fail_on_rank_1)
    first = info.value.first_failure
    assert first is not None and first.rank == 1
    assert "ValueError: rank 1 cannot go on" in str(info.value)
    assert "Traceback (most recent call last)" in first.output_tail
    assert "fail_on_rank_1" in first.output_tail
    assert wait_until_gone(None, 30) == []


def sleep_long(marker_dir: str | None = None) -> None:
    print("sleeping", flush=True)
    if marker_dir is not None:  # the executors share this machine's file system
        Path(marker_dir, f"rank{os.environ['RANK']}").write_text("sleeping")
    time.sleep(600)


def when_both_sleep(marker_dir: Path, then: Any) -> None:
    """``then()`` from a thread once both ranks are in ``sleep_long`` (a hang bound of 120 s)."""

    def wait() -> None:
        deadline = time.monotonic() + 120
        while not all((marker_dir / f"rank{r}").exists() for r in (0, 1)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        time.sleep(0.3)  # into the sleep
        then()

    threading.Thread(target=wait, daemon=True).start()


def _run_id_recorder() -> tuple[list[str], Any]:
    ids: list[str] = []
    return ids, lambda event: ids.append(event.run_id)


@pytest.mark.parametrize("reach", ["live", "relayed"])
def test_cancel_stops_the_stage_and_leaves_no_process(
    connect: Any, reach: str, tmp_path: Path
) -> None:
    ids, on_event = _run_id_recorder()
    distributor = ranks_on(connect, reach, on_event=on_event)
    when_both_sleep(tmp_path, distributor.cancel)
    started = time.monotonic()
    with pytest.raises(TrainingCancelledError) as info:
        distributor.run(sleep_long, str(tmp_path))
    assert time.monotonic() - started < 90
    if reach == "live":  # where the ranks were travels over the channel
        assert sorted(info.value.stacks) == [0, 1], info.value.stacks
        assert all("in sleep_long (test_connect.py:" in s for s in info.value.stacks.values())
    else:  # the ranks' frames come with the stage's result: nobody to ask
        assert info.value.stacks == {}
    assert wait_until_gone(ids[0], 30) == [], "the ranks outlived the cancelled run"
    assert connect.range(3).count() == 3  # the session is still usable


def test_timeout_stops_the_ranks(connect: Any) -> None:
    ids, on_event = _run_id_recorder()
    with pytest.raises(TrainingTimeoutError):
        ranks_on(connect, "live", timeout=8, on_event=on_event).run(sleep_long)
    assert wait_until_gone(ids[0], 30) == []


def slow_start_then_value() -> int:
    time.sleep(8)
    return int(os.environ["WORLD_SIZE"])


def test_relayed_ranks_are_not_a_start_timeout(connect: Any) -> None:
    """No rank reaches the channel, yet Connect's progress reports show the stage running:
    a start_timeout shorter than the training must not stop it."""
    value = ranks_on(connect, "relayed", start_timeout=5).run(slow_start_then_value)
    assert value == 2


def test_too_many_ranks_for_the_servers_master_fail_before_launch(connect: Any) -> None:
    started = time.monotonic()
    with pytest.raises(ResourceError, match="needs 3 barrier task slots"):
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=False, spark=connect).run(print)
    assert time.monotonic() - started < 30


def forty_mib_bytes() -> bytes | None:
    if int(os.environ["RANK"]) != 0:
        return None
    return bytes(range(256)) * (160 << 10)  # 40 MiB: several chunks and Arrow batches


def test_a_40_mib_value_arrives_whole_in_arrow_rows(connect: Any) -> None:
    # Relayed: the value comes back as Arrow rows through Spark. A live run's value takes the
    # channel, as on a classic session (test_barrier_mode's 256 MiB value).
    value = ranks_on(connect, "relayed").run(forty_mib_bytes)
    assert isinstance(value, bytes) and len(value) == 40 << 20
    assert value[:256] == bytes(range(256)) and value[-256:] == bytes(range(256))


SCRIPT = """\
import os, sys
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} args {sys.argv[1:]}")
"""


def test_a_script_runs_with_its_arguments(connect: Any, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # Relayed: rank 0's stdout, the script's value, comes back with the tasks' rows; the
    # script itself is shipped to the server's executors either way.
    output = ranks_on(connect, "relayed").run(str(script), "--lr=0.01")
    assert "rank 0 of 2 args ['--lr=0.01']" in output


def rows_seen(batch_size: int) -> list[list[int]]:
    import torch.distributed as dist

    from sparktorch_ops.data import partition_loader

    dist.init_process_group("gloo")
    ids: list[int] = []
    for batch in partition_loader(batch_size):
        ids += batch["id"].tolist()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids)
    dist.destroy_process_group()
    return gathered


@pytest.mark.parametrize("reach", ["live", "relayed"])
def test_train_on_a_connect_dataframe(connect: Any, reach: str) -> None:
    frame = connect.range(1001, numPartitions=5).selectExpr("id", "cast(id * 2 as double) AS x")
    result = ranks_on(connect, reach).launch_on_dataframe(rows_seen, frame, 50)
    first, second = (set(ids) for ids in result.value)
    assert first.isdisjoint(second) and first | second == set(range(1001))
    assert sorted(map(len, (first, second))) == [500, 501]
    assert result.input is not None and result.input["rows"] == 1001


NO_JVM_CLIENT = textwrap.dedent(
    """
    import sys, threading, time
    import psutil
    from pyspark.sql import SparkSession
    from sparktorch_ops import TorchDistributor

    def rank_count():
        import os
        return int(os.environ["WORLD_SIZE"])

    javas = []
    stop = threading.Event()
    def watch():
        me = psutil.Process()
        while not stop.is_set():
            javas.extend(p.pid for p in me.children(recursive=True) if "java" in p.name())
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    barrier = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(rank_count)
    local = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(rank_count)
    from pyspark import SparkContext
    stop.set()
    watcher.join()
    print("RESULT", barrier, local, len(set(javas)), SparkContext._gateway is None)
    """
)


def test_the_client_never_starts_a_jvm(connect_server: ConnectServer) -> None:
    """In a process of its own (one that is a pure Connect client): barrier mode on the
    active Connect session and local mode beside it, with no java process ever started."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_REMOTE",)}
    client = subprocess.run(
        [sys.executable, "-c", NO_JVM_CLIENT, connect_server.url],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert client.returncode == 0, client.stderr[-4000:]
    result = [line for line in client.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT 2 2 0 True"], client.stdout[-2000:]


def test_an_unreachable_connect_url_fails_fast() -> None:
    """The session factory (the operator's, the Prefect block's, the CLI's) refuses at once a
    Connect URL nothing answers at, naming the setting and hiding the token."""
    from sparktorch_ops.spark.session import SparkSettings, get_session

    started = time.monotonic()
    with pytest.raises(ConfigError, match="cannot reach the Spark Connect server") as info:
        get_session(SparkSettings(master="sc://127.0.0.1:1/;token=hidden"))
    assert info.value.argument == "spark_master" and "hidden" not in str(info.value)
    assert time.monotonic() - started < 30


def test_a_connect_server_that_dies_mid_run_fails_it(doomed_connect_server: ConnectServer) -> None:
    """The server's JVM is killed while the ranks run: the run fails within seconds (pyspark's
    client alone would retry for ~10 minutes, and the stage's call with it), and no rank is
    left."""
    import signal

    from pyspark.sql.connect.session import SparkSession as ConnectSession

    server = doomed_connect_server
    session = ConnectSession.builder.remote(server.url).create()
    javas = [p for p in server.group_members() if p.name() == "java"]
    ids: list[str] = []
    connected: list[int] = []
    killed_at: list[float] = []

    def kill_when_both_ranks_run(event: Any) -> None:
        ids.append(event.run_id)
        if event.name == "worker_connected":
            connected.append(event.rank)
        if len(connected) == 2 and not killed_at:
            killed_at.append(time.monotonic())
            for process in javas:
                process.send_signal(signal.SIGKILL)

    with pytest.raises(TrainingFailedError) as info:
        TorchDistributor(
            num_processes=2,
            local_mode=False,
            use_gpu=False,
            spark=session,
            on_event=kill_when_both_ranks_run,
        ).run(sleep_long)
    # Not a wait on the dead server's stage call or interrupt (a hang bound, not a speed test).
    assert killed_at and time.monotonic() - killed_at[0] < 30
    # The ranks die with the server's workers; when the tasks' loss is seen before the
    # ranks' exits, the reason names the server.
    message = str(info.value)
    assert "signal SIGTERM" in message or "lost the Spark Connect server" in message
    session.client.close()  # else its exit handler calls the dead server for minutes
    assert wait_until_gone(ids[0], 60) == []


def test_two_runs_at_once_over_one_connect_session(connect: Any, tmp_path: Path) -> None:
    """Two 1-rank barrier runs from two threads share the Connect session (tags per thread):
    both train at once, each logger sees its own rank's lines only."""
    from tests.support.concurrent import Runs, meet, rank_lines
    from tests.support.records import collecting_logger

    runs, collects = Runs(), {}
    for name in ("a", "b"):
        logger, collects[name] = collecting_logger(f"tests.connect.at_once.{name}")
        distributor = TorchDistributor(
            num_processes=1, local_mode=False, use_gpu=False, spark=connect, logger=logger
        )
        runs.start(name, lambda d=distributor, n=name: d.launch(meet, str(tmp_path), n, 2, 5))
    outcomes = runs.join()
    for name in ("a", "b"):
        assert not isinstance(outcomes[name], BaseException), repr(outcomes[name])
        assert outcomes[name].value["name"] == name
        assert rank_lines(collects[name]) == [f"{name} line {i}" for i in range(5)]
