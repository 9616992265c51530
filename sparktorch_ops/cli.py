"""``sparktorch-ops run``: launch a training script like torchrun, locally or on Spark.

    sparktorch-ops run [--num-processes N] [--local-mode|--no-local-mode] [--use-gpu]
                       [--master URL] [--conf k=v ...] [--dry-run] [OPTIONS] SCRIPT [-- ARGS...]
    sparktorch-ops submit [the same options] SCRIPT [-- ARGS...]    (prints its run directory)
    sparktorch-ops submit --deploy-mode cluster --dry-run [the same options] SCRIPT
    sparktorch-ops status RUN | logs RUN [--follow] | wait RUN [--timeout S] | cancel RUN
    sparktorch-ops list [--root DIR]

Every launch option of :class:`~sparktorch_ops.TorchDistributor` that a command line can give
has a flag (``--timeout``, ``--env KEY=VALUE``, ``--mlflow-experiment``, ...: ``--help`` lists
them, from :mod:`sparktorch_ops.options`).

Rank output is printed with rank prefixes; the exit status is the run's
(:mod:`sparktorch_ops.outcome`): 0 on success, the failing rank's exit code (or 1) on a training
failure, 2 for bad arguments, 124 on a timeout, 130 when interrupted (SIGINT/SIGTERM cancel the
run and tear everything down first). ``--dry-run`` prints the run plan as JSON and starts
nothing. Arguments are checked before Spark starts.

``submit`` starts the same run detached (its driver in a process of its own, which outlives
this command) and prints its run directory; ``status``, ``logs``, ``wait`` and ``cancel`` take
that directory (``wait`` exits as ``run`` would have), ``list`` the runs under a root
(``$SPARKTORCH_RUNS`` by default). ``submit --deploy-mode cluster --dry-run`` prints the
``spark-submit`` command that runs the detached driver on a YARN or Kubernetes cluster instead
(``--run-dir`` on storage the cluster reaches; this sparktorch_ops zipped for it), and starts
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from sparktorch_ops import options
from sparktorch_ops.errors import ConfigError, SparkTorchError, outcome_of
from sparktorch_ops.job import CancelToken, TrainingJob, build_job
from sparktorch_ops.spark.session import SparkSettings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparktorch-ops", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _run_arguments(commands.add_parser("run", help="run a training script under torchrun"))
    submit = commands.add_parser("submit", help="start a training script detached; print its run")
    _run_arguments(submit)
    submit.add_argument(
        "--deploy-mode",
        choices=("client", "cluster"),
        default="client",
        help="where the detached driver runs: this machine (client), or a YARN or Kubernetes "
        "cluster (cluster, with --dry-run: prints the spark-submit command)",
    )
    for name, text in (
        ("status", "where a detached run is (JSON)"),
        ("logs", "a detached run's log lines"),
        ("wait", "wait for a detached run; exit as run would have"),
        ("cancel", "stop a detached run"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("run_dir", metavar="RUN", help="the run's directory")
        if name == "logs":
            command.add_argument("--follow", action="store_true", help="until the run ends")
        if name == "wait":
            command.add_argument("--timeout", type=float, help="seconds, at most")
    listing = commands.add_parser("list", help="the detached runs under a directory")
    listing.add_argument("--root", help="default: $SPARKTORCH_RUNS")
    return parser


def _run_arguments(run: argparse.ArgumentParser) -> None:
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
    options.add_cli_flags(run)
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the run plan as JSON (the secret redacted) and start nothing",
    )
    run.add_argument("script", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")


def _conf(items: Sequence[str]) -> dict[str, str]:
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--conf", f"expected KEY=VALUE, got {item!r}")
        conf[key] = value
    return conf


def _job(args: argparse.Namespace, logger: logging.Logger, token: CancelToken) -> TrainingJob:
    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    local_mode = args.local_mode if args.local_mode is not None else args.spark_master is None
    values = {**options.cli_values(args), "local_mode": local_mode}
    if args.command == "submit":
        values["detached"] = True
    return build_job(
        train=args.script,
        train_args=script_args,
        spark=SparkSettings(master=args.spark_master, conf=_conf(args.spark_conf or ())),
        logger=logger,
        cancel_token=token,
        **values,
    )


def _run_command(args: argparse.Namespace) -> int:
    """``status``, ``logs``, ``wait``, ``cancel`` and ``list``: on run directories."""
    from sparktorch_ops.detached.handle import RunHandle
    from sparktorch_ops.detached.submit import runs_root

    if args.command == "list":
        root = Path(args.root) if args.root else runs_root()
        for directory in sorted(root.iterdir()) if root.is_dir() else []:
            try:
                status = RunHandle(directory).status()
            except SparkTorchError:
                continue
            print(f"{status.training_id}\t{status.state}\t{status.run_dir}")
        return 0
    handle = RunHandle(args.run_dir)
    if args.command == "status":
        print(json.dumps(dataclasses.asdict(handle.status()), indent=2))
    elif args.command == "logs":
        for line in handle.logs(follow=args.follow):
            print(line, flush=True)
    elif args.command == "cancel":
        handle.cancel("cancelled with sparktorch-ops cancel")
        print(f"sparktorch-ops: asked the run in {handle.run_dir} to stop")
    else:
        try:
            result = handle.wait(args.timeout)
        except TimeoutError as exc:
            print(f"sparktorch-ops: {exc}", file=sys.stderr)
            return 124
        print(
            f"sparktorch-ops: {result.num_processes} ranks finished in "
            f"{result.duration.total_seconds():.1f} s"
        )
    return 0


def _cluster_dry_run(job: TrainingJob, dry_run: bool) -> int:
    """Print the ``spark-submit`` command that runs ``job``'s detached driver on the cluster."""
    from sparktorch_ops.detached.submit import cluster_command

    if not dry_run:
        raise ConfigError(
            "--deploy-mode",
            "cluster is a dry run here: add --dry-run to print the spark-submit command that "
            "runs the detached driver on the cluster; without --deploy-mode it runs here",
        )
    print(shlex.join(cluster_command(job)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sparktorch-ops`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command not in ("run", "submit"):
        try:
            return _run_command(args)
        except SparkTorchError as exc:
            outcome = outcome_of(exc)
            print(f"sparktorch-ops: {outcome.message}", file=sys.stderr)
            return outcome.exit_status
    logger = logging.getLogger("sparktorch_ops.cli")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    token = CancelToken()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: token.cancel("interrupted by a signal"))

    from sparktorch_ops.distributor import launch_job, plan_job

    try:
        job = _job(args, logger, token)  # every check, before Spark starts
        if args.command == "submit" and args.deploy_mode == "cluster":
            return _cluster_dry_run(job, args.dry_run)
        if args.dry_run:
            print(json.dumps(plan_job(job).to_dict(), indent=2))
            return 0
        if args.command == "submit":
            from sparktorch_ops.detached.submit import submit

            print(submit(job).run_dir)
            return 0
        result = launch_job(job)
    except SparkTorchError as exc:
        outcome = outcome_of(exc)
        print(f"sparktorch-ops: {outcome.message}", file=sys.stderr)
        return outcome.exit_status
    logger.info(
        "sparktorch-ops: %d ranks finished in %.1f s",
        result.num_processes,
        result.duration.total_seconds(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
