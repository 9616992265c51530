"""The second part of a run: the channel, the plan, and the launcher that starts the ranks.

:func:`launch` opens the channel (TLS when Spark encrypts its own traffic), gathers the facts
and plans once (:func:`gather_facts`, as the dry run does), says what the ranks do with the
checkpoints, picks the launcher for the mode and starts it. It yields a :class:`Launched` for
supervision; leaving it tears the ranks down if the run raised, then closes the channel and
finishes the launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sparktorch_ops import checkpoint, events
from sparktorch_ops.driver.certificate import make_certificate
from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.driver.durable import try_line
from sparktorch_ops.driver.packing import describe
from sparktorch_ops.driver.planning import RunFacts, plan_run
from sparktorch_ops.driver.prepare import Prepared
from sparktorch_ops.events import RunState, RunStateMachine
from sparktorch_ops.launchers.barrier import BarrierLauncher
from sparktorch_ops.launchers.base import Launcher
from sparktorch_ops.launchers.connect import ARRIVAL_WAIT_S, ConnectBarrierLauncher
from sparktorch_ops.launchers.local import LocalLauncher
from sparktorch_ops.results import MetricRecord
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spark.session import task_resources
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.channel import ChannelServer
from sparktorch_ops.wire.payload import FunctionCall, Payload
from sparktorch_ops.wire.plan import UNKNOWN, RunPlan

_COLLATERAL_S = 3.0  # how long a teardown waits for the other ranks to hang up


@dataclass(frozen=True)
class Launched:
    """A started run: its plan, the launcher, the channel and what arrived over it."""

    plan: RunPlan
    launcher: Launcher
    collector: RunCollector
    server: ChannelServer
    resumed_from: int | None  # the checkpoint step the ranks resume from


def gather_facts(
    spec: LaunchSpec,
    run_id: str,
    *,
    conf_value: Callable[[str], str | None] | None = None,
    channel_address: str = UNKNOWN,
    channel_fingerprint: str | None = None,
    driver_host: str = UNKNOWN,
    local_gpus: tuple[str, ...] | None = None,
) -> RunFacts:
    """The facts a run of ``spec`` is planned from, gathered here for the run and its dry run
    alike; what a dry run cannot know stays a placeholder of :mod:`sparktorch_ops.wire.plan`.

    Args:
        spec: the run's options.
        run_id: the run's id.
        conf_value: a Spark conf lookup (the session's, or the settings it would start with);
            None: Spark's defaults.
        channel_address, channel_fingerprint: the driver's channel (a run's; a dry run has none).
        driver_host: this machine's host name (local mode's rank prefixes).
        local_gpus: the driver GPUs a local-mode run took.

    Raises:
        ConfigError: a Spark task setting that is not a number.
    """
    task_cpus, gpu_amount = task_resources(conf_value) if conf_value is not None else (1, None)
    return RunFacts(
        run_id=run_id,
        python=sys.executable,
        channel_address=channel_address,
        channel_fingerprint=channel_fingerprint,
        driver_host=driver_host,
        cpu_count=os.cpu_count(),
        local_gpus=local_gpus if spec.local_mode else None,
        task_cpus=task_cpus,
        task_gpu_amount=gpu_amount,
    )


def latest_checkpoint(spec: LaunchSpec, log: logging.Logger) -> int | None:
    """The step of the run's latest complete checkpoint as the driver sees it (None without
    ``checkpoint_dir``, or when the driver cannot look: a directory only executors reach)."""
    if spec.checkpoint_dir is None:
        return None
    try:
        return checkpoint.latest_step(directory=spec.checkpoint_dir)
    except Exception as exc:
        log.warning(
            "sparktorch_ops: cannot list checkpoints in %s from the driver: %s",
            spec.checkpoint_dir,
            exc,
        )
        return None


def _announce_checkpoint(
    spec: LaunchSpec, log: logging.Logger, mlflow_run_id: str | None
) -> int | None:
    """Say whether the ranks will resume, warm start or start fresh, and what this try of a
    durable training does (``mlflow_run_id``: its MLflow run); the step resumed."""
    directory, warm = spec.checkpoint_dir, spec.warm_start_from
    step = latest_checkpoint(spec, log)
    if spec.training is not None:
        log.info(try_line(spec.training, step, mlflow_run_id))
    if directory is None:
        return None
    if step is not None:
        log.info(
            "sparktorch_ops: resuming from step %d of checkpoint_dir %s%s",
            step,
            directory,
            f" (warm_start_from {warm} not used: a resume wins)" if warm else "",
        )
    elif warm is not None:
        log.info("sparktorch_ops: no checkpoint in %s yet: warm start from %s", directory, warm)
    else:
        log.info("sparktorch_ops: no checkpoint in %s yet: starting fresh", directory)
    return step


def _channel_host(spec: LaunchSpec, sc: Any) -> tuple[str, str | None]:
    """Where the channel listens and, if different, the host tasks are told to reach."""
    if spec.channel_host is not None:
        return ("::" if ":" in spec.channel_host else "0.0.0.0"), spec.channel_host
    if sc is None:
        return "127.0.0.1", None
    if spark_support.is_connect_session(sc):
        return spark_support.client_address_toward_server(sc), None
    return spark_support.driver_host(sc), None


def _say_unreachable(
    run_id: str, address: str, log: logging.Logger
) -> Callable[[dict[int, str]], None]:
    def say(reasons: dict[int, str]) -> None:
        tasks = ", ".join(str(node) for node in sorted(reasons))
        log.warning(
            "sparktorch_ops: %s: barrier task(s) %s could not reach this client's channel "
            "at %s (%s), so their ranks' output, metrics and result arrived with the "
            "stage's result, not live (and stall_timeout could not be watched). For live "
            "logs, pass channel_host= an address of this machine that the executors can reach",
            run_id,
            tasks,
            address,
            next(iter(reasons.values())),
        )

    return say


def _launcher(
    plan: RunPlan,
    payload: Payload,
    secret: str,
    prepared: Prepared,
    server: ChannelServer,
    collector: RunCollector,
    log: logging.Logger,
) -> Launcher:
    """The launcher for the plan's mode: local, a classic barrier stage, or one over Connect."""
    sc, data = prepared.sc, prepared.data
    if sc is None:
        return LocalLauncher(plan, payload, secret, collector, data)
    if data is not None:
        collector.coordinator.expect_shards(plan.layout.num_tasks)
    if spark_support.is_connect_session(sc):
        collector.coordinator.expect_arrivals(plan.layout.num_tasks, ARRIVAL_WAIT_S, server.send)
        return ConnectBarrierLauncher(
            plan,
            payload,
            secret,
            sc,
            handler=collector,
            on_unreachable=_say_unreachable(plan.run_id, server.address, log),
            data=data,
        )
    return BarrierLauncher(plan, payload, secret, sc, data=data)


@contextlib.contextmanager
def launch(
    spec: LaunchSpec,
    payload: Payload,
    run_id: str,
    prepared: Prepared,
    machine: RunStateMachine,
    log: logging.Logger,
    *,
    on_metrics: Callable[[MetricRecord], None] | None,
    check_cancelled: Callable[[], None],
    mlflow_run_id: str | None = None,
) -> Iterator[Launched]:
    """Start the ranks; on leaving, tear them down if the run raised, then clean up
    (``mlflow_run_id``: the run's MLflow run, named in a durable try's line)."""

    def on_phase(name: str, **where: Any) -> None:
        # A phase seen on the channel; the last rank to connect makes the run RUNNING.
        machine.emit(name, **where)
        if name != events.SUPERVISOR_CONNECTED:
            return
        if collector.status().connected >= spec.num_processes:
            machine.advance(RunState.STARTING, RunState.RUNNING)

    collector = RunCollector(
        log,
        log_ranks=spec.log_ranks,
        on_metrics=on_metrics,
        max_restarts=spec.max_restarts,
        keep_rank0_stdout=not isinstance(payload, FunctionCall),
        on_phase=on_phase,
        max_result_bytes=spec.max_result_bytes,
    )
    sc = prepared.sc
    host, advertise = _channel_host(spec, sc)
    secret = secrets.token_hex(32)
    # TLS when Spark encrypts its own traffic (barrier mode: the local mode's channel never
    # leaves loopback), unless the user opted out.
    encrypted = sc is not None and not spec.allow_unencrypted_channel
    certificate = make_certificate() if encrypted and spark_support.encryption_enabled(sc) else None
    server = ChannelServer(
        host,
        collector,
        log,
        secret,
        tls=certificate.server_context() if certificate is not None else None,
        advertise=advertise,
    )
    machine.emit(events.CHANNEL_OPEN, address=server.address, tls=certificate is not None)
    launcher: Launcher | None = None
    try:
        facts = gather_facts(
            spec,
            run_id,
            conf_value=(lambda key: spark_support.conf_value(sc, key)) if sc is not None else None,
            channel_address=server.address,
            channel_fingerprint=certificate.fingerprint if certificate is not None else None,
            driver_host=socket.gethostname(),
            local_gpus=prepared.local_gpus,
        )
        plan = plan_run(spec, describe(payload), facts)
        machine.emit(events.PLANNED, nodes=plan.layout.num_tasks, plan=plan.to_dict())
        resumed_from = _announce_checkpoint(spec, log, mlflow_run_id)
        check_cancelled()
        machine.to(RunState.STARTING)
        launcher = _launcher(plan, payload, secret, prepared, server, collector, log)
        launcher.start()
        machine.emit(events.LAUNCHER_STARTED)
        log.info(
            "sparktorch_ops: %s started %d ranks in %s mode",
            run_id,
            spec.num_processes,
            spec.mode,
        )
        yield Launched(plan, launcher, collector, server, resumed_from)
    except BaseException:
        if launcher is not None:
            machine.emit(events.TEARDOWN)
            collector.tearing_down()
            launcher.stop()
            server.drain(lambda: not collector.status().open_clients, _COLLATERAL_S)
        raise
    finally:
        server.close()
        collector.coordinator.close()
        if launcher is not None:
            launcher.release()
            machine.emit(events.LAUNCHER_FINISHED)
