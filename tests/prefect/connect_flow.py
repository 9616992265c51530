"""A flow that trains in barrier mode on a saved ``SparkCluster`` block whose master is a Spark
Connect URL, for the Spark Connect test. Run as a script in a process of its own (no classic
SparkContext to reuse instead, no Connect client state left in the test process):
``python connect_flow.py CLUSTER_BLOCK OUT_JSON`` writes the flow run's id, state and value.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from prefect import flow

from sparktorch_ops.prefect import run_torch_distributor


def all_reduce_ranks() -> dict[str, Any]:
    """Every rank adds ``rank + 1`` with gloo and reports it; rank 0 returns the sum."""
    import torch
    import torch.distributed as dist

    from sparktorch_ops import report

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        print(f"rank {rank} all-reduced {total.item():g}", flush=True)
        report(step=0, progress=1.0, contributed=rank + 1)
        return {"sum": total.item(), "world_size": dist.get_world_size()}
    finally:
        dist.destroy_process_group()


@flow(name="connect-training")
def connect_training(cluster: str) -> dict[str, Any]:
    """Train on 2 barrier tasks of the cluster block named ``cluster``."""
    return run_torch_distributor(
        all_reduce_ranks,
        num_processes=2,
        local_mode=False,
        use_gpu=False,
        cluster=cluster,
        start_timeout=120,
        artifact_key="connect-job",
    )


if __name__ == "__main__":
    state = connect_training(sys.argv[1], return_state=True)
    outcome = {
        "flow_run_id": str(state.state_details.flow_run_id),
        "completed": state.is_completed(),
        "message": state.message,
        "value": state.result() if state.is_completed() else None,
    }
    with open(sys.argv[2], "w") as out:
        json.dump(outcome, out)
