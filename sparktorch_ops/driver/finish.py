"""The last part of a run: rank 0's value and the :class:`RunResult`."""

from __future__ import annotations

import logging
from typing import Any

import cloudpickle
import pendulum

from sparktorch_ops import errors
from sparktorch_ops.driver import resume
from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.driver.launch import Launched
from sparktorch_ops.driver.prepare import Prepared
from sparktorch_ops.results import RunResult
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.payload import FunctionCall, Payload


def rank0_value(collector: RunCollector, payload: Payload) -> Any:
    """A function's return value (unpickled) or a script's stdout, from rank 0.

    Raises:
        ResultTooLargeError: over ``max_result_bytes``.
        ChannelError: rank 0 finished but its value never arrived.
        SparkTorchError: the value does not unpickle on the driver.
    """
    if collector.result.refused is not None:
        raise collector.result.refused
    if not isinstance(payload, FunctionCall):
        return collector.stdout.text()
    if collector.result.value is None:
        raise errors.ChannelError(
            "rank 0 finished but its return value never arrived over the channel"
        )
    try:
        return cloudpickle.load(collector.result.value.reader())
    except Exception as exc:
        raise errors.SparkTorchError(
            f"rank 0's return value cannot be unpickled on the driver: {type(exc).__name__}: {exc}"
        ) from exc


def run_result(
    spec: LaunchSpec,
    launched: Launched,
    prepared: Prepared,
    value: Any,
    started_at: pendulum.DateTime,
    log: logging.Logger,
) -> RunResult:
    """Everything a finished run produced, for the caller."""
    collector, sc, data = launched.collector, prepared.sc, prepared.data
    return RunResult(
        value=value,
        exit_codes=collector.exit_codes(),
        outputs=collector.outputs(),
        metrics=list(collector.metrics.records),
        metrics_dropped=collector.metrics.dropped,
        started_at=started_at,
        finished_at=pendulum.now("UTC"),
        mode=spec.mode,
        num_processes=spec.num_processes,
        app_id=spark_support.app_id(sc) if sc is not None else None,
        ui_url=spark_support.ui_url(sc) if sc is not None else None,
        output_truncated=collector.stdout.cut,
        run_id=launched.plan.run_id,
        input=({**data.facts.summary(), "source": data.description} if data is not None else None),
        checkpoint=resume.summary(spec, launched.resumed_from, log),
    )
