"""The run plan: what a launch will do, decided on the driver before anything starts, and
carried to every node (a barrier task fills in what only it learns: its host, the rendezvous
endpoint, its GPUs). Pure data and pure functions, standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparktorch_ops.errors import ResourceError
from sparktorch_ops.wire.env import (
    CHANNEL_ENV,
    FINGERPRINT_ENV,
    LAUNCHER_PID_ENV,
    NODE_HOST_ENV,
    PAYLOAD_ENV,
    RUN_ID_ENV,
    SECRET_FILE_ENV,
    TORCH_GROUP_VARIABLES,
    strip_tracking_env,
)


@dataclass(frozen=True)
class BarrierLayout:
    """How ranks map onto barrier tasks: ``num_tasks`` tasks of ``ranks_per_task`` ranks each."""

    num_tasks: int
    ranks_per_task: int


def agent_env(
    base_env: Mapping[str, str],
    user_env: Mapping[str, str],
    *,
    run_id: str,
    channel: str,
    fingerprint: str | None,
    secret_path: str,
    payload_path: str,
    host: str,
    omp_threads: int | None,
    cuda_visible_devices: str | None,
) -> dict[str, str]:
    """The environment of one node's agent; torchrun passes it on to every rank it starts.

    ``user_env`` wins over ``base_env`` (which loses MLflow's tracking URI and credentials:
    ranks never talk to MLflow; and any other torch group's ranks and rendezvous,
    :data:`~sparktorch_ops.wire.env.TORCH_GROUP_VARIABLES`); OMP_NUM_THREADS is set only where
    neither sets it (Spark itself exports ``spark.task.cpus`` there for its Python workers);
    CUDA_VISIBLE_DEVICES is set whenever GPUs were assigned, and left as the node has it for CPU
    runs.
    """
    # Ranks never talk to MLflow: the driver tracks the run (only the user's env= may say so).
    env = {k: v for k, v in strip_tracking_env(base_env).items() if k not in TORCH_GROUP_VARIABLES}
    env.update(user_env)
    env[RUN_ID_ENV] = run_id
    env[CHANNEL_ENV] = channel
    env[SECRET_FILE_ENV] = secret_path
    if fingerprint is not None:
        env[FINGERPRINT_ENV] = fingerprint
    else:
        env.pop(FINGERPRINT_ENV, None)
    env[PAYLOAD_ENV] = payload_path
    env[NODE_HOST_ENV] = host
    if omp_threads is not None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def visible_gpus(addresses: Sequence[str], cuda_visible_devices: str | None) -> list[str]:
    """The devices Spark's GPU addresses name, read as pyspark's TorchDistributor reads them.

    Where the process already has ``CUDA_VISIBLE_DEVICES`` (a container runtime that exposes
    only some devices sets it, and Spark's discovery script numbers those from 0), an address
    is an index into that list; otherwise the addresses are the devices themselves.

    Raises:
        ResourceError: with a preset list, an address that is not an index into it.
    """
    if cuda_visible_devices is None or cuda_visible_devices.strip() == "":
        return list(addresses)
    visible = [device.strip() for device in cuda_visible_devices.split(",") if device.strip()]
    devices = []
    for address in addresses:
        if not (address.isdigit() and int(address) < len(visible)):
            raise ResourceError(
                "use_gpu",
                f"Spark's GPU address {address!r} is not an index into CUDA_VISIBLE_DEVICES="
                f"{cuda_visible_devices!r}: make the GPU discovery script report indices of "
                "the visible devices, or unset CUDA_VISIBLE_DEVICES",
            )
        devices.append(visible[int(address)])
    return devices


PAYLOAD_PATH = "<payload_path>"  # where the launcher writes the rank's payload
SECRET_PATH = "<secret_path>"  # where the launcher writes the run's secret (mode 0600)
NODE_HOST = "<node_host>"  # the barrier task's host, from Spark's task infos
RDZV_ENDPOINT = "<rdzv_endpoint>"  # task 0's rendezvous store, learnt during the run
TASK_GPUS = "<task_gpus>"  # the barrier task's GPU addresses, from Spark's task resources
PACKAGE_ROOT = "<package_root>"  # the directory of the node's own copy of sparktorch_ops
NODE_PYTHON = "<node_python>"  # the barrier task's interpreter (Spark's PYSPARK_PYTHON there)
UNKNOWN = "<unknown>"  # a fact a dry run did not gather (no I/O)
_NODE_PLACEHOLDERS = (NODE_HOST, RDZV_ENDPOINT, TASK_GPUS, PACKAGE_ROOT, NODE_PYTHON, UNKNOWN)
#: Where the ranks' bootstrap lies under a package root (torchrun runs it as a file).
BOOTSTRAP_IN_ROOT = "sparktorch_ops/rank/bootstrap.py"


@dataclass(frozen=True)
class AgentPlan:
    """How one node's torchrun agent is started, every placeholder filled: argv and env."""

    argv: tuple[str, ...]
    env: dict[str, str]


@dataclass(frozen=True)
class NodePlan:
    """One torchrun agent: the driver in local mode, one barrier task otherwise.

    Attributes:
        node: the node's index (the barrier partition).
        ranks: the global ranks it starts.
        argv: the agent's command line (may hold ``NODE_HOST`` / ``RDZV_ENDPOINT``).
        user_env: the user's ``env``.
        host: the node's host name, or ``NODE_HOST``.
        cuda_visible_devices: the GPUs its ranks see, ``TASK_GPUS``, ``UNKNOWN``, or None
            (a CPU run: left as the node has it).
        omp_threads: OMP_NUM_THREADS for its ranks, unless the node or the user sets it.
    """

    node: int
    ranks: tuple[int, ...]
    argv: tuple[str, ...]
    user_env: Mapping[str, str]
    host: str
    cuda_visible_devices: str | None
    omp_threads: int | None

    def env(
        self, base_env: Mapping[str, str], *, run_id: str, channel: str, fingerprint: str | None
    ) -> dict[str, str]:
        """The agent's environment over ``base_env`` (placeholders not yet filled)."""
        return agent_env(
            base_env,
            self.user_env,
            run_id=run_id,
            channel=channel,
            fingerprint=fingerprint,
            secret_path=SECRET_PATH,
            payload_path=PAYLOAD_PATH,
            host=self.host,
            omp_threads=self.omp_threads,
            cuda_visible_devices=self.cuda_visible_devices,
        )

    def bind(
        self,
        base_env: Mapping[str, str],
        *,
        run_id: str,
        channel: str,
        fingerprint: str | None,
        payload_path: str,
        secret_path: str,
        launcher_pid: int,
        host: str | None = None,
        rdzv_endpoint: str | None = None,
        gpus: Sequence[str] | None = None,
        package_root: str | None = None,
        python: str | None = None,
    ) -> AgentPlan:
        """Fill in what the node learnt (pure): the agent's exact argv and environment.

        Raises:
            ValueError: a placeholder is left without its value.
        """
        values = {PAYLOAD_PATH: payload_path, SECRET_PATH: secret_path}
        if host is not None:
            values[NODE_HOST] = host
        if rdzv_endpoint is not None:
            values[RDZV_ENDPOINT] = rdzv_endpoint
        if gpus is not None:
            values[TASK_GPUS] = ",".join(gpus)
        if package_root is not None:
            values[PACKAGE_ROOT] = package_root
        if python is not None:
            values[NODE_PYTHON] = python

        def fill(text: str) -> str:
            for placeholder, value in values.items():
                text = text.replace(placeholder, value)
            if any(p in text for p in _NODE_PLACEHOLDERS):
                raise ValueError(f"unfilled placeholder in {text!r}")
            return text

        env = self.env(base_env, run_id=run_id, channel=channel, fingerprint=fingerprint)
        # Every value this plan wrote (over the node's own, which are left as they are).
        ours = self.env({}, run_id=run_id, channel=channel, fingerprint=fingerprint)
        filled = {k: fill(v) if ours.get(k) == v else v for k, v in env.items()}
        filled[LAUNCHER_PID_ENV] = str(launcher_pid)
        return AgentPlan(tuple(fill(a) for a in self.argv), filled)


@dataclass(frozen=True)
class RunPlan:
    """Everything a launch will do, decided before anything starts.

    Attributes:
        run_id: the run's id.
        mode: ``"local"`` or ``"barrier"``.
        num_processes: total ranks.
        layout: nodes (agents) and ranks per node.
        channel_address: the driver's listener (or ``UNKNOWN`` in a dry run).
        channel_fingerprint: its TLS certificate's SHA-256 (None: plain TCP).
        payload: what every rank runs, in words.
        nodes: one plan per node.
    """

    run_id: str
    mode: str
    num_processes: int
    layout: BarrierLayout
    channel_address: str
    payload: str
    nodes: tuple[NodePlan, ...]
    channel_fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe view (what ``--dry-run`` prints; the secret is never in a plan)."""
        nodes = []
        for node in self.nodes:
            env = node.env(
                {},
                run_id=self.run_id,
                channel=self.channel_address,
                fingerprint=self.channel_fingerprint,
            )
            nodes.append(
                {
                    "node": node.node,
                    "ranks": list(node.ranks),
                    "host": node.host,
                    "gpus": node.cuda_visible_devices,
                    "argv": list(node.argv),
                    "env": dict(sorted(env.items())),
                }
            )
        return {
            "run_id": self.run_id,
            "mode": self.mode,
            "num_processes": self.num_processes,
            "nodes_count": self.layout.num_tasks,
            "ranks_per_node": self.layout.ranks_per_task,
            "channel_address": self.channel_address,
            "channel_tls": self.channel_fingerprint is not None,
            "payload": self.payload,
            "placeholders": {
                PAYLOAD_PATH: "written by the launcher where the node runs",
                SECRET_PATH: "the run's secret, written by the launcher (mode 0600)",
                NODE_HOST: "the barrier task's host (Spark's task infos)",
                RDZV_ENDPOINT: "task 0's rendezvous store, learnt during the run",
                TASK_GPUS: "the barrier task's GPU addresses (Spark's task resources)",
                PACKAGE_ROOT: "the barrier task's copy of sparktorch_ops (shipped by the driver)",
                NODE_PYTHON: "the barrier task's Python (PYSPARK_PYTHON on the executors)",
                UNKNOWN: "a fact that a dry run does not gather",
            },
            "nodes": nodes,
        }
