"""A flow served by a Prefect runner, for the cancellation tests: its training sleeps until
the run is cancelled, on local ranks (``local_mode=True``) or on Spark barrier tasks of an
embedded ``local[2]`` session. Run as a script: ``python served_flow.py [NAME]`` serves
deployment ``sleepy-training/NAME`` (default ``test``) until stopped."""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from sparktorch_ops.prefect import run_torch_distributor

#: The barrier-mode session the flow starts (2 slots: one barrier task per rank).
BARRIER_SPARK_CONF = {"spark.master": "local[2]", "spark.ui.showConsoleProgress": "false"}


def sleep_in_every_rank(marker_dir: str) -> None:
    """Write this rank's run id to ``marker_dir/rank<N>``, then sleep."""
    import os
    import time

    with open(os.path.join(marker_dir, f"rank{os.environ['RANK']}"), "w") as handle:
        handle.write(os.environ["SPARKTORCH_OPS_RUN_ID"])
    time.sleep(600)


@flow(name="sleepy-training")
def sleepy_training(marker_dir: str, local_mode: bool = True) -> Any:
    """Train (sleep) on 2 ranks: local processes, or barrier tasks on an embedded Spark; never
    returns (the ranks sleep until the run is cancelled)."""
    return run_torch_distributor(
        sleep_in_every_rank,
        (marker_dir,),
        num_processes=2,
        local_mode=local_mode,
        use_gpu=False,
        spark_conf=None if local_mode else BARRIER_SPARK_CONF,
    )


if __name__ == "__main__":
    sleepy_training.serve(name=sys.argv[1] if len(sys.argv) > 1 else "test")
