"""The operator's parts without a run: connection reading, result storage, provider info."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

LOG = logging.getLogger("tests.airflow")

CONNECTIONS = {
    # The UI way: conn_type spark, the master URL in host, maybe a port.
    "sto_standalone": {"conn_type": "spark", "host": "spark://10.1.2.3", "port": 7077},
    "sto_local": {"conn_type": "spark", "host": "local[4]"},
    "sto_yarn": {
        "conn_type": "spark",
        "host": "yarn",
        "extra": {"queue": "ml", "deploy-mode": "client"},
    },
    "sto_extras": {
        "conn_type": "spark",
        "host": "spark://10.1.2.4",
        "port": 7078,
        "extra": {"spark.executor.memory": "3g", "namespace": "ml-team", "deploy-mode": "cluster"},
    },
}
URI_CONNECTIONS = {"sto_from_uri": "spark://spark-master.example:7079"}


@pytest.fixture
def spark_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    for conn_id, spec in CONNECTIONS.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(spec))
    for conn_id, uri in URI_CONNECTIONS.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", uri)


@pytest.mark.usefixtures("spark_connections")
@pytest.mark.parametrize("conn_id", [*CONNECTIONS, *URI_CONNECTIONS])
def test_master_is_what_the_spark_provider_reads(conn_id: str) -> None:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from sparktorch_ops.airflow.connection import resolve_connection

    expected = SparkSubmitHook(conn_id=conn_id)._resolve_connection()
    ours = resolve_connection(conn_id, LOG)
    assert ours.master == expected["master"]
    assert ours.conn_id == conn_id


@pytest.mark.usefixtures("spark_connections")
def test_connection_extras_become_spark_settings(caplog: pytest.LogCaptureFixture) -> None:
    from sparktorch_ops.airflow.connection import resolve_connection

    with caplog.at_level(logging.WARNING, logger=LOG.name):
        extras = resolve_connection("sto_extras", LOG)
    assert extras.master == "spark://10.1.2.4:7078"
    assert extras.conf == {
        "spark.executor.memory": "3g",
        "spark.kubernetes.namespace": "ml-team",
    }
    assert "deploy-mode=cluster is ignored" in caplog.text
    assert resolve_connection("sto_yarn", LOG).conf == {"spark.yarn.queue": "ml"}


def test_default_connection_may_be_absent_others_may_not(caplog: pytest.LogCaptureFixture) -> None:
    from sparktorch_ops.airflow.connection import (
        MissingConnectionError,
        resolve_connection,
    )

    with caplog.at_level(logging.INFO, logger=LOG.name):
        fallback = resolve_connection("spark_default", LOG)
    assert (fallback.master, fallback.conn_id) == ("local[*]", None)
    assert "no connection 'spark_default': the master is spark_conf's" in caplog.text
    with pytest.raises(MissingConnectionError, match="'sto_no_such_conn' does not exist"):
        resolve_connection("sto_no_such_conn", LOG)


CONNECT_CONNECTIONS = {
    "sto_connect_plain": {"conn_type": "spark_connect", "host": "connect.example"},
    "sto_connect_port": {"conn_type": "spark_connect", "host": "connect.example", "port": 15003},
    "sto_connect_full": {
        "conn_type": "spark_connect",
        "host": "sc://connect.example",
        "port": 443,
        "login": "ml team",
        "password": "t0k en;=x",
        "extra": {"use_ssl": True, "spark.sql.shuffle.partitions": 8, "token": "not-this"},
    },
}
CONNECT_URL_FULL = "sc://connect.example:443/;user_id=ml%20team;token=t0k%20en%3B%3Dx;use_ssl=True"
# A URI's scheme is the type: Airflow reads spark-connect:// as spark_connect.
CONNECT_URI_CONNECTIONS = {
    "sto_connect_uri": "spark-connect://analyst:tok3n@connect.example:15002?use_ssl=false"
}


@pytest.fixture
def connect_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    for conn_id, spec in CONNECT_CONNECTIONS.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(spec))
    for conn_id, uri in CONNECT_URI_CONNECTIONS.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", uri)


@pytest.mark.usefixtures("connect_connections")
@pytest.mark.parametrize("conn_id", [*CONNECT_CONNECTIONS, *CONNECT_URI_CONNECTIONS])
def test_connect_url_is_what_the_spark_connect_hook_builds(conn_id: str) -> None:
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

    from sparktorch_ops.airflow.connection import resolve_connection
    from sparktorch_ops.spark.session import SparkSettings, parse_master

    expected = SparkConnectHook(conn_id=conn_id).get_connection_url()
    ours = resolve_connection(conn_id, LOG)
    assert ours.master == expected
    assert ours.conn_id == conn_id
    assert parse_master(ours.master).is_connect
    assert SparkSettings(master=ours.master, conf=ours.conf).master == expected


@pytest.mark.usefixtures("connect_connections")
def test_spark_connect_connection_fields(caplog: pytest.LogCaptureFixture) -> None:
    from sparktorch_ops.airflow.connection import resolve_connection

    assert resolve_connection("sto_connect_plain", LOG).master == "sc://connect.example/"
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        full = resolve_connection("sto_connect_full", LOG)
    assert full.master == CONNECT_URL_FULL
    # spark.* extras are session settings; the extra's token is not the provider's token.
    assert full.conf == {"spark.sql.shuffle.partitions": "8"}
    assert "the extra's token of connection sto_connect_full is ignored" in caplog.text
    assert "t0k" not in repr(full) and "token=***" in repr(full)
    uri = resolve_connection("sto_connect_uri", LOG)
    assert uri.master == "sc://connect.example:15002/;user_id=analyst;token=tok3n;use_ssl=false"


def test_a_slash_in_the_token_is_quoted_for_pyspark(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    from sparktorch_ops.airflow.connection import resolve_connection

    spec = {"conn_type": "spark_connect", "host": "h", "login": "a/b", "password": "k/L+0="}
    monkeypatch.setenv("AIRFLOW_CONN_STO_SLASH", json.dumps(spec))
    ours = resolve_connection("sto_slash", LOG).master
    assert ours == "sc://h/;user_id=a%2Fb;token=k%2FL%2B0%3D"
    builder = DefaultChannelBuilder(ours)
    assert (builder.userId, builder.token) == ("a/b", "k/L+0=")
    # The provider keeps the "/", and pyspark takes the parameters for a path.
    hook_url = SparkConnectHook(conn_id="sto_slash").get_connection_url()
    assert hook_url == ours.replace("%2F", "/")
    with pytest.raises(ValueError, match="path component"):
        DefaultChannelBuilder(hook_url)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"conn_type": "spark_connect"}, "Spark Connect connection 'sto_bad_connect' has no host"),
        (
            {"conn_type": "spark_connect", "host": "sc://connect.example/db"},
            "Spark Connect connection 'sto_bad_connect': the path '/db' is not supported",
        ),
    ],
)
def test_bad_spark_connect_connection_names_it(
    monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any], message: str
) -> None:
    from sparktorch_ops.airflow.connection import resolve_connection

    monkeypatch.setenv("AIRFLOW_CONN_STO_BAD_CONNECT", json.dumps(spec))
    with pytest.raises(ValueError, match=re.escape(f"conn_id: the {message}")):
        resolve_connection("sto_bad_connect", LOG)


@pytest.mark.usefixtures("connect_connections")
def test_operator_settings_from_a_spark_connect_connection_hide_the_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from sparktorch_ops.airflow import TorchDistributorOperator

    def fn() -> None:
        """Unused."""

    operator = TorchDistributorOperator(
        task_id="t",
        train=fn,
        local_mode=False,
        conn_id="sto_connect_full",
        spark_conf={"spark.sql.shuffle.partitions": "4"},
    )
    settings = operator._spark_settings()
    assert settings.master == CONNECT_URL_FULL
    assert settings.conf == {"spark.sql.shuffle.partitions": "4"}  # spark_conf wins
    log = capsys.readouterr().out  # the task logger writes there (structlog)
    assert "Spark master sc://connect.example:443/;user_id=ml%20team;token=***;" in log
    assert "t0k" not in log

    contradicting = TorchDistributorOperator(
        task_id="u",
        train=fn,
        local_mode=False,
        conn_id="sto_connect_full",
        spark_conf={"spark.master": "local[2]"},
    )
    with pytest.raises(AirflowFailException, match="contradicts") as raised:
        contradicting._spark_settings()
    assert "t0k" not in str(raised.value) and "token=***" in str(raised.value)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"a": [1, 2.5, None, True, "x"], "b": {"c": (1, 2)}}, None),
        ({"loss": float("nan")}, "value['loss'] is nan (not finite)"),
        ({1: "x"}, "value has a key of type int (1)"),
        ([b"raw"], "value[0] is a builtins.bytes"),
        ({"s": {1, 2}}, "value['s'] is a builtins.set"),
    ],
)
def test_json_safe_problem(value: Any, problem: str | None) -> None:
    from sparktorch_ops.airflow.storage import json_safe_problem

    assert json_safe_problem(value) == problem


def test_small_json_value_stays_inline(tmp_path: Path) -> None:
    from sparktorch_ops.airflow.storage import load_result, value_fields

    fields = value_fields({"acc": 0.9}, location=str(tmp_path), key="k", max_bytes=100)
    assert fields == {"value": {"acc": 0.9}}
    assert load_result(fields) == {"acc": 0.9}
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("location", ["local", "file_uri", "memory"])
def test_large_and_non_json_values_are_stored(tmp_path: Path, location: str) -> None:
    from sparktorch_ops.airflow.storage import load_result, result_key, value_fields

    base = {
        "local": str(tmp_path / "results"),
        "file_uri": (tmp_path / "results").as_uri(),
        "memory": f"memory://sto-{tmp_path.name}",
    }[location]
    key = result_key("dag", "manual__2025-01-01T00:00:00+00:00", "train", -1, 2)
    assert re.fullmatch(r"dag/manual__2025-01-01T00_00_00_00_00/train~[0-9a-f]{16}/try-2", key)

    text = "y" * 5000
    stored = value_fields(text, location=base, key=key, max_bytes=1000)
    assert stored["value_format"] == "text"
    assert stored["value_size"] == 5000
    assert stored["value_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert (
        "5002 bytes as JSON, more than max_xcom_value_bytes=1000" in stored["value_stored_because"]
    )
    assert "value" not in stored
    assert stored["value_uri"].endswith(f"{key}/result.txt")
    assert load_result(stored, result_location=base) == text
    assert load_result(stored["value_uri"], result_location=base) == text

    odd = {"labels": {1, 2}, "blob": b"\x00\xff"}
    stored = value_fields(odd, location=base, key=key, max_bytes=10**6)
    assert stored["value_format"] == "pickle"
    assert stored["value_stored_because"] == "value['labels'] is a builtins.set"
    assert load_result(stored, result_location=base) == odd
    sha256 = stored["value_sha256"]
    assert load_result(stored["value_uri"], result_location=base, sha256=sha256) == odd
    if location != "memory":
        assert stored["value_uri"].startswith("file://")
        assert (
            Path(stored["value_uri"].removeprefix("file://")).stat().st_size == stored["value_size"]
        )


def test_default_result_location(monkeypatch: pytest.MonkeyPatch, airflow_db: Path) -> None:
    from sparktorch_ops.airflow.storage import (
        default_max_xcom_value_bytes,
        default_result_location,
    )

    assert default_result_location() == str(airflow_db / "sparktorch_ops" / "results")
    assert default_max_xcom_value_bytes() == 48 * 1024
    monkeypatch.setenv("AIRFLOW__SPARKTORCH_OPS__RESULT_LOCATION", "s3://aws_default@bucket/x")
    monkeypatch.setenv("AIRFLOW__SPARKTORCH_OPS__MAX_XCOM_VALUE_BYTES", "1024")
    assert default_result_location() == "s3://aws_default@bucket/x"
    assert default_max_xcom_value_bytes() == 1024


def test_provider_info_matches_airflow_schema() -> None:
    import importlib.metadata
    import importlib.resources

    import jsonschema
    from airflow.sdk import BaseOperatorLink
    from airflow.sdk._shared.module_loading import import_string
    from packaging.utils import canonicalize_name

    from sparktorch_ops.airflow.provider import get_provider_info

    info = get_provider_info()
    schema = json.loads(
        importlib.resources.files("airflow").joinpath("provider_info.schema.json").read_text()
    )
    jsonschema.validate(info, schema)
    # Airflow refuses provider info whose package name is not the distribution's.
    assert info["package-name"] == canonicalize_name("sparktorch-ops")
    assert "connection-types" not in info  # the Spark provider's "spark" type is used as it is
    for class_name in info["extra-links"]:
        assert issubclass(import_string(class_name), BaseOperatorLink)
    for group in info["operators"]:
        for module in group["python-modules"]:
            assert hasattr(import_string(f"{module}.TorchDistributorOperator"), "execute")
    options = info["config"]["sparktorch_ops"]["options"]
    assert int(options["max_xcom_value_bytes"]["default"]) == 48 * 1024
    # Once the package declares the entry point, Airflow finds exactly this function.
    ours = [
        entry_point
        for entry_point in importlib.metadata.entry_points(group="apache_airflow_provider")
        if entry_point.dist and canonicalize_name(entry_point.dist.name) == "sparktorch-ops"
    ]
    assert len(ours) == 1, ours
    assert ours[0].load() is get_provider_info


def test_operator_declares_templates_and_link() -> None:
    from sparktorch_ops.airflow import MlflowRunLink, SparkUILink, TorchDistributorOperator

    def fn() -> None:
        """Unused."""

    with_fn = TorchDistributorOperator(task_id="a", train=fn)
    with_path = TorchDistributorOperator(task_id="b", train=Path("/x/train.py"))
    common = {
        "train_args",
        "train_kwargs",
        "num_processes",
        "spark_conf",
        "env",
        "checkpoint_dir",
        "warm_start_from",
        "mlflow_experiment",
        "mlflow_tracking_uri",
    }
    assert common <= set(with_fn.template_fields)
    # A callable template field would be called by Airflow's templating, in a mapped task too
    # (it renders with the class's fields): execute renders train itself, and only a path.
    assert "train" not in with_fn.template_fields and "train" not in with_path.template_fields
    assert with_path.train == "/x/train.py"
    assert [type(link) for link in with_fn.operator_extra_links] == [SparkUILink, MlflowRunLink]


def test_mlflow_tracking_uri_from_a_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import logging

    from sparktorch_ops.airflow.connection import mlflow_uri_from_connection

    log = logging.getLogger("test")
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_HTTP", "http://mlflow-host:5000")
    assert mlflow_uri_from_connection("mlflow_http", log) == "http://mlflow-host:5000"
    monkeypatch.setenv(
        "AIRFLOW_CONN_MLFLOW_EXTRA",
        json.dumps({"conn_type": "generic", "extra": {"tracking_uri": "databricks"}}),
    )
    assert mlflow_uri_from_connection("mlflow_extra", log) == "databricks"
    assert mlflow_uri_from_connection("no_such_mlflow_connection", log) is None


def test_spark_conf_in_local_mode_reaches_the_core_which_says_it_is_unused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Never dropped silently: local mode passes spark_conf on, and the core warns."""
    import logging

    from sparktorch_ops.airflow import TorchDistributorOperator
    from sparktorch_ops.distributor import launch_job
    from sparktorch_ops.job import build_job

    def fn() -> int:
        return 7

    operator = TorchDistributorOperator(
        task_id="t", train=fn, use_gpu=False, spark_conf={"spark.executor.memory": "2g"}
    )
    settings = operator._spark_settings()
    assert settings.configured and settings.conf == {"spark.executor.memory": "2g"}
    with caplog.at_level(logging.WARNING, logger="sparktorch_ops"):
        job = build_job(train=fn, spark=settings, num_processes=1, use_gpu=False)
        assert launch_job(job).value == 7
    assert "are not used with local_mode=True" in caplog.text
