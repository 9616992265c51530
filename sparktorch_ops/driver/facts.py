"""The facts a run is planned from, gathered by one function for the run and its dry run.

The run knows more than a dry run (the channel's address and certificate, this host's name, the
GPUs it took); what it does not know yet stays a placeholder of :mod:`sparktorch_ops.wire.plan`,
so ``plan()`` / ``--dry-run`` show the plan the run would make, from the same code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from sparktorch_ops.driver.planning import RunFacts
from sparktorch_ops.spark.session import task_resources
from sparktorch_ops.spec import LaunchSpec
from sparktorch_ops.wire.plan import UNKNOWN


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
    """The facts of a run of ``spec``.

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
