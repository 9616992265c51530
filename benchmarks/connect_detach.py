"""Does a barrier stage started over Spark Connect outlive its client, and can a new client
process reattach to it?

For each ``detachedTimeout:senderMaxStreamDuration`` setting this starts a Spark Connect server
(``spark-submit --class SparkConnectServer`` of the pyspark package, ``local[2]``,
``spark.connect.execute.manager.maintenanceInterval`` 5 s) and runs scenarios, each in its own
Connect session (a fixed ``session_id`` in the URL). In every one, client 1 (a subprocess, the
pyspark Connect client with its default reattachable execution) runs a 2-task barrier
``mapInArrow`` under a known operation id and tag; the tasks append a timestamp to a marker file
every 0.5 s for the stage's duration. 5 s after both tasks started client 1 gets SIGKILL, and
2 s later (except ``observe`` and ``plain``) a new client process with the same session_id does:

- ``observe``: nothing; the markers say how long the orphaned tasks went on. Once they stopped
  (or finished), a ``late`` reattach with client 1's cursor is tried.
- ``fresh``: the ``ReattachExecute`` RPC for the operation id, with no ``last_response_id``
  (all a new process knows without help), reading the rows to ResultComplete.
- ``cursor``: the same with ``last_response_id`` = the id of the last response client 1
  consumed (client 1 reports each; pyspark releases the server's buffer up to it).
- ``duplicate``: a new ``ExecutePlan`` with the same operation id (a naive retry), then a
  reattach.
- ``interrupt``: ``interruptTag`` on the orphan's tag (how a retry would clean it up).
- ``plain``: as ``observe``, but client 1 runs ``disable_reattachable_execute()``.

The tasks' runtime after the kill, whether they completed, what the second client got (rows or
the server's error verbatim) and the server's log lines for the operation are reported. Only
the first setting runs every scenario; the others run ``observe``. Nothing here imports the
package or the tests: only pyspark, pyarrow, grpc, psutil and harness/connect_server.py.
Takes about 8 minutes.

    python benchmarks/connect_detach.py [--settings 15:20,40:20,15:default] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: harness/

from harness.connect_server import ConnectServer, spark_home

KILL_AFTER_S = 5.0
MAINTENANCE_S = 5  # spark.connect.execute.manager.maintenanceInterval (default 30s)
STAGE_SCHEMA = "partition long, ticks long, start double, end double"
TAG = "detach-probe"


def emit(**event: Any) -> None:
    """One JSON line on stdout (clients report to the parent this way)."""
    print(json.dumps({"t": time.time(), **event}), flush=True)


# -- the barrier stage (runs in the server's Python workers; pickled by value) -----------------
def make_task(marker_dir: str, duration: float):
    def task(batches):
        import os
        import time

        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:
            pass
        ctx = BarrierTaskContext.get()
        part = ctx.partitionId()
        ctx.barrier()
        start = time.time()
        ticks = 0
        with open(os.path.join(marker_dir, f"task-{part}.log"), "a") as out:
            out.write(f"start {start} {os.getpid()}\n")
            out.flush()
            while time.time() - start < duration:
                time.sleep(0.5)
                ticks += 1
                out.write(f"tick {time.time()}\n")
                out.flush()
            end = time.time()
            out.write(f"done {end}\n")
        yield pa.RecordBatch.from_pydict(
            {"partition": [part], "ticks": [ticks], "start": [start], "end": [end]}
        )

    return task


# -- client roles (subprocesses) ---------------------------------------------------------------
def _session(url: str, session_id: str) -> Any:
    from pyspark.sql.connect.session import SparkSession

    return SparkSession.builder.remote(f"{url}/;session_id={session_id}").getOrCreate()


def _fix_next_operation_id(client: Any, operation_id: str) -> None:
    """The next ExecutePlan of ``client`` gets ``operation_id`` (pyspark picks a random one)."""
    original = client._execute_plan_request_with_metadata
    state = {"used": False}

    def fixed(operation_id_arg: str | None = None) -> Any:
        if operation_id_arg is None and not state["used"]:
            state["used"] = True
            return original(operation_id)
        return original(operation_id_arg)

    client._execute_plan_request_with_metadata = fixed


def _report_consumed_responses() -> None:
    """Emit the id of every ExecutePlanResponse pyspark's reattachable iterator hands on (it
    sends ReleaseExecute up to each one: a later reattach must start after the last)."""
    from pyspark.sql.connect.client import reattach

    cls = reattach.ExecutePlanResponseReattachableIterator
    original = cls.send

    def send(self: Any, value: Any) -> Any:
        response = original(self, value)
        emit(
            event="response",
            response_id=response.response_id,
            kind=response.WhichOneof("response_type"),
        )
        return response

    cls.send = send


def role_run(args: argparse.Namespace) -> None:
    """Client 1: the barrier stage, with a known operation id; killed by the parent."""
    spark = _session(args.url, args.session_id)
    client = spark._client
    if args.plain:
        client.disable_reattachable_execute()
    emit(
        event="connected",
        reattachable=client._use_reattachable_execute,
        user_id=client._user_id,
        confs={
            key: spark.conf.get(key, None)
            for key in (
                "spark.connect.execute.manager.detachedTimeout",
                "spark.connect.execute.manager.maintenanceInterval",
                "spark.connect.execute.reattachable.senderMaxStreamDuration",
                "spark.connect.session.manager.defaultSessionTimeout",
            )
        },
    )
    seen: set[str] = set()

    def progress(stages: Any, inflight_tasks: int, operation_id: str | None, done: bool) -> None:
        if operation_id and operation_id not in seen:
            seen.add(operation_id)
            emit(event="progress", operation_id=operation_id)

    spark.registerProgressHandler(progress)
    _report_consumed_responses()
    spark.addTag(TAG)
    frame = spark.range(2, numPartitions=2).mapInArrow(
        make_task(args.marker_dir, args.duration), STAGE_SCHEMA, barrier=True
    )
    _fix_next_operation_id(client, args.operation_id)
    emit(event="submit", operation_id=args.operation_id)
    table = frame.toArrow()
    emit(event="result", rows=table.to_pylist())


def _for_operation(request_type: Any, client: Any, operation_id: str) -> Any:
    """A request about ``operation_id`` in ``client``'s session, as its user."""
    req = request_type(
        session_id=client._session_id,
        operation_id=operation_id,
        client_type=client._builder.userAgent,
    )
    if client._user_id:
        req.user_context.user_id = client._user_id
    return req


def _reattach_request(client: Any, operation_id: str, last: str | None) -> Any:
    import pyspark.sql.connect.proto as pb2

    req = _for_operation(pb2.ReattachExecuteRequest, client, operation_id)
    if last:
        req.last_response_id = last
    return req


def _grpc_error(error: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(error).__name__, "message": str(error)[:1500]}
    with contextlib.suppress(Exception):
        out["code"] = str(error.code())  # type: ignore[attr-defined]
        out["details"] = error.details()  # type: ignore[attr-defined]
    return out


def reattach_and_read(
    client: Any, operation_id: str, last_response_id: str | None = None
) -> dict[str, Any]:
    """``ReattachExecute`` for ``operation_id``, reading arrow batches until ResultComplete
    (reattaching again where the server ends a stream early, as pyspark's iterator does)."""
    import pyarrow as pa
    import pyspark.sql.connect.proto as pb2

    rows: list[dict[str, Any]] = []
    last: str | None = last_response_id
    streams = 0
    responses = 0
    first_response_t: float | None = None
    complete = False
    started = time.time()
    try:
        while not complete:
            streams += 1
            stream = client._stub.ReattachExecute(
                _reattach_request(client, operation_id, last),
                metadata=client._builder.metadata(),
            )
            for response in stream:
                responses += 1
                if first_response_t is None:
                    first_response_t = time.time()
                last = response.response_id
                if response.HasField("arrow_batch"):
                    with pa.ipc.open_stream(response.arrow_batch.data) as reader:
                        rows += reader.read_all().to_pylist()
                if response.HasField("result_complete"):
                    complete = True
            if streams > 50:
                break
    except Exception as error:
        return {
            "ok": False,
            "error": _grpc_error(error),
            "streams": streams,
            "responses": responses,
            "rows": rows,
            "waited_s": time.time() - started,
        }
    with contextlib.suppress(Exception):
        release = _for_operation(pb2.ReleaseExecuteRequest, client, operation_id)
        release.release_all.CopyFrom(pb2.ReleaseExecuteRequest.ReleaseAll())
        client._stub.ReleaseExecute(release, metadata=client._builder.metadata())
    return {
        "ok": complete,
        "streams": streams,
        "responses": responses,
        "rows": rows,
        "waited_s": time.time() - started,
    }


def role_reattach(args: argparse.Namespace) -> None:
    """A new client process with the same session_id: resubmit, then reattach."""
    spark = _session(args.url, args.session_id)
    client = spark._client
    emit(event="connected", user_id=client._user_id)
    if args.duplicate:
        # What a retry that simply runs the stage again with the same operation id meets.
        _fix_next_operation_id(client, args.operation_id)
        started = time.time()
        try:
            spark.range(1).toArrow()
            emit(event="duplicate", ok=True, waited_s=time.time() - started)
        except Exception as error:
            emit(
                event="duplicate",
                ok=False,
                error=_grpc_error(error),
                waited_s=time.time() - started,
            )
    emit(
        event="reattach_start",
        operation_id=args.operation_id,
        last_response_id=args.last_response_id,
    )
    emit(
        event="reattach",
        last_response_id=args.last_response_id,
        **reattach_and_read(client, args.operation_id, args.last_response_id),
    )


def role_interrupt(args: argparse.Namespace) -> None:
    """A new client process with the same session_id interrupts the orphan by its tag."""
    spark = _session(args.url, args.session_id)
    started = time.time()
    try:
        ids = spark.interruptTag(TAG)
        emit(event="interrupt", ok=True, interrupted=ids, waited_s=time.time() - started)
    except Exception as error:
        emit(event="interrupt", ok=False, error=_grpc_error(error), waited_s=time.time() - started)


# -- the parent: server, clients, markers -------------------------------------------------------
def _env() -> dict[str, str]:
    drop = ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", "SPARK_API_MODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        SPARK_HOME=spark_home(),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        PYTHONUNBUFFERED="1",
    )
    return env


class Client:
    """A client-role subprocess of this script; its JSON lines land in a file."""

    def __init__(self, workdir: Path, name: str, argv: list[str]) -> None:
        self.out_path = workdir / f"{name}.jsonl"
        self.err_path = workdir / f"{name}.stderr"
        env = _env()
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, __file__, *argv],
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def events(self) -> list[dict[str, Any]]:
        try:
            lines = self.out_path.read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events() if e.get("event") == name), None)

    def stderr_tail(self, last: int = 1500) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-last:]
        except OSError:
            return ""

    def kill(self) -> float:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        return time.time()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


def read_markers(marker_dir: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for path in sorted(marker_dir.glob("task-*.log")):
        part = int(path.stem.split("-")[1])
        info: dict[str, Any] = {"ticks": 0, "start": None, "last": None, "done": None}
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) < 2:
                continue
            kind, stamp = fields[0], float(fields[1])
            if kind == "start":
                info["start"] = stamp
            elif kind == "tick":
                info["ticks"] += 1
            elif kind == "done":
                info["done"] = stamp
            info["last"] = stamp
        out[part] = info
    return out


def wait_started(marker_dir: Path, client: Client, timeout: float) -> float | None:
    """When both tasks have written their start line (None: not within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        marks = read_markers(marker_dir)
        if len(marks) == 2 and all(m["start"] for m in marks.values()):
            return max(m["start"] for m in marks.values())
        if client.process.poll() is not None:
            return None
        time.sleep(0.2)
    return None


def wait_quiet(marker_dir: Path, timeout: float, quiet_s: float = 4.0) -> None:
    """Until both tasks wrote ``done`` or no marker moved for ``quiet_s`` (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        marks = read_markers(marker_dir)
        if marks and all(m["done"] for m in marks.values()):
            return
        last = max((m["last"] or 0.0) for m in marks.values()) if marks else 0.0
        if marks and time.time() - last > quiet_s:
            return
        time.sleep(0.5)


def server_lines(server: ConnectServer, operation_id: str, since_len: int) -> list[str]:
    keys = (operation_id, "abandon", "Abandon", "detached", "interrupt", "Interrupt", "cancel")
    out = []
    for line in server.log()[since_len:].splitlines():
        if any(key in line for key in keys):
            out.append(line.strip()[:400])
    return out[:30]


def _client_argv(role: str, server: ConnectServer, session_id: str, op: str) -> list[str]:
    """A client role's arguments: which server, session and operation."""
    return ["--role", role, "--url", server.url, "--session-id", session_id, "--operation-id", op]


def _run_client(
    workdir: Path,
    server: ConnectServer,
    name: str,
    session_id: str,
    op: str,
    duration: float,
    plain: bool = False,
) -> tuple[Client, Path]:
    marker_dir = workdir / f"markers-{name}"
    marker_dir.mkdir()
    argv = [
        *_client_argv("run", server, session_id, op),
        "--marker-dir",
        str(marker_dir),
        "--duration",
        str(duration),
    ]
    if plain:
        argv.append("--plain")
    return Client(workdir, name, argv), marker_dir


FOLLOW_UPS = {
    # name: (role, extra argv, use client 1's last consumed response id)
    "fresh": ("reattach", [], False),
    "cursor": ("reattach", [], True),
    "duplicate": ("reattach", ["--duplicate"], False),
    "interrupt": ("interrupt", [], False),
}


def _second_client(
    workdir: Path,
    server: ConnectServer,
    name: str,
    session_id: str,
    op: str,
    follow_up: str,
    last_response_id: str | None,
    killed_at: float,
    wait_s: float,
) -> dict[str, Any]:
    role, extra, _ = FOLLOW_UPS[follow_up]
    argv = [*_client_argv(role, server, session_id, op), *extra]
    if last_response_id:
        argv += ["--last-response-id", last_response_id]
    second = Client(workdir, name, argv)
    started = time.time()
    code = second.wait(timeout=wait_s)
    out: dict[str, Any] = {
        "follow_up": follow_up,
        "started_after_kill_s": round(started - killed_at, 2),
        "exit": code,
        "wall_s": round(time.time() - started, 2),
    }
    for event in second.events():
        if event.get("event") in ("duplicate", "reattach", "interrupt"):
            event = dict(event)
            event["ended_after_kill_s"] = round(event.pop("t") - killed_at, 2)
            out[event.pop("event")] = event
    if code != 0:
        out["stderr"] = second.stderr_tail()
    return out


def scenario_kill_and_watch(
    workdir: Path,
    server: ConnectServer,
    setting: dict[str, Any],
    name: str,
    duration: float,
    plain: bool = False,
    follow_up: str | None = None,
) -> dict[str, Any]:
    """Client 1 starts the stage and is SIGKILLed 5 s after both tasks started; 2 s later
    ``follow_up`` (a new client process, same session_id: see FOLLOW_UPS; None: nobody) and
    the markers are watched to the end. With no follow-up, a late reattach (with client 1's
    cursor) is tried once the tasks stopped."""
    session_id, op = str(uuid.uuid4()), str(uuid.uuid4())
    log_len = len(server.log())
    client, marker_dir = _run_client(workdir, server, name, session_id, op, duration, plain)
    result: dict[str, Any] = {
        "scenario": name.rsplit("-", 1)[0],
        **setting,
        "reattachable_client": not plain,
        "stage_duration_s": duration,
        "session_id": session_id,
        "operation_id": op,
    }
    stage_start = wait_started(marker_dir, client, timeout=120)
    if stage_start is None:
        result["error"] = "the stage did not start: " + client.stderr_tail()
        client.kill()
        return result
    time.sleep(max(0.0, stage_start + KILL_AFTER_S - time.time()))
    killed_at = client.kill()
    result["killed_after_stage_start_s"] = round(killed_at - stage_start, 2)
    connected = client.event("connected") or {}
    result["client1_confs"] = connected.get("confs")
    result["client1_reattachable"] = connected.get("reattachable")
    result["client1_progress_operation_id"] = (client.event("progress") or {}).get("operation_id")
    consumed = [e for e in client.events() if e.get("event") == "response"]
    result["client1_consumed"] = [e.get("kind") for e in consumed]
    last_response_id = consumed[-1]["response_id"] if consumed else None
    result["client1_last_response_id"] = last_response_id
    if follow_up is not None:
        time.sleep(2.0)
        use_cursor = FOLLOW_UPS[follow_up][2]
        result["second"] = _second_client(
            workdir,
            server,
            f"{name}-second",
            session_id,
            op,
            follow_up,
            last_response_id if use_cursor else None,
            killed_at,
            duration + 120,
        )
    wait_quiet(marker_dir, timeout=duration + 60)
    marks = read_markers(marker_dir)
    last = max((m["last"] or 0.0) for m in marks.values())
    result["tasks"] = {
        str(part): {
            "ticks": m["ticks"],
            "done": m["done"] is not None,
            "ran_after_kill_s": round((m["last"] or killed_at) - killed_at, 2),
        }
        for part, m in marks.items()
    }
    result["tasks_completed"] = all(m["done"] for m in marks.values())
    result["ran_after_kill_s"] = round(last - killed_at, 2)
    if follow_up is None and not plain:
        time.sleep(1.0)
        result["late"] = _second_client(
            workdir,
            server,
            f"{name}-late",
            session_id,
            op,
            "cursor",
            last_response_id,
            killed_at,
            120,
        )
    time.sleep(1.0)
    result["server_log"] = server_lines(server, op, log_len)
    return result


def parse_settings(text: str) -> list[dict[str, Any]]:
    """``T:S,...``: detachedTimeout T s and senderMaxStreamDuration S s (``default``: 2m)."""
    out = []
    for item in text.split(","):
        timeout_s, _, stream_s = item.partition(":")
        out.append(
            {
                "detached_timeout_s": int(timeout_s),
                "sender_max_stream_s": None if stream_s in ("", "default") else int(stream_s),
            }
        )
    return out


def measure(settings: list[dict[str, Any]], workroot: Path) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    servers: list[dict[str, Any]] = []
    for index, setting in enumerate(settings):
        timeout_s, stream_s = setting["detached_timeout_s"], setting["sender_max_stream_s"]
        workdir = workroot / f"server-{index}"
        workdir.mkdir()
        confs = {
            "spark.connect.execute.manager.detachedTimeout": f"{timeout_s}s",
            "spark.connect.execute.manager.maintenanceInterval": f"{MAINTENANCE_S}s",
        }
        if stream_s is not None:
            confs["spark.connect.execute.reattachable.senderMaxStreamDuration"] = f"{stream_s}s"
        server = ConnectServer(
            workdir,
            confs={"spark.ui.enabled": "false", "spark.driver.memory": "1g", **confs},
            env={"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable},
        )
        try:
            ready_s = server.wait_listening(180.0)
            servers.append({**setting, "port_open_s": round(ready_s, 1), "confs": confs})
            print(f"[detach] server up {confs} in {ready_s:.0f}s", file=sys.stderr, flush=True)
            # Long enough to see the server stop it (stream end + detachedTimeout + a
            # maintenance pass); with the default 2m stream, a 45 s stage (budget).
            observe_s = (
                stream_s + timeout_s + MAINTENANCE_S + 20.0 if stream_s is not None else 45.0
            )
            plan: list[tuple[str, float, bool, str | None]] = [("observe", observe_s, False, None)]
            if index == 0:
                plan += [
                    ("fresh", 20.0, False, "fresh"),
                    ("cursor", 20.0, False, "cursor"),
                    ("duplicate", 20.0, False, "duplicate"),
                    ("interrupt", 30.0, False, "interrupt"),
                    ("plain", 30.0, True, None),
                ]
            for name, duration, plain, follow_up in plan:
                print(
                    f"[detach]   {name} ({duration:.0f} s stage) ...", file=sys.stderr, flush=True
                )
                result = scenario_kill_and_watch(
                    workdir, server, setting, f"{name}-{index}", duration, plain, follow_up
                )
                results.append(result)
                print(
                    f"[detach]   {name}: tasks ran {result.get('ran_after_kill_s')} s after "
                    f"the kill, completed={result.get('tasks_completed')}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            server.stop()
    return {"servers": servers, "results": results}


def _second_summary(second: dict[str, Any] | None) -> str:
    if not second:
        return ""
    if "interrupt" in second:
        i = second["interrupt"]
        return f"interruptTag -> {i.get('interrupted', i.get('error'))}"
    parts = []
    dup = second.get("duplicate")
    if dup is not None:
        parts.append(
            "resubmit same op id: " + ("accepted" if dup.get("ok") else _short(dup["error"]))
        )
    re_ = second.get("reattach")
    if re_ is None:
        parts.append(f"no result (exit {second.get('exit')})")
    elif re_.get("ok"):
        parts.append(
            f"reattach OK: {len(re_['rows'])} rows, done {re_['ended_after_kill_s']}s after kill"
        )
    else:
        parts.append("reattach FAILED: " + _short(re_.get("error", {})))
    cursor = "cursor" if second.get("follow_up") == "cursor" else "no cursor"
    return f"[+{second['started_after_kill_s']}s, {cursor}] " + "; ".join(parts)


def _short(error: dict[str, Any]) -> str:
    text = error.get("details") or error.get("message") or ""
    return text.splitlines()[0][:150] if text else str(error)[:150]


def print_table(report: dict[str, Any]) -> None:
    header = (
        f"{'scenario':<10} {'detachT':>7} {'maxStream':>9} {'client':>6} {'stage':>6} "
        f"{'ran after kill':>14} {'done':>5}  new client (same session_id)"
    )
    print(header)
    print("-" * len(header))
    for r in report["results"]:
        stream = r["sender_max_stream_s"]
        stream_text = "2m(def)" if stream is None else f"{stream}s"
        if "error" in r:
            print(
                f"{r['scenario']:<10} {r['detached_timeout_s']:>6}s {stream_text:>9}  ERROR "
                f"{r['error'][:200]}"
            )
            continue
        client = "reatt" if r["reattachable_client"] else "plain"
        second = _second_summary(r.get("second") or r.get("late"))
        if "late" in r:
            second = "late " + second
        print(
            f"{r['scenario']:<10} {r['detached_timeout_s']:>6}s {stream_text:>9} {client:>6} "
            f"{r['stage_duration_s']:>5.0f}s {r['ran_after_kill_s']:>13.1f}s "
            f"{r['tasks_completed']!s:>5}  {second}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--role", choices=("parent", "run", "reattach", "interrupt"), default="parent"
    )
    parser.add_argument(
        "--settings",
        default="15:20,40:20,15:default",
        help="detachedTimeout:senderMaxStreamDuration pairs, seconds (default: server's 2m)",
    )
    parser.add_argument("--json", help="write the report here (default: stdout after the table)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--url")
    parser.add_argument("--session-id")
    parser.add_argument("--operation-id")
    parser.add_argument("--marker-dir")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--duplicate", action="store_true")
    parser.add_argument("--last-response-id")
    args = parser.parse_args()
    if args.role == "run":
        role_run(args)
        return
    if args.role == "reattach":
        role_reattach(args)
        return
    if args.role == "interrupt":
        role_interrupt(args)
        return
    workroot = Path(tempfile.mkdtemp(prefix="connect-detach-"))
    try:
        report = measure(parse_settings(args.settings), workroot)
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(workroot, ignore_errors=True)
        else:
            print(f"[detach] work directory: {workroot}", file=sys.stderr)
    import pyspark

    report["pyspark"] = pyspark.__version__
    report["maintenance_interval_s"] = MAINTENANCE_S
    print_table(report)
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
