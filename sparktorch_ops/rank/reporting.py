"""``report()``: metrics and progress from the training code to the driver.

Rank 0 also keeps its recent records, so that a checkpoint carries them
(:func:`records_for_checkpoint`) and a resume sends them again (:func:`replay`): a record the
driver had not passed on to MLflow when its process died is not lost to a retry.
"""

from __future__ import annotations

import collections
import math
import numbers
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import MessageError, MetricReport, Notice

# A checkpoint carries rank 0's records of this many seconds before it (the driver sends them
# to MLflow within a second or so; older ones are lost only if MLflow was down), at most
# CARRY_MAX of them, so a long training without checkpoints keeps bounded memory.
CARRY_S = 300.0
CARRY_MAX = 100_000

_lock = threading.Lock()
_client: channel.ChannelClient | None = None
_next_step = 0
_keeps = True  # this process is rank 0 (read once, at install)
# (monotonic time kept, record), rank 0 only
_kept: collections.deque[tuple[float, dict[str, Any]]] = collections.deque(maxlen=CARRY_MAX)


def install(client: channel.ChannelClient | None) -> None:
    """Route ``report()`` through ``client`` (done by the rank's bootstrap)."""
    global _client, _next_step, _keeps
    with _lock:
        _client = client
        _next_step = 0
        _keeps = os.environ.get("RANK", "0") == "0"
        _kept.clear()


def records_for_checkpoint() -> list[dict[str, Any]]:
    """Rank 0's records a checkpoint saved now carries (empty on other ranks): those of the
    last :data:`CARRY_S` seconds."""
    with _lock:
        _drop_old()
        return [record for _, record in _kept]


def _drop_old() -> None:
    cutoff = time.monotonic() - CARRY_S
    while _kept and _kept[0][0] < cutoff:
        _kept.popleft()


def replay(records: Iterable[Mapping[str, Any]]) -> int:
    """Send records that a resumed checkpoint carried again, marked as replayed (the driver
    logs to MLflow only the steps its run lacks); they are carried on as if new. Returns
    how many were sent; records that are not well-formed are skipped."""
    with _lock:
        client = _client
    if client is None:
        return 0
    sent = 0
    for record in records:
        try:
            message = MetricReport(
                step=int(record["step"]),
                time=float(record["time"]),
                values=dict(record["values"]),
                progress=record.get("progress"),
                replayed=True,
            )
            message.validate()
        except (KeyError, TypeError, ValueError, AttributeError, MessageError):
            continue
        _keep(message)
        client.send_message(message)
        sent += 1
    return sent


def notice(text: str, level: int) -> bool:
    """Send a line of our own rank-side code to the driver's log at ``level``; False outside
    a run (nothing was sent)."""
    with _lock:
        client = _client
    if client is None:
        return False
    client.send_message(Notice(level=level, text=text))
    return True


def _keep(message: MetricReport) -> None:
    if not _keeps:
        return
    record = {
        "step": message.step,
        "time": message.time,
        "values": message.values,
        "progress": message.progress,
    }
    with _lock:
        _kept.append((time.monotonic(), record))
        _drop_old()


def _scalar(key: str, value: Any) -> Any:
    if isinstance(value, (bool, str)) or value is None:
        return value
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:
            raise TypeError(f"report({key}=...): only scalars can be reported: {exc}") from None
        if isinstance(value, bool):  # a numpy / torch bool: a bool, as a Python one would be
            return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else str(number)
    raise TypeError(
        f"report({key}=...): expected a number, bool or str, got {type(value).__name__}"
    )


def report(step: int | None = None, progress: float | None = None, **values: Any) -> None:
    """Report metrics from any rank of a running training.

    Records reach the driver live: the distributor's ``on_metrics`` callback, the Airflow and
    Prefect wrappers (progress, artifacts) and ``RunResult.metrics`` all see them.

    Args:
        step: the step these values belong to; by default a per-rank count of reports.
        progress: the run's progress in [0, 1]; rank 0's latest value is the run's progress.
        **values: scalar metrics (numbers, bools, strings; tensors of one element are fine).

    Outside a sparktorch_ops run this warns and does nothing, so training code runs anywhere.
    """
    global _next_step
    if progress is not None:
        if not isinstance(progress, numbers.Real) or not 0.0 <= float(progress) <= 1.0:
            raise ValueError(f"report(progress=...) must be in [0, 1], got {progress!r}")
        progress = float(progress)
    clean = {key: _scalar(key, value) for key, value in values.items()}
    with _lock:
        client = _client
        if step is None:
            step = _next_step
        _next_step = int(step) + 1
    if client is None:
        warnings.warn(
            "sparktorch_ops.report() called outside a sparktorch_ops run; ignored",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    message = MetricReport(step=int(step), time=time.time(), values=clean, progress=progress)
    _keep(message)
    client.send_message(message)
