"""The pure parts of the session factory: master URLs, conf, settings, start-up waits.

None of this imports pyspark (the unit tier runs without it)."""

from __future__ import annotations

import pytest

from sparktorch_ops.driver import planning
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.spark import preflight
from sparktorch_ops.spark import session as spark_support
from sparktorch_ops.spark.session import SparkSettings, parse_master


@pytest.mark.parametrize(
    ("url", "kind", "executors"),
    [
        ("local", "local", None),
        ("local[2]", "local", None),
        (" local[*] ", "local", None),
        ("local[2,3]", "local", None),
        ("local-cluster[2,1,1024]", "local-cluster", 2),
        ("spark://head:7077", "standalone", None),
        ("spark://a:7077,b:7077", "standalone", None),
        ("yarn", "yarn", None),
        ("k8s://https://kube:6443", "k8s", None),
        ("mesos://zk:5050", "mesos", None),
    ],
)
def test_master_urls_parse_into_one_form(url: str, kind: str, executors: int | None) -> None:
    master = parse_master(url)
    assert (master.url, master.kind, master.executors) == (url.strip(), kind, executors)
    assert master.in_process == (kind == "local")


@pytest.mark.parametrize(
    "url", ["", "local[0]", "local[x]", "spark:/x", "http://x", "yarn-client", 7]
)
def test_a_bad_master_names_the_argument_and_the_forms(url: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_master(url, "spark_master")
    assert info.value.argument == "spark_master"
    assert "local[N]" in str(info.value) or "(str)" in str(info.value)


def test_conf_values_become_strings_and_bad_ones_are_named() -> None:
    assert spark_support.validate_conf({"a": True, "b": 2, "c": 1.5, "d": "x"}) == {
        "a": "true", "b": "2", "c": "1.5", "d": "x",
    }  # fmt: skip
    with pytest.raises(ConfigError, match="spark_conf: the value of 'a'"):
        spark_support.validate_conf({"a": [1]})
    with pytest.raises(ConfigError, match="keys must be non-empty"):
        spark_support.validate_conf({" ": "1"})
    with pytest.raises(ConfigError, match="must be a mapping"):
        spark_support.validate_conf(["a"])


def test_static_and_runtime_settings() -> None:
    assert spark_support.is_static_conf("spark.executor.memory")
    assert spark_support.is_static_conf("spark.master")
    assert spark_support.is_static_conf("spark.sql.warehouse.dir")
    assert not spark_support.is_static_conf("spark.sql.shuffle.partitions")


def test_spark_master_in_conf_is_the_master_unless_it_contradicts_one() -> None:
    settings = SparkSettings(conf={"spark.master": "local[2]", "spark.x": "1"})
    assert settings.master == "local[2]" and dict(settings.conf) == {"spark.x": "1"}
    same = SparkSettings(master="local[2]", conf={"spark.master": " local[2] "})
    assert same.master == "local[2]"
    with pytest.raises(ConfigError) as info:
        SparkSettings(master="spark://head:7077", conf={"spark.master": "local[2]"})
    assert info.value.argument == "spark_conf" and "contradicts" in str(info.value)
    with pytest.raises(ConfigError, match="spark_master"):
        SparkSettings(master="nowhere")
    assert not SparkSettings().configured and SparkSettings(conf={"a": "b"}).configured


def test_in_process_masters_get_no_registration_grace() -> None:
    assert planning.registration_grace(True, app_age_s=0.5, waiting_time_s=30) == 0.0
    assert planning.registration_grace(False, app_age_s=4, waiting_time_s=30) == 26
    assert planning.registration_grace(False, app_age_s=45, waiting_time_s=30) == 0


def test_a_run_waits_for_an_executor_lost_moments_ago_until_it_is_replaced() -> None:
    died = "Command exited with code 137"
    # Lost 5 s ago, nothing registered since: wait the rest of the minute.
    assert planning.replacement_grace([(5, died)], [300], 60) == 55
    # Replaced 1 s ago: nothing to wait for.
    assert planning.replacement_grace([(5, died)], [300, 1], 60) == 0
    # Two lost, one replaced so far: wait for the one still missing (the newest loss).
    assert planning.replacement_grace([(20, died), (8, died)], [10], 60) == 52
    # Too long ago, or a loss that brings nothing back.
    assert planning.replacement_grace([(75, died)], [300], 60) == 0
    assert (
        planning.replacement_grace([(2, "worker lost: 127.0.0.1:1 got disassociated")], [], 60) == 0
    )
    assert planning.replacement_grace([(2, "Executor decommission: spot")], [], 60) == 0
    assert planning.replacement_grace([], [1], 60) == 0


def test_a_later_attempt_waits_for_replacements_but_not_for_nodes_that_are_gone() -> None:
    worker_lost = "worker lost: 127.0.0.1:1 got disassociated"
    # Its own loss may not be in Spark's status store yet: the whole wait, ended by the slots.
    assert planning.replacement_grace([], [300], 60, replacing=True) == 60
    assert (
        planning.replacement_grace([(1, "Command exited with code 137")], [], 60, replacing=True)
        == 60
    )
    # Only nodes gone (a spot node reclaimed, a worker killed): shrink now.
    assert planning.replacement_grace([(1, worker_lost)], [300], 60, replacing=True) == 0
    assert planning.replacement_grace([(2, "Executor decommission.")], [], 60, replacing=True) == 0
    # A node loss long ago says nothing about this attempt's.
    assert planning.replacement_grace([(90, worker_lost)], [300], 60, replacing=True) == 60


def test_expected_executors_from_instances_or_local_cluster() -> None:
    assert preflight.expected_executors("local-cluster[2,1,1024]", None) == 2
    assert preflight.expected_executors("yarn", "4") == 4
    assert preflight.expected_executors("spark://127.0.0.1:7077", "3") == 3
    assert preflight.expected_executors("spark://127.0.0.1:7077", None) is None
    assert preflight.expected_executors("k8s://x", "not-a-number") is None
    assert preflight.expected_executors("not a master", None) is None


def test_a_shared_session_is_stopped_by_the_last_run_to_leave_it() -> None:
    """Run A starts the session (to be stopped), run B reuses it: A's end must not stop it
    under B; B's end stops it, with A's handle (the settings to clear)."""
    users = spark_support._SessionUsers()
    session = object()
    started = spark_support.SessionHandle(session, created=True, stop_when_done=True)
    reused = spark_support.SessionHandle(session, created=False)
    users.join(session)
    users.join(session)
    assert users.leave(started) is None
    assert users.leave(reused) is started
    # A session a run found running (not started for it) is never stopped by a run.
    users.join(session)
    assert users.leave(reused) is None
