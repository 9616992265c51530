"""The ``sparktorch-ops`` command's checks, run in this process: bad flags are refused naming
the flag, before anything starts, and a dry run prints the plan (the runs themselves are in
tests/integration/test_cli.py)."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparktorch_ops.cli import main


@pytest.fixture(autouse=True)
def _signal_handlers_kept() -> Iterator[None]:
    """``main`` installs its SIGINT/SIGTERM handlers (it owns its process): put pytest's back."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return str(path)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--env", "NOVALUE"], "argument --env: expected KEY=VALUE, got 'NOVALUE'"),
        (["--log-ranks", "a,b"], "argument --log-ranks: expected ranks like 0,1, got 'a,b'"),
        (["--num-processes", "two"], "argument --num-processes: invalid int value: 'two'"),
    ],
)
def test_a_malformed_flag_is_a_usage_error_naming_it(
    flags: list[str], named: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", *flags, script])
    assert info.value.code == 2
    assert named in capsys.readouterr().err


def test_bad_values_are_refused_before_spark_starts_naming_the_flag(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--conf", "nokey", "--dry-run", script]) == 2
    assert "bad input: --conf: expected KEY=VALUE, got 'nokey'" in capsys.readouterr().err
    assert main(["run", "--num-processes", "0", "--dry-run", script]) == 2
    assert "num_processes" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_dry_run_on_a_cluster_master_plans_barrier_mode_with_the_script_arguments(
    command: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A master given and no --local-mode: barrier mode; --conf reaches the plan (a task's
    CPUs are its ranks' threads); what follows ``--`` goes to the script."""
    argv = [command, "--master", "spark://h:7077", "--conf", "spark.task.cpus=2"]
    assert main([*argv, "--num-processes", "2", "--dry-run", script, "--", "--lr=0.1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["mode"], plan["num_processes"], plan["nodes_count"]) == ("barrier", 2, 2)
    assert plan["payload"] == f"{script} --lr=0.1 (script)"
    assert [node["env"]["OMP_NUM_THREADS"] for node in plan["nodes"]] == ["2", "2"]


def test_a_cluster_deploy_mode_dry_run_prints_the_spark_submit_command(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The exact spark-submit that runs the detached driver on YARN (or Kubernetes), with
    this sparktorch_ops zipped for it; refused where Spark has no Python cluster mode, for a
    run directory the cluster cannot reach, and without --dry-run."""
    cluster = ["submit", "--deploy-mode", "cluster", "--conf", "spark.executor.memory=4g"]
    given = [*cluster, "--master", "yarn", "--run-dir", "hdfs:///runs/n1", "--dry-run", script]
    assert main(given) == 0
    command = shlex.split(capsys.readouterr().out)
    package = command[8]
    try:
        driver = str(Path(__file__).parents[2] / "sparktorch_ops" / "detached" / "main.py")
        assert command[:8] + command[9:] == [
            "spark-submit", "--master", "yarn", "--deploy-mode", "cluster",
            "--conf", "spark.executor.memory=4g",
            "--py-files", driver, "hdfs:///runs/n1",
        ]  # fmt: skip
        with zipfile.ZipFile(package) as archive:
            assert "sparktorch_ops/detached/main.py" in archive.namelist()
    finally:
        shutil.rmtree(Path(package).parent)
    standalone = ["--master", "spark://h:7077", "--run-dir", "hdfs:///runs/n1"]
    assert main([*cluster, *standalone, "--dry-run", script]) == 2
    assert "YARN and Kubernetes only" in capsys.readouterr().err
    assert main([*cluster, "--master", "yarn", "--dry-run", script]) == 2
    assert "is a local path" in capsys.readouterr().err
    assert main([*cluster, "--master", "yarn", "--run-dir", "hdfs:///runs/n1", script]) == 2
    assert "add --dry-run" in capsys.readouterr().err
