"""A real Airflow for these tests: a temporary AIRFLOW_HOME with a SQLite metadata DB.

The environment is set when this file is imported, before anything imports Airflow (which
reads its configuration at import). The DAGs folder holds links to ``dags/retrain_digits.py``
and to the test DAGs in ``tests/airflow/dags``; ``airflow db migrate`` runs once per session.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_DAGS = Path(__file__).resolve().parent / "dags"

if "airflow" in sys.modules:
    raise RuntimeError(
        "tests/airflow needs its own AIRFLOW_HOME, but Airflow was imported before "
        "tests/airflow/conftest.py could set it"
    )

AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="sparktorch-airflow-"))
DAGS_FOLDER = AIRFLOW_HOME / "dags"
MIGRATED_DB = AIRFLOW_HOME / "migrated-unused.db"  # for installations of their own (harness)
DAGS_FOLDER.mkdir()
for source in [ROOT / "dags" / "retrain_digits.py", *sorted(TEST_DAGS.glob("*.py"))]:
    (DAGS_FOLDER / source.name).symlink_to(source)
atexit.register(shutil.rmtree, AIRFLOW_HOME, ignore_errors=True)

os.environ.update(
    AIRFLOW_HOME=str(AIRFLOW_HOME),
    AIRFLOW__CORE__DAGS_FOLDER=str(DAGS_FOLDER),
    AIRFLOW__CORE__LOAD_EXAMPLES="False",
    AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT="120",
    AIRFLOW__LOGGING__COLORED_CONSOLE_LOG="False",
    SPARKTORCH_STATE=str(AIRFLOW_HOME / "state"),
    # Under dag.test() the example trains attached, on this process's Spark session: its
    # deferred training runs under the real scheduler (test_real_scheduler.py), and a deferred
    # training under dag.test() in test_durable.py.
    RETRAIN_DIGITS_DEFERRABLE="false",
)
os.environ.pop("AIRFLOW__CORE__SQL_ALCHEMY_CONN", None)
os.environ.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)


@pytest.fixture(scope="session", autouse=True)
def airflow_db() -> Path:
    """The metadata DB of the temporary home, migrated once for the whole session.

    ``db.upgradedb()`` is what ``airflow db migrate`` runs; in this process it takes a few
    seconds instead of the command's dozen. A copy taken before any test writes to it is
    :data:`MIGRATED_DB`, which the real-scheduler installation starts from.
    """
    from airflow.utils import db

    db.upgradedb()
    # SQLite's backup, not a file copy: Airflow keeps the database in WAL mode, so the file
    # alone may lack the newest pages.
    with (
        contextlib.closing(sqlite3.connect(AIRFLOW_HOME / "airflow.db")) as source,
        contextlib.closing(sqlite3.connect(MIGRATED_DB)) as copy,
    ):
        source.backup(copy)
    return AIRFLOW_HOME


@dataclass
class DagRunOutcome:
    """A finished ``dag.test()`` run: its DagRun, task states and the captured log."""

    dag_id: str
    run_id: str
    state: str
    log: str
    logical_date: Any

    def task(self, task_id: str) -> Any:
        """The task instance (state, try_number) of ``task_id`` in this run."""
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            ti = session.scalar(
                select(TaskInstance).where(
                    TaskInstance.dag_id == self.dag_id,
                    TaskInstance.run_id == self.run_id,
                    TaskInstance.task_id == task_id,
                )
            )
            assert ti is not None, f"no task instance {task_id} in {self.run_id}"
            session.expunge(ti)
            return ti

    def xcom(self, task_id: str, key: str = "return_value") -> Any:
        """The XCom ``key`` that ``task_id`` pushed in this run (None when there is none)."""
        return read_xcom(self.dag_id, self.run_id, task_id, key)

    def rendered(self, task_id: str) -> dict[str, Any]:
        """The task's rendered template fields as Airflow stored them."""
        from airflow.models.renderedtifields import RenderedTaskInstanceFields
        from airflow.utils.session import create_session

        with create_session() as session:
            fields = RenderedTaskInstanceFields.get_templated_fields(
                self.task(task_id), session=session
            )
        assert fields is not None, f"no rendered fields for {task_id}"
        return dict(fields)

    def task_log(self, task_id: str) -> str:
        """The log of ``task_id``: from its start to its final state, as the API logged them
        (a deferred task's trigger and its resumption included)."""
        ti_id = re.escape(str(self.task(task_id).id))
        start = re.search(rf"Task started [^\n]*ti_id={ti_id}", self.log)
        assert start, f"no start of {task_id} in the log"
        ends = list(re.finditer(rf"new_state=\w+[^\n]*ti_id={ti_id}", self.log[start.end() :]))
        assert ends, f"no end of {task_id} in the log"
        return self.log[start.start() : start.end() + ends[-1].end()]


def read_xcom(dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
    """An XCom value from the metadata DB (None when there is none)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=run_id, key=key, dag_ids=dag_id, task_ids=task_id)
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def load_dag(dag_id: str) -> Any:
    """The DAG ``dag_id`` parsed from the session's DAGs folder, checked for import errors."""
    bag = _dag_bag()
    dag = bag.get_dag(dag_id)
    assert dag is not None, f"{dag_id} not in {sorted(bag.dag_ids)}"
    return dag


@functools.cache
def _dag_bag() -> Any:
    """The session's DAGs folder, parsed once (each parse imports every DAG file again)."""
    try:
        from airflow.dag_processing.dagbag import DagBag

        serialize = None
    except ImportError:  # Airflow before 3.2: airflow.models, and dag.test() needs it serialized
        from airflow.models.dagbag import DagBag, sync_bag_to_db

        serialize = sync_bag_to_db

    bag = DagBag(dag_folder=str(DAGS_FOLDER))
    assert not bag.import_errors, bag.import_errors
    if serialize is not None:
        from airflow.dag_processing.bundles.manager import DagBundlesManager

        DagBundlesManager().sync_bundles_to_db()
        serialize(bag, "dags-folder", None)
    return bag


@pytest.fixture(scope="session")
def run_dag(airflow_db: Path) -> Iterator[Any]:
    """``run_dag(capfd, dag_id, logical_date=None, **conf)``: run the DAG once with
    ``dag.test()``, capture its log.

    The outcome is kept for the session, so several tests can check one run of a DAG.
    """
    outcomes: dict[str, DagRunOutcome] = {}

    def run(
        capfd: pytest.CaptureFixture[str], dag_id: str, logical_date: Any = None, **conf: Any
    ) -> DagRunOutcome:
        key = f"{dag_id} {logical_date} {sorted(conf.items())}"
        if key not in outcomes:
            dag = load_dag(dag_id)
            capfd.readouterr()
            # No logical_date at all (not None, which means a run without one): now.
            dated = {} if logical_date is None else {"logical_date": logical_date}
            dag_run = dag.test(run_conf=conf or None, **dated)
            out, err = capfd.readouterr()
            outcomes[key] = DagRunOutcome(
                dag_id, dag_run.run_id, str(dag_run.state), out + err, dag_run.logical_date
            )
        outcome = outcomes[key]
        sys.stdout.write(outcome.log[-30000:])  # shown by pytest when the test fails
        return outcome

    yield run


def airflow_env(**extra: str) -> dict[str, str]:
    """The environment for an Airflow subprocess of these tests."""
    env = os.environ.copy()
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
