"""The core imports without Airflow, Prefect, torch or pyspark; report() works anywhere."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from sparktorch_ops import report
from tests.support.blocking import FRAMEWORKS, blocker_source

BLOCKER = blocker_source(FRAMEWORKS)


def test_core_imports_with_frameworks_blocked() -> None:
    code = BLOCKER + (
        "import sparktorch_ops\n"
        "from sparktorch_ops import TorchDistributor, report, ConfigError, RunResult\n"
        "import sparktorch_ops.distributor, sparktorch_ops.cli, sparktorch_ops.node.task\n"
        "from sparktorch_ops import DeepspeedTorchDistributor, lightning_trainer_kwargs\n"
        "TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)\n"
        "DeepspeedTorchDistributor(numGpus=2, useGpu=False)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_report_outside_a_run_warns_and_does_nothing() -> None:
    with pytest.warns(RuntimeWarning, match="outside a sparktorch_ops run"):
        report(loss=1.0)


def test_report_validates_its_arguments() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="progress"):
            report(progress=1.5)
        with pytest.raises(TypeError, match="weights"):
            report(weights=[1, 2, 3])
