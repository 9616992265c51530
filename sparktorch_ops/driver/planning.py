"""Pure planning: torchrun argv, per-node environment, GPU selection and the task layout.

Nothing here does I/O; every function is tested by exact equality.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparktorch_ops.errors import ConfigError, ResourceError
from sparktorch_ops.wire.env import (
    CHECKPOINT_DIR_ENV,
    UNSHARED_STORE_ENV,
    WARM_START_ENV,
)
from sparktorch_ops.wire.plan import (
    BOOTSTRAP_IN_ROOT,
    NODE_HOST,
    NODE_PYTHON,
    PACKAGE_ROOT,
    RDZV_ENDPOINT,
    TASK_GPUS,
    UNKNOWN,
    BarrierLayout,
    NodePlan,
    RunPlan,
    visible_gpus,
)

AGENT_MODULE = "sparktorch_ops.node.agent"
# torchrun runs this file in the agent's own interpreter (--run-path) in a forked child: the
# driver's copy in local mode; a barrier task fills in its own (sparktorch_ops.node.package).
BOOTSTRAP_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    BOOTSTRAP_IN_ROOT,
)
TASK_BOOTSTRAP_SCRIPT = f"{PACKAGE_ROOT}/{BOOTSTRAP_IN_ROOT}"
# Ranks are forked from the agent, which has already imported torch (DESIGN section 9);
# torchrun_args may say --start-method=spawn to give each rank a fresh interpreter instead.
DEFAULT_START_METHOD = "fork"


def agent_argv(
    *,
    python: str,
    run_id: str,
    nnodes: int,
    nproc_per_node: int,
    rdzv_endpoint: str,
    local_addr: str,
    max_restarts: int,
    is_rdzv_host: bool | None,
    join_timeout: float | None,
    extra_args: Sequence[str],
    bootstrap_script: str = BOOTSTRAP_SCRIPT,
) -> tuple[str, ...]:
    """The command line of one node's torchrun agent.

    The agent is ``torch.distributed.run`` itself, entered through ``sparktorch_ops.node.agent`` so
    that it dies with its parent. Every rank runs ``sparktorch_ops.rank.bootstrap`` in torchrun's
    ``--run-path`` mode, forked from the agent (``--start-method``, which ``extra_args`` may
    override), and the bootstrap forks the process that runs the user's function or script.

    Args:
        python: the interpreter on the node.
        run_id: the run's id; also the rendezvous id.
        nnodes: number of torchrun agents (1 in local mode, one per barrier task).
        nproc_per_node: ranks this agent starts.
        rdzv_endpoint: ``host:port`` of the c10d rendezvous store (port 0 lets the store bind
            a free port itself, which only the local mode can use).
        local_addr: this node's address, used for MASTER_ADDR when it hosts rank 0.
        max_restarts: torchrun's ``--max-restarts``.
        is_rdzv_host: whether this agent hosts the rendezvous store (None: torchrun decides).
        join_timeout: seconds the rendezvous waits for all nodes (None: torchrun's default).
        extra_args: user torchrun options, already validated.
        bootstrap_script: the ranks' bootstrap file (:data:`TASK_BOOTSTRAP_SCRIPT` where the
            node fills in its own copy).
    """
    conf = []
    if is_rdzv_host is not None:
        conf.append(f"is_host={'true' if is_rdzv_host else 'false'}")
    if join_timeout is not None:
        conf.append(f"join_timeout={max(1, int(join_timeout))}")
    argv = [
        python,
        "-m",
        AGENT_MODULE,
        run_id,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        f"--local-addr={local_addr}",
    ]
    if conf:
        argv.append(f"--rdzv-conf={','.join(conf)}")
    argv.extend(["--run-path", f"--start-method={DEFAULT_START_METHOD}"])
    argv.extend(extra_args)
    argv.extend([bootstrap_script, run_id])
    return tuple(argv)


def run_env(spec: Any) -> dict[str, str]:
    """What every rank's environment adds for the job's options: the user's ``env``, the
    checkpoint locations, and a store per restart attempt when restarts are allowed."""
    env = dict(spec.env)
    if spec.checkpoint_dir is not None:
        env[CHECKPOINT_DIR_ENV] = spec.checkpoint_dir
    if spec.warm_start_from is not None:
        env[WARM_START_ENV] = spec.warm_start_from
    if spec.max_restarts > 0:
        env.setdefault(UNSHARED_STORE_ENV, "1")
    return env


def local_omp_threads(cpu_count: int | None, num_processes: int) -> int:
    """Threads per rank in local mode: the driver's cores shared evenly (torchrun says 1)."""
    return max(1, (cpu_count or 1) // num_processes)


def barrier_omp_threads(task_cpus: int, ranks_per_task: int) -> int:
    """Threads per rank in barrier mode: the task's ``spark.task.cpus`` shared by its ranks."""
    return max(1, task_cpus // ranks_per_task)


def barrier_layout(
    num_processes: int, use_gpu: bool, task_gpu_amount: float | None
) -> BarrierLayout:
    """Tasks and ranks per task: one rank per task, or k per task with k GPUs per task.

    Raises:
        ResourceError: ``use_gpu`` without an integral ``spark.task.resource.gpu.amount``.
        ConfigError: ``num_processes`` not a multiple of the GPUs per task.
    """
    if not use_gpu:
        return BarrierLayout(num_tasks=num_processes, ranks_per_task=1)
    if task_gpu_amount is None:
        raise ResourceError(
            "use_gpu",
            "spark.task.resource.gpu.amount is not set, so Spark assigns no GPUs to tasks; "
            "set it (and a GPU discovery script) to the GPUs per task, or pass use_gpu=False "
            "to run on CPU",
        )
    if task_gpu_amount < 1 or task_gpu_amount != int(task_gpu_amount):
        raise ResourceError(
            "use_gpu",
            f"spark.task.resource.gpu.amount={task_gpu_amount:g} is fractional; each rank "
            "needs a whole GPU, so set it to a whole number (GPUs per task)",
        )
    per_task = int(task_gpu_amount)
    if num_processes % per_task:
        raise ConfigError(
            "num_processes",
            f"{num_processes} is not a multiple of spark.task.resource.gpu.amount={per_task} "
            "(ranks per task); use a multiple of it",
        )
    return BarrierLayout(num_tasks=num_processes // per_task, ranks_per_task=per_task)


def select_local_gpus(
    num_processes: int,
    *,
    spark_driver_gpus: Sequence[str] | None,
    cuda_visible_devices: str | None,
    device_count: int,
) -> list[str]:
    """The driver GPUs a local-mode run takes, the same list for every rank.

    Sources in order: the Spark session's ``spark.driver.resource.gpu`` addresses (indices into
    a preset ``CUDA_VISIBLE_DEVICES``, as in pyspark), a preset ``CUDA_VISIBLE_DEVICES`` (sliced,
    not ignored), else the devices the machine has. The first ``num_processes`` are taken, so
    ``cuda:LOCAL_RANK`` is a distinct GPU for every rank.

    Raises:
        ResourceError: fewer GPUs than ranks, or none at all.
    """
    if spark_driver_gpus is not None:
        available = visible_gpus(spark_driver_gpus, cuda_visible_devices)
        source = "spark.driver.resource.gpu"
    elif cuda_visible_devices is not None and cuda_visible_devices.strip() != "":
        available = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
        source = "CUDA_VISIBLE_DEVICES"
    else:
        available, source = [str(i) for i in range(device_count)], "this machine"
    if not available:
        raise ResourceError(
            "use_gpu",
            f"use_gpu=True but {source} has no GPU; pass use_gpu=False to run on CPU",
        )
    if len(available) < num_processes:
        raise ResourceError(
            "num_processes",
            f"{num_processes} ranks need {num_processes} GPUs but {source} has "
            f"{len(available)} ({','.join(available)}); lower num_processes or pass "
            "use_gpu=False to run on CPU",
        )
    return available[:num_processes]


def registration_grace(in_process_master: bool, app_age_s: float, waiting_time_s: float) -> float:
    """Seconds left to wait for executors that a young application has not seen register yet.

    Executors of a cluster application register a few seconds after the session starts; Spark's
    own scheduler waits for them up to ``spark.scheduler.maxRegisteredResourcesWaitingTime``
    after start-up, so a run launched right after ``getOrCreate()`` does the same instead of
    failing on "0 slots". An in-process master (``local[N]``) has its slots from the start and
    gets no grace, so too few slots there still fail at once.
    """
    if in_process_master:
        return 0.0
    return max(0.0, waiting_time_s - app_age_s)


def replacement_grace(
    lost: Sequence[tuple[float, str]],
    added: Sequence[float],
    replacement_wait_s: float,
    *,
    replacing: bool = False,
) -> float:
    """Seconds left to wait for executors the cluster manager is still replacing (pure).

    ``lost`` holds each removed executor's (seconds since its removal, Spark's reason);
    ``added`` each live executor's seconds since it registered. A standalone worker relaunches
    an executor whose process died within seconds (YARN and Kubernetes ask for a new one), so a
    run that starts in that gap waits for it, up to ``replacement_wait_s`` after the loss,
    rather than failing on a slot that is coming back. A loss with a later registration counts
    as replaced; a worker lost or a decommission brings nothing back and is not waited for.
    A later attempt (``replacing``) waits the whole ``replacement_wait_s`` unless every recent
    loss is of that kind: its own loss may not have reached Spark's status store yet.
    """
    recent = [(ago, reason) for ago, reason in lost if ago < replacement_wait_s]
    # Oldest first, each matched with the first registration after it.
    unmatched = sorted((ago for ago, reason in recent if not _loses_the_node(reason)), reverse=True)
    later_registrations = sorted(added, reverse=True)
    pending: list[float] = []
    for lost_ago in unmatched:
        replacement = next((a for a in later_registrations if a < lost_ago), None)
        if replacement is None:
            pending.append(lost_ago)
        else:
            later_registrations.remove(replacement)
    if replacing:
        nodes_gone = recent and all(_loses_the_node(reason) for _, reason in recent)
        return 0.0 if nodes_gone else replacement_wait_s
    return max([0.0, *(replacement_wait_s - ago for ago in pending)])


def _loses_the_node(reason: str) -> bool:
    lowered = reason.lower()
    return "worker lost" in lowered or "decommission" in lowered


def tasks_that_fit(
    required_tasks: int, fewest_tasks: int, slots: int, *, waited: bool, wait_s: float | None
) -> int:
    """How many barrier tasks an attempt runs with on ``slots`` slots: all it needs when they
    fit, else as many as fit when that is at least ``fewest_tasks`` (``min_processes``).

    Raises:
        ResourceError: fewer fit (naming ``num_processes``, and ``min_processes`` when the run
            may shrink).
    """
    if slots >= required_tasks:
        return required_tasks
    if fewest_tasks >= required_tasks:
        check_slots(required_tasks, slots, waited=waited)
    if slots >= fewest_tasks:
        return slots
    waited_for = f" after waiting {wait_s:g} s" if wait_s else ""
    raise ResourceError(
        "min_processes",
        f"the cluster has {slots} barrier task slots{waited_for}, fewer than the "
        f"{fewest_tasks} that min_processes needs (num_processes asks for {required_tasks}); "
        "lower min_processes, add executors, or raise start_timeout to wait longer for them",
    )


def check_slots(required_tasks: int, available_slots: int, *, waited: bool) -> None:
    """Fail before launch when the cluster has fewer barrier slots than tasks.

    Raises:
        ResourceError: naming ``num_processes`` and the slot counts.
    """
    if required_tasks <= available_slots:
        return
    advice = (
        "lower num_processes, add executors"
        if waited
        else "lower num_processes, add executors, or pass start_timeout= to wait for executors"
    )
    raise ResourceError(
        "num_processes",
        f"the run needs {required_tasks} barrier task slots at once but the cluster has "
        f"{available_slots} now; {advice}",
    )


# -- the run plan ----------------------------------------------------------------------------
# Values only the acting layer knows; a plan carries them as placeholders that a node fills in
# (``NodePlan.bind``), and a dry run shows them as they are.
@dataclass(frozen=True)
class RunFacts:
    """What the acting layer found out before planning; a dry run leaves the I/O ones unknown.

    Attributes:
        run_id: the run's id (also the rendezvous id and the process-table marker).
        python: the interpreter of a local-mode agent (``sys.executable``; a barrier task fills
            in its own).
        channel_address: the driver's channel listener, ``host:port``.
        channel_fingerprint: its TLS certificate's SHA-256 (None: plain TCP).
        driver_host: this machine's host name, for local mode's rank prefixes.
        cpu_count: the driver's cores (local mode's OMP_NUM_THREADS).
        local_gpus: the driver GPUs a local-mode run takes (None: CPU run or unknown).
        task_cpus: ``spark.task.cpus`` (barrier mode).
        task_gpu_amount: ``spark.task.resource.gpu.amount`` (barrier mode with GPUs).
    """

    run_id: str
    python: str
    channel_address: str = UNKNOWN
    channel_fingerprint: str | None = None
    driver_host: str = UNKNOWN
    cpu_count: int | None = None
    local_gpus: tuple[str, ...] | None = None
    task_cpus: int = 1
    task_gpu_amount: float | None = None


def plan_run(spec: Any, payload: str, facts: RunFacts) -> RunPlan:
    """The run plan of a job's options and the facts gathered for it (pure).

    Args:
        spec: the job's :class:`~sparktorch_ops.spec.LaunchSpec`.
        payload: what the ranks run, in words.
        facts: what the acting layer found out (or a dry run's unknowns).

    Raises:
        ResourceError, ConfigError: a layout the facts cannot hold (GPUs per task).
    """
    n = spec.num_processes
    if spec.local_mode:
        # One agent with every rank; its store binds a free loopback port itself.
        layout = BarrierLayout(num_tasks=1, ranks_per_task=n)
        endpoint, local_addr, is_host = "127.0.0.1:0", "127.0.0.1", None
        bootstrap, python = BOOTSTRAP_SCRIPT, facts.python
        hosts = facts.driver_host
        omp: int | None = local_omp_threads(facts.cpu_count, n) if facts.cpu_count else None
        gpus: str | None = None
        if spec.use_gpu:
            gpus = ",".join(facts.local_gpus) if facts.local_gpus is not None else UNKNOWN
    else:
        # One agent per barrier task; task 0's process hosts the store, found at run time.
        layout = barrier_layout(n, spec.use_gpu, facts.task_gpu_amount)
        endpoint, local_addr, is_host = RDZV_ENDPOINT, NODE_HOST, False
        bootstrap, python = TASK_BOOTSTRAP_SCRIPT, NODE_PYTHON
        hosts, omp = NODE_HOST, barrier_omp_threads(facts.task_cpus, layout.ranks_per_task)
        gpus = TASK_GPUS if spec.use_gpu else None
    per = layout.ranks_per_task
    argv = agent_argv(
        python=python,
        run_id=facts.run_id,
        nnodes=layout.num_tasks,
        nproc_per_node=per,
        rdzv_endpoint=endpoint,
        local_addr=local_addr,
        max_restarts=spec.max_restarts,
        is_rdzv_host=is_host,
        join_timeout=spec.start_timeout,
        extra_args=spec.torchrun_args,
        bootstrap_script=bootstrap,
    )
    nodes = tuple(
        NodePlan(
            node=i,
            ranks=tuple(range(i * per, (i + 1) * per)),
            argv=argv,
            user_env=run_env(spec),
            host=hosts,
            cuda_visible_devices=gpus,
            omp_threads=omp,
        )
        for i in range(layout.num_tasks)
    )
    return RunPlan(
        run_id=facts.run_id,
        mode=spec.mode,
        num_processes=n,
        layout=layout,
        channel_address=facts.channel_address,
        payload=payload,
        nodes=nodes,
        channel_fingerprint=facts.channel_fingerprint,
    )
