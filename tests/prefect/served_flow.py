"""A flow served by a Prefect runner, for the cancellation test: its training sleeps until
the run is cancelled. Run as a script: ``python served_flow.py`` serves deployment
``sleepy-training/test`` until stopped."""

from __future__ import annotations

from prefect import flow

from sparktorch_ops.prefect import run_torch_distributor


def sleep_in_every_rank(marker_dir: str) -> None:
    """Write this rank's run id to ``marker_dir/rank<N>``, then sleep."""
    import os
    import time

    with open(os.path.join(marker_dir, f"rank{os.environ['RANK']}"), "w") as handle:
        handle.write(os.environ["SPARKTORCH_OPS_RUN_ID"])
    time.sleep(600)


@flow(name="sleepy-training")
def sleepy_training(marker_dir: str) -> None:
    """Train (sleep) on 2 local ranks."""
    run_torch_distributor(
        sleep_in_every_rank, (marker_dir,), num_processes=2, local_mode=True, use_gpu=False
    )


if __name__ == "__main__":
    sleepy_training.serve(name="test")
