"""The DDP training of ddp_train.py, run as a function through TorchDistributor.

    python examples/ddp_function.py                 # 2 ranks on this machine, no Spark
    python examples/ddp_function.py --barrier       # 2 barrier tasks on local[2] Spark

The function comes from a module the executors cannot import (this examples folder): it is
shipped by value. ``run`` returns rank 0's return value.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ddp_train import train

from sparktorch_ops import TorchDistributor


def main() -> None:
    """Run the training on 2 ranks and print what rank 0 returned."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--barrier", action="store_true", help="run on local[2] Spark")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spark = None
    if args.barrier:
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    distributor = TorchDistributor(
        num_processes=2, local_mode=not args.barrier, use_gpu=False, spark=spark
    )
    result = distributor.launch(train, epochs=args.epochs)
    value = result.value
    print(f"losses: {[round(x, 4) for x in value['losses']]}")
    print(
        f"test accuracy: {value['test_accuracy']:.3f}; took {result.duration.total_seconds():.1f} s"
    )


if __name__ == "__main__":
    main()
