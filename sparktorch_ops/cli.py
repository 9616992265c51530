"""``sparktorch-ops run``: launch a training script like torchrun, locally or on Spark.

    sparktorch-ops run [--num-processes N] [--local-mode|--no-local-mode] [--use-gpu]
                       [--master URL] [--conf k=v ...] SCRIPT [-- ARGS...]

Rank output is printed with rank prefixes; the exit status is the run's: 0 on success, the
failing rank's exit code (or 1) on a training failure, 2 for bad arguments, 124 on a timeout,
130 when interrupted (SIGINT/SIGTERM cancel the run and tear everything down first).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from sparktorch_ops.errors import (
    ConfigError,
    SparkTorchError,
    StartTimeoutError,
    TrainingCancelledError,
    TrainingFailedError,
    TrainingTimeoutError,
)

EXIT_CONFIG = 2
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparktorch-ops", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a training script under torchrun")
    run.add_argument("--num-processes", type=int, default=1, help="total ranks (default 1)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument(
        "--local-mode",
        dest="local_mode",
        action="store_true",
        default=None,
        help="run the ranks on this machine (the default without --master)",
    )
    mode.add_argument(
        "--no-local-mode",
        dest="local_mode",
        action="store_false",
        help="run one rank per Spark barrier task",
    )
    run.add_argument("--use-gpu", action="store_true", help="give each rank a GPU")
    run.add_argument("--master", help="Spark master URL (implies --no-local-mode unless given)")
    run.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Spark configuration, repeatable",
    )
    run.add_argument("--max-restarts", type=int, default=0)
    run.add_argument("--timeout", type=float, default=None, help="seconds the run may take")
    run.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds to wait for slots, executors and the rendezvous",
    )
    run.add_argument("script", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    return parser


def _spark_session(master: str | None, conf: Sequence[str]) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparktorch-ops")
    if master:
        builder = builder.master(master)
    for item in conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--conf", f"expected KEY=VALUE, got {item!r}")
        builder = builder.config(key, value)
    return builder.getOrCreate()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparktorch-ops`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    local_mode = args.local_mode if args.local_mode is not None else args.master is None
    logger = logging.getLogger("sparktorch_ops.cli")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    from sparktorch_ops.distributor import TorchDistributor

    spark = None
    try:
        if not local_mode or args.conf or args.master:
            spark = _spark_session(args.master, args.conf)
        distributor = TorchDistributor(
            num_processes=args.num_processes,
            local_mode=local_mode,
            use_gpu=args.use_gpu,
            spark=spark,
            logger=logger,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            start_timeout=args.start_timeout,
        )
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: distributor.cancel())
        result = distributor.launch(args.script, *script_args)
        logger.info(
            "sparktorch-ops: %d ranks finished in %.1f s",
            result.num_processes,
            result.duration.total_seconds(),
        )
        return 0
    except ConfigError as exc:
        print(f"sparktorch-ops: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except TrainingFailedError as exc:
        print(f"sparktorch-ops: training failed: {exc}", file=sys.stderr)
        first = exc.first_failure
        return first.exit_code if first and first.exit_code else 1
    except (StartTimeoutError, TrainingTimeoutError) as exc:
        print(f"sparktorch-ops: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except TrainingCancelledError as exc:
        print(f"sparktorch-ops: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SparkTorchError as exc:
        print(f"sparktorch-ops: {exc}", file=sys.stderr)
        return 1
    finally:
        if spark is not None:
            spark.stop()


if __name__ == "__main__":
    sys.exit(main())
