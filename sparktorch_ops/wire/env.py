"""The environment contract: every variable the processes of a run pass each other.

The driver (planning) sets them, the barrier task and the agent pass them on, the ranks read
them. Variables that change from one run to the next are declared with :func:`_per_run`: a warm
agent process (started once, serving many runs) must not carry them, and a new one cannot be
forgotten there. Standard library only: every side imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping

_PER_RUN: set[str] = set()


def _per_run(name: str) -> str:
    _PER_RUN.add(name)
    return name


# -- the run -------------------------------------------------------------------------------
#: The run's id; doubles as the marker that finds every process of a run in the process table.
RUN_ID_ENV = _per_run("SPARKTORCH_OPS_RUN_ID")
#: Where the driver's channel listens (``host:port``).
CHANNEL_ENV = _per_run("SPARKTORCH_OPS_CHANNEL")
#: The run's secret is in a private file (never in the environment: ranks print it).
SECRET_FILE_ENV = _per_run("SPARKTORCH_OPS_SECRET_FILE")
#: The fingerprint of the channel's TLS certificate (public).
FINGERPRINT_ENV = _per_run("SPARKTORCH_OPS_CHANNEL_FINGERPRINT")
#: The file holding what the ranks run.
PAYLOAD_ENV = _per_run("SPARKTORCH_OPS_PAYLOAD")
#: The address the node is reached on (the ranks report it).
NODE_HOST_ENV = _per_run("SPARKTORCH_OPS_HOST")

# -- processes -----------------------------------------------------------------------------
#: The pid of the process that started a node's agent: the agent dies when that one does.
LAUNCHER_PID_ENV = _per_run("SPARKTORCH_OPS_LAUNCHER_PID")
#: The agent's pid, for the per-rank supervisor's parent watch.
AGENT_PID_ENV = _per_run("SPARKTORCH_OPS_AGENT_PID")
#: ``"REQUEST,DUMP"``: the rank's ends of its supervisor's stack line (a socket: a byte asks,
#: the rank's helper thread answers) and of the pipe faulthandler dumps into on a signal.
STACK_FDS_ENV = _per_run("SPARKTORCH_OPS_STACK_FDS")
#: Marks the warm agent in the process table (value: a token of its launcher).
WARM_PROCESS_ENV = "SPARKTORCH_OPS_WARM_PROCESS"
#: ``0`` (or ``false``/``no``/``off``) in the launcher's environment: start every agent cold.
WARM_AGENT_ENV = "SPARKTORCH_OPS_WARM_AGENT"

# -- DataFrame input -----------------------------------------------------------------------
#: The path of this rank's shard, an Arrow IPC stream file (pyspark's variable).
DATA_FILE_ENV = _per_run("SPARK_PARTITION_ARROW_DATA_FILE")
#: The path of the Spark schema of the DataFrame as JSON (pyspark's variable).
SCHEMA_FILE_ENV = _per_run("SPARK_DATAFRAME_SCHEMA_FILE")
#: Rows every rank yields per epoch of ``partition_loader``: the largest shard's rows.
EPOCH_ROWS_ENV = _per_run("SPARKTORCH_OPS_DATA_EPOCH_ROWS")
#: A file that will hold EPOCH_ROWS_ENV's value once every task has written its shards: a
#: barrier task starts its agent while it writes them, and each rank waits for the file before
#: it connects (the bootstrap sets EPOCH_ROWS_ENV from it).
EPOCH_ROWS_FILE_ENV = _per_run("SPARKTORCH_OPS_DATA_EPOCH_ROWS_FILE")
#: The directory of a node's shards; the worker sets DATA_FILE_ENV to its own (LOCAL_RANK's).
DATA_DIR_ENV = _per_run("SPARKTORCH_OPS_DATA_DIR")

# -- checkpoints ---------------------------------------------------------------------------
#: The run's checkpoint directory (a path or an fsspec URL), set on every rank.
CHECKPOINT_DIR_ENV = _per_run("SPARKTORCH_CHECKPOINT_DIR")
#: Weights to start from when there is no checkpoint to resume: a checkpoint directory (a
#: ``checkpoint_dir`` root or one step directory) or a ``torch.save(state_dict)`` file.
WARM_START_ENV = _per_run("SPARKTORCH_WARM_START_FROM")

# -- detached runs -------------------------------------------------------------------------
#: Where detached runs go when no ``run_dir`` is given (each in ``<root>/<training id>``); set
#: by the user, read by the submitting process and ``sparktorch-ops list``.
RUNS_ENV = "SPARKTORCH_RUNS"

# -- torch's own -----------------------------------------------------------------------------
#: torch's fork-safe CUDA availability check (NVML, no CUDA initialisation); the agent turns it
#: on for itself when unset and says so in NVML_CHECK_ADDED_ENV, so that ranks can drop it.
NVML_CUDA_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
NVML_CHECK_ADDED_ENV = _per_run("SPARKTORCH_OPS_NVML_CHECK_ADDED")
#: torchrun shares its rendezvous store with the ranks on one port for the whole run; a
#: restarted worker group then reads the dead group's gloo addresses (pytorch/pytorch#135712).
#: With this set, each attempt's ranks get a fresh store.
UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: The interface gloo and NCCL talk over (set per node: the one Spark reaches it on).
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"

#: Every variable that differs from run to run.
PER_RUN_VARIABLES: frozenset[str] = frozenset(_PER_RUN)

#: What torchrun sets for each rank it starts (a user's value would silently break the
#: rendezvous: ``env=`` refuses them).
TORCHRUN_RANK_VARIABLES: frozenset[str] = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
    }
)
#: What a torch launcher sets for the processes of one group: torchrun for each rank, and
#: pyspark's TorchDistributor in the Spark Python worker its task ran in (where they stay for
#: the worker's next task). An agent never passes another group's on: torchrun sets each rank's
#: own, and a stale one would make the launcher's environment differ from run to run.
TORCH_GROUP_VARIABLES: frozenset[str] = TORCHRUN_RANK_VARIABLES | {
    "ROLE_NAME",
    "NODE_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
    "PYSPARK_TORCH_DISTRIBUTOR_RDZV_ID",
}

#: Variables that would let a rank reach the tracking server (never sent there).
TRACKING_ENV_PREFIXES = ("MLFLOW_TRACKING_", "DATABRICKS_")


def strip_tracking_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the tracking URI and credentials: ranks never talk to MLflow."""
    return {k: v for k, v in env.items() if not k.startswith(TRACKING_ENV_PREFIXES)}
