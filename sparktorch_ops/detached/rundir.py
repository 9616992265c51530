"""The run directory: everything of a detached run, where any process can read it.

A detached run's driver writes its state here and nothing else holds it: no server to reach,
so a :class:`~sparktorch_ops.detached.handle.RunHandle`, the CLI or an Airflow trigger in
another process (or on another machine, through shared storage) only reads the directory,
and asks for a cancel by writing into it. A local path or an fsspec URL (``s3://...``)::

    <run>/run.json                  who: format, training id, when and where submitted
    <run>/job.pkl                   what: the job, pickled (the function by value)
    <run>/status.json               where it is: state, driver pid and host, heartbeat, progress
    <run>/events/00000001.jsonl     what happened, in chunks written whole and never changed:
    <run>/metrics/00000001.jsonl    phase events, report() records, rank output lines
    <run>/logs/00000001.jsonl
    <run>/result.json               how it ended: the RunResult's fields, or the error's text
    <run>/value.pkl, error.pkl      rank 0's value, or the exception, pickled
    <run>/cancel                    a cancel request (its reason)

Whole files are replaced atomically (:meth:`~sparktorch_ops.checkpoint.storage.Storage.write`),
and streams grow by new chunks only (object stores cannot append): a reader never sees half a
record.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

from sparktorch_ops.checkpoint.storage import Storage
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.events import RunState

FORMAT = 1
STREAMS = ("events", "metrics", "logs")
#: A driver whose heartbeat is older than this is taken for dead (it writes one every few s).
LOST_AFTER_S = 30.0
_CHUNK = re.compile(r"^(\d{8})\.jsonl$")
#: A detached run ends in a run's final state, or ``lost`` (its driver died unfinished).
LOST = "lost"
FINAL_STATES = frozenset({state.value for state in RunState if state.final} | {LOST})


class RunDirectoryError(ConfigError):
    """A run directory that cannot be used: missing, not a run's, unreadable or another
    user's (a ``ConfigError`` naming ``run_dir``).

    Attributes:
        location: the directory.
        problem: what is wrong with it and what to do.
    """

    def __init__(self, location: str, problem: str) -> None:
        super().__init__("run_dir", f"{location} {problem}")
        self.location = location
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.location, self.problem))


class RunDirectory:
    """One run's directory, on this machine's file system or behind fsspec.

    Attributes:
        location: the directory: an absolute path on this machine, else the URL as given.
        is_url: whether it is elsewhere than this machine's file system.
    """

    def __init__(self, location: str | os.PathLike[str]) -> None:
        text = os.fspath(location).strip()
        if not text:
            raise RunDirectoryError(
                repr(text), "is empty: give the run's directory (a path or a URL)"
            )
        self.storage = Storage(text)
        self.is_url = not self.storage.local
        self.location = text if self.is_url else self.storage.path()

    # -- identity ---------------------------------------------------------------------------
    def create(self, identity: dict[str, Any], job: bytes) -> None:
        """Make the directory of a new run: who it is (``run.json``) and what it runs.

        Raises:
            RunDirectoryError: it already holds another training's run.
        """
        if self.storage.exists("run.json"):
            existing = self.identity()
            if existing.get("training_id") != identity.get("training_id"):
                raise RunDirectoryError(
                    self.location,
                    f"holds the training {existing.get('training_id')}, not "
                    f"{identity.get('training_id')}: give each training a directory of its own",
                )
        elif not self.is_url:
            os.makedirs(self.location, exist_ok=True)
            if os.listdir(self.location):
                raise RunDirectoryError(
                    self.location, "is not empty and holds no run: give an empty or new directory"
                )
        record = {
            "format": FORMAT,
            "owner": getpass.getuser(),
            "created": time.time(),
            **identity,
        }
        self.storage.write(job, "job.pkl")
        self.storage.write(json.dumps(record).encode(), "run.json")

    def child(self, name: str) -> str:
        """The path or URL of ``name`` inside the directory, for other writers (Spark)."""
        return f"{self.location.rstrip('/')}/{name}"

    def remove(self) -> None:
        """Delete the directory and everything in it (a run that never started), as far as
        it can: it runs while another error is raised."""
        with contextlib.suppress(OSError):
            self.storage.remove_tree()

    def identity(self) -> dict[str, Any]:
        """``run.json``, checked.

        Raises:
            RunDirectoryError: missing, not a run directory, corrupt, of a newer format, or
                not readable by this user.
        """
        if not self.is_url and not os.path.isdir(self.location):
            raise RunDirectoryError(
                self.location, "does not exist (a run's directory, as submit printed it)"
            )
        if not self.is_url:
            owner = os.stat(self.location).st_uid
            if owner != os.getuid():
                raise RunDirectoryError(
                    self.location,
                    f"belongs to {_user(owner)}, not to {getpass.getuser()}: another user's "
                    "run is theirs to watch and cancel",
                )
        try:
            data = self.storage.read("run.json")
        except FileNotFoundError:
            raise RunDirectoryError(
                self.location,
                "is not a run directory (no run.json): give the directory submit made",
            ) from None
        except PermissionError:
            raise RunDirectoryError(
                self.location, f"cannot be read by {getpass.getuser()}: it is another user's run"
            ) from None
        try:
            record = json.loads(data)
        except ValueError:
            raise RunDirectoryError(self.location, "has a corrupt run.json (not JSON)") from None
        if not isinstance(record, dict) or "training_id" not in record:
            raise RunDirectoryError(self.location, "has a run.json that is not a run's")
        if record.get("format") != FORMAT:
            raise RunDirectoryError(
                self.location,
                f"is of format {record.get('format')!r}, this sparktorch_ops reads {FORMAT}",
            )
        return record

    def check_writable(self) -> None:
        """Raise RunDirectoryError where this user cannot write (a cancel request, say)."""
        if not self.is_url and not os.access(self.location, os.W_OK):
            raise RunDirectoryError(
                self.location, f"is not writable by {getpass.getuser()}: it is another user's run"
            )

    def job(self) -> bytes:
        """The pickled job."""
        return self.storage.read("job.pkl")

    # -- state ------------------------------------------------------------------------------
    def write_status(self, status: dict[str, Any]) -> None:
        """Replace ``status.json``."""
        self.storage.write(json.dumps(status).encode(), "status.json")

    def status(self) -> dict[str, Any]:
        """``status.json`` (``{"state": "submitted"}`` before the driver wrote one).

        Raises:
            RunDirectoryError: corrupt.
        """
        try:
            record = json.loads(self.storage.read("status.json"))
        except FileNotFoundError:
            return {"state": "submitted"}
        except ValueError:
            raise RunDirectoryError(self.location, "has a corrupt status.json") from None
        if not isinstance(record, dict) or "state" not in record:
            raise RunDirectoryError(self.location, "has a status.json without a state")
        return record

    # -- streams ----------------------------------------------------------------------------
    def append(self, stream: str, records: list[dict[str, Any]], sequence: int) -> None:
        """Write ``records`` as chunk ``sequence`` of ``stream`` (a new file, never changed)."""
        data = "".join(json.dumps(record) + "\n" for record in records).encode()
        self.storage.write(data, stream, f"{sequence:08d}.jsonl")

    def chunks(self, stream: str) -> list[int]:
        """The chunk numbers of ``stream`` written so far, in order."""
        found = (_CHUNK.match(name) for name in self.storage.names(stream))
        return sorted(int(match.group(1)) for match in found if match)

    def read(self, stream: str, after: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        """(chunk, record) of every record of ``stream`` in chunks after ``after``, in order."""
        for chunk in self.chunks(stream):
            if chunk <= after:
                continue
            for line in self.storage.read(stream, f"{chunk:08d}.jsonl").decode().splitlines():
                if line.strip():
                    yield chunk, json.loads(line)

    # -- the end ----------------------------------------------------------------------------
    def write_end(
        self, summary: dict[str, Any], value: bytes | None = None, error: bytes | None = None
    ) -> None:
        """How the run ended: the value or the error first, then ``result.json`` (a reader
        that finds it finds them)."""
        if value is not None:
            self.storage.write(value, "value.pkl")
        if error is not None:
            self.storage.write(error, "error.pkl")
        self.storage.write(json.dumps(summary).encode(), "result.json")

    def end(self) -> dict[str, Any] | None:
        """``result.json``, None while the run goes on."""
        try:
            return dict(json.loads(self.storage.read("result.json")))
        except FileNotFoundError:
            return None
        except ValueError:
            raise RunDirectoryError(self.location, "has a corrupt result.json") from None

    def value(self) -> bytes:
        """Rank 0's pickled value."""
        return self.storage.read("value.pkl")

    def error(self) -> bytes | None:
        """The pickled exception the run ended with, if any."""
        try:
            return self.storage.read("error.pkl")
        except FileNotFoundError:
            return None

    # -- cancel -----------------------------------------------------------------------------
    def request_cancel(self, reason: str) -> None:
        """Ask the run's driver to stop (it looks every second)."""
        self.check_writable()
        self.storage.write(reason.encode(), "cancel")

    def cancel_requested(self) -> str | None:
        """The reason of a cancel request, if one was made."""
        try:
            return self.storage.read("cancel").decode(errors="replace") or "cancelled"
        except FileNotFoundError:
            return None


def _user(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def state_of(status: dict[str, Any], now: float | None = None) -> str:
    """A status's state, ``lost`` for a run whose driver stopped its heartbeat unfinished."""
    state = str(status.get("state"))
    if state in FINAL_STATES or state == "submitted":
        return state
    beat = status.get("heartbeat")
    if isinstance(beat, int | float) and (now or time.time()) - beat > LOST_AFTER_S:
        return LOST
    return state
