"""``report()``: metrics and progress from the training code to the driver."""

from __future__ import annotations

import math
import numbers
import threading
import time
import warnings
from typing import Any

from sparktorch_ops.wire import channel
from sparktorch_ops.wire.messages import MetricReport

_lock = threading.Lock()
_client: channel.ChannelClient | None = None
_next_step = 0


def install(client: channel.ChannelClient | None) -> None:
    """Route ``report()`` through ``client`` (done by the rank's bootstrap)."""
    global _client, _next_step
    with _lock:
        _client = client
        _next_step = 0


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
    client.send_message(
        MetricReport(step=int(step), time=time.time(), values=clean, progress=progress)
    )
