"""The warm agent's pure parts and its process-table rewriting (issue 16)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest

from harness.procs import warm_processes
from sparktorch_ops.node.forkserver import MARKER_SLOT_CHARS, command_line_room, slot_value
from sparktorch_ops.node.prefork import import_environment, warm_enabled
from sparktorch_ops.wire.env import WARM_AGENT_ENV, WARM_PROCESS_ENV

pytestmark = pytest.mark.unit


def test_the_import_environment_leaves_out_what_torchs_import_never_reads() -> None:
    env = {
        "CUDA_VISIBLE_DEVICES": "1",  # a run's GPUs (CUDA reads them; the warm process never)
        "MASTER_PORT": "57803",  # another torch group's, left by pyspark's TorchDistributor
        "NODE_RANK": "1",
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/x",
        "SPARKTORCH_OPS_RUN_ID": "sparktorch-1",
        "SPARKTORCH_CHECKPOINT_DIR": "/ckpt",
        "SPARK_PARTITION_ARROW_DATA_FILE": "/data",
        "SPARK_DATAFRAME_SCHEMA_FILE": "/schema",
        "SPARK_HOME": "/spark",
    }
    assert import_environment(env) == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/x",
        "SPARK_HOME": "/spark",
    }


@pytest.mark.parametrize(
    ("value", "enabled"), [(None, True), ("1", True), ("0", False), ("off", False), ("No", False)]
)
def test_the_warm_agent_switch(value: str | None, enabled: bool) -> None:
    environ = {} if value is None else {WARM_AGENT_ENV: value}
    assert warm_enabled(environ) is enabled


def test_the_marker_slot_holds_any_run_marker() -> None:
    assert len(slot_value("123-abcdef")) == MARKER_SLOT_CHARS
    assert len("SPARKTORCH_OPS_RUN_ID=sparktorch-0123456789abcdef") < len(
        f"{WARM_PROCESS_ENV}={slot_value('x')}"
    )


REWRITE = """
import sys, time
from sparktorch_ops.node.forkserver import rewrite_command_line, rewrite_marker
assert rewrite_marker("SPARKTORCH_OPS_RUN_ID=sparktorch-feed")
assert rewrite_command_line([sys.executable, "-m", "sparktorch_ops.node.agent", "sparktorch-feed"])
too_long = ["x" * 5000, "-m", "sparktorch_ops.node.agent", "sparktorch-feed"]
assert not rewrite_command_line(too_long)
print("done", flush=True)
time.sleep(30)
"""


def test_a_forked_agent_shows_its_runs_marker_and_command_line() -> None:
    """What ``ps`` and ``/proc`` show of the process after the rewrite (a plain process
    started like the fork server: padded last environment entry and command line)."""
    argv = [sys.executable, "-m", "sparktorch_ops.node.agent", "sparktorch-feed"]
    env = {"PATH": "/usr/bin:/bin", "KEEP": "kept", WARM_PROCESS_ENV: slot_value("1-x")}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(REWRITE), command_line_room(argv)],
        env={**env, "PYTHONPATH": ":".join(sys.path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
        shown = psutil.Process(proc.pid)
        environ = shown.environ()
        assert environ["SPARKTORCH_OPS_RUN_ID"] == "sparktorch-feed"
        assert environ["KEEP"] == "kept" and WARM_PROCESS_ENV not in environ
        cmdline = shown.cmdline()
        assert cmdline[:3] == argv[:3] and cmdline[3].rstrip() == "sparktorch-feed"
        assert len(cmdline) == 4
    finally:
        proc.kill()
        proc.wait()


PACE = """
import sys
from sparktorch_ops.node.agent import _poll_rendezvous_sooner
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as r
original = r._delay
_poll_rendezvous_sooner(sys.argv[1:])
import torch.distributed.elastic.rendezvous.utils as u
slept = []
u.time.sleep = slept.append  # record instead of sleeping; the longest skew is taken
u.random.uniform = lambda low, high: high
r._delay(seconds=1)
r._delay(seconds=(0, 0.3))
holder = r._BackendRendezvousStateHolder(backend=None, settings=None)
print([round(s, 3) for s in slept], round(holder._cache_duration, 3), r._delay is original)
"""


@pytest.mark.parametrize(
    ("nnodes", "expected"),
    [("1", "[1, 0.3] 1 True"), ("2", "[0.1, 0.03] 0.1 False"), ("40", "[1.0, 0.3] 1.0 False")],
)
def test_rendezvous_polling_is_scaled_to_the_number_of_nodes(nnodes: str, expected: str) -> None:
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, "-c", PACE, f"--nnodes={nnodes}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert out == expected


def test_the_torch_internals_the_rendezvous_pace_replaces_are_where_it_expects_them() -> None:
    """The agent's pace (``_poll_rendezvous_sooner``) replaces private names of torch and, on
    a torch without them, silently keeps torch's own pace: this fails loudly instead when a
    torch release moves or stops using them."""
    pytest.importorskip("torch")
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as r

    assert "seconds" in inspect.signature(r._delay).parameters
    # The handler and the join still wait through the module's own ``_delay``, the name the
    # agent replaces: a poll and the first join's skew.
    source = inspect.getsource(r)
    assert "_delay(seconds=1)" in source and "_delay(seconds=(0, 0.3))" in source
    holder = r._BackendRendezvousStateHolder
    assert "cache_duration" in inspect.signature(holder.__init__).parameters
    assert "self._cache_duration" in inspect.getsource(holder.sync)


def test_a_tasks_early_warm_up_matches_the_environment_its_agent_starts_with(
    tmp_path: Any,
) -> None:
    """The warm process a barrier task starts before it knows the rendezvous port (Spark
    Connect's Python workers are not reused: none is there yet) is the one its agent then
    forks from: same interpreter, same import environment."""
    from sparktorch_ops.driver.planning import RunFacts, plan_run
    from sparktorch_ops.node.task import BarrierTask
    from sparktorch_ops.spec import LaunchSpec
    from sparktorch_ops.wire.payload import FunctionCall

    facts = RunFacts(
        run_id="run1", python=sys.executable, channel_address="10.0.0.1:5000", cpu_count=4
    )
    plan = plan_run(LaunchSpec(num_processes=2, local_mode=False, use_gpu=False), "f", facts)
    payload = FunctionCall(b"")
    task = BarrierTask(plan=plan, secret="s", payload=payload, coordinate_in_stage=True)
    early_argv, early_env = task._agent_command(1, "10.0.0.2", "10.0.0.3", None, "/x", "/y")
    argv, env = task._agent_command(
        1, "10.0.0.2", "10.0.0.3:29400", None, str(tmp_path / "p"), str(tmp_path / "s")
    )
    assert early_argv[0] == argv[0]
    assert import_environment(early_env) == import_environment(env)


def test_a_warm_process_that_cannot_import_torch_says_why_and_no_cold_agent_starts(
    tmp_path: Any,
) -> None:
    """A torch that is installed but raises on import (a missing CUDA library, a broken
    wheel): the warm process reports its import error, and the launcher raises it instead of
    starting a cold agent that would fail the same way, later and less clearly."""
    from sparktorch_ops.node import prefork

    broken = tmp_path / "site" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path / 'site'}:{sys.path[0]}"}
    argv = [sys.executable, "-m", "sparktorch_ops.node.agent", "sparktorch-x"]
    started: list[str] = []
    with pytest.raises(prefork.TorchImportError, match=r"libcudart\.so\.12: cannot open"):
        prefork.start_agent(argv, env, str(tmp_path), started.extend, started.extend)
    assert started == []  # nothing else started
    deadline = time.monotonic() + 10  # and the warm process that failed leaves
    while warm_processes(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warm_processes(os.getpid()) == []
