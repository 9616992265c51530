"""Local mode: torchrun on the driver, no Spark needed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.procs import ENV_CONTRACT, cuda_touched_before_fork_env
from sparktorch_ops import (
    ConfigError,
    TorchDistributor,
    TrainingCancelledError,
    TrainingFailedError,
    report,
)
from tests.support.driver import run_driver

ENV_KEYS = ENV_CONTRACT


def gather_env(tag: str, bad_bytes: bool = False) -> dict[str, Any]:
    """Every rank's env contract, gathered on rank 0; rank 1 finishes last."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {key: os.environ.get(key) for key in ENV_KEYS}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    print(f"hello from rank {dist.get_rank()}", flush=True)
    print(f"to stderr from rank {dist.get_rank()}", file=sys.stderr, flush=True)
    if bad_bytes:
        sys.stdout.buffer.write(b"bad bytes \xff\xfe here\n")
        sys.stdout.flush()
    report(progress=0.5, loss=1.5)
    report(progress=1.0, loss=0.5)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 1:
        time.sleep(1.5)  # finishes last: its value must not be the one returned
    return {"tag": tag, "rank": int(os.environ["RANK"]), "envs": everyone}


def test_env_contract_rank0_value_logs_and_metrics(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.local.logs")
    caplog.set_level(logging.INFO, logger="test.local.logs")
    seen: list[Any] = []
    distributor = TorchDistributor(
        num_processes=2, local_mode=True, use_gpu=False, logger=logger, on_metrics=seen.append
    )
    result = distributor.launch(gather_env, "t1", bad_bytes=True)
    assert result.value["tag"] == "t1" and result.value["rank"] == 0
    envs = result.value["envs"]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    expected_threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    assert {e["OMP_NUM_THREADS"] for e in envs} == {expected_threads}
    assert result.exit_codes == {0: 0, 1: 0}
    assert result.mode == "local" and result.num_processes == 2 and result.app_id is None
    assert result.duration.total_seconds() > 0

    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "test.local.logs"]
    assert any(
        lvl == logging.INFO and msg.startswith("[rank 0|") and msg.endswith("hello from rank 0")
        for lvl, msg in records
    )
    assert any(
        lvl == logging.WARNING and msg.endswith("to stderr from rank 1") for lvl, msg in records
    )
    assert any(msg.endswith("bad bytes \ufffd\ufffd here") for _, msg in records)
    assert "hello from rank 1" in result.outputs[1]

    assert sorted((m.rank, m.step, m.values["loss"]) for m in result.metrics) == [
        (0, 0, 1.5),
        (0, 1, 0.5),
        (1, 0, 1.5),
        (1, 1, 0.5),
    ]
    assert len(seen) == 4 and result.progress == 1.0


def ddp_train_and_fingerprint(out_dir: str) -> dict[str, Any]:
    """The example DDP training, then each rank writes a fingerprint of its weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import torch
    from ddp_train import train

    result = train(epochs=3, lr=0.1)
    flat = torch.cat([v.flatten().double() for v in result["state_dict"].values()])
    Path(out_dir, f"rank{os.environ['RANK']}.txt").write_text(repr(flat.tolist()))
    return {"losses": result["losses"], "world_size": result["world_size"]}


def test_ddp_training_converges_and_ranks_hold_identical_weights(tmp_path: Path) -> None:
    value = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        ddp_train_and_fingerprint, str(tmp_path)
    )
    assert value["world_size"] == 2
    assert value["losses"][-1] < value["losses"][0]
    assert (tmp_path / "rank0.txt").read_text() == (tmp_path / "rank1.txt").read_text()


SCRIPT = """\
import os, sys
rank = int(os.environ["RANK"])
print(f"rank {rank} argv {sys.argv[1:]}")
if rank == 0:
    print("final line from rank 0")
code = int(os.environ.get("EXIT_CODE", "0"))
if rank == 1 and code:
    print("rank 1 is failing", file=sys.stderr)
    sys.exit(code)
"""


def test_script_gets_argv_and_returns_rank0_stdout(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        str(script), "--lr=0.01", "--name", "x y"
    )
    assert out == "rank 0 argv ['--lr=0.01', '--name', 'x y']\nfinal line from rank 0\n"


def test_script_exiting_nonzero_raises(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    distributor = TorchDistributor(
        num_processes=2, local_mode=True, use_gpu=False, env={"EXIT_CODE": "3"}
    )
    with pytest.raises(TrainingFailedError) as info:
        distributor.run(str(script))
    first = info.value.first_failure
    assert first is not None and first.rank == 1 and first.exit_code == 3
    assert "rank 1 is failing" in first.output_tail


def raise_on_rank1() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one broke")
    return "rank 0 is fine"


def test_a_raising_rank_fails_the_run_even_when_rank0_returns() -> None:
    with pytest.raises(TrainingFailedError) as info:
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(raise_on_rank1)
    first = info.value.first_failure
    assert first is not None and first.rank == 1 and first.exit_code == 1
    assert "ValueError: rank one broke" in first.reason
    assert "Traceback (most recent call last)" in first.output_tail
    assert "raise ValueError" in first.output_tail
    assert "rank one broke" in str(info.value)


def test_bad_train_objects_fail_before_launch(tmp_path: Path) -> None:
    import threading

    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="does not exist") as info:
        distributor.run(str(tmp_path / "missing.py"))
    assert info.value.argument == "train_object"
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="cannot be pickled") as info:
        distributor.run(lambda: lock)
    assert info.value.argument == "train_object"
    with pytest.raises(ConfigError, match="callable or the path of a Python script") as info:
        distributor.run(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="command-line arguments only") as info:
        (tmp_path / "s.py").write_text("")
        distributor.run(str(tmp_path / "s.py"), lr=0.1)
    assert info.value.argument == "kwargs"
    assert time.monotonic() - started < 10


def test_use_gpu_without_gpus_says_use_gpu_false() -> None:
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="use_gpu=False"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True).run(print)


def test_local_mode_runs_where_pyspark_cannot_be_imported(tmp_path: Path) -> None:
    result, output = run_driver(
        tmp_path,
        """
        import sys
        sys.modules["pyspark"] = None  # any import of pyspark now fails
        from sparktorch_ops import TorchDistributor

        def world():
            import os
            return int(os.environ["WORLD_SIZE"])

        value = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(world)
        emit({"value": value, "jvm": any("py4j" in m for m in sys.modules)})
        """,
    )
    assert result == {"value": 2, "jvm": False}, output


def fail_on_first_attempt() -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and os.environ["RANK"] == "1":
        raise RuntimeError("transient failure on the first attempt")
    return attempt


def test_max_restarts_lets_torchrun_restart_the_worker_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("sparktorch-tests.restarts")
    distributor = TorchDistributor(
        num_processes=2, local_mode=True, use_gpu=False, max_restarts=1, logger=logger
    )
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert distributor.run(fail_on_first_attempt) == 1
    # The restart stopped the first group at once: rank 0's finished process left on torch's
    # SIGTERM instead of holding out for its 30 s grace and a SIGKILL.
    agent_lines = [r.getMessage() for r in caplog.records if "[torchrun node" in r.getMessage()]
    assert any("via signal SIGTERM" in line for line in agent_lines), agent_lines
    assert not [line for line in agent_lines if "Unable to shutdown process" in line]
    with pytest.raises(TrainingFailedError, match="transient failure"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(fail_on_first_attempt)


class SlowToPickle:
    """Takes a while to pickle, so cancel() can land while launch() is still packing."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        time.sleep(1.5)
        return (SlowToPickle, ())


def finishes(_: object) -> str:
    return "finished"


def test_cancel_while_the_call_is_being_packed() -> None:
    import threading

    distributor = TorchDistributor(num_processes=1, local_mode=True, use_gpu=False)
    outcome: dict[str, object] = {}

    def go() -> None:
        try:
            outcome["value"] = distributor.run(finishes, SlowToPickle())
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=go)
    thread.start()
    time.sleep(0.5)
    distributor.cancel()
    thread.join(60)
    assert isinstance(outcome.get("error"), TrainingCancelledError), outcome


def fresh_interpreter_facts(marker_dir: str) -> dict[str, Any]:
    """What a rank sees of its own process; leaves an exit handler and a non-daemon thread."""
    import atexit
    import signal
    import threading

    import torch

    rank = int(os.environ["RANK"])
    atexit.register(lambda: Path(marker_dir, f"atexit-{rank}").write_text("ran"))

    def finish_late() -> None:
        time.sleep(1.0)
        Path(marker_dir, f"thread-{rank}").write_text("joined")

    threading.Thread(target=finish_late).start()
    return {
        "torch_threads": torch.get_num_threads(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "stdin": sys.stdin.read(),
        "name": Path("/proc/self/comm").read_text().strip(),
        "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
    }


@pytest.mark.parametrize("torchrun_args", [[], ["--start-method=spawn"]], ids=["fork", "spawn"])
def test_ranks_start_and_end_like_fresh_interpreters(
    tmp_path: Path, torchrun_args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks are forked from the agent (or, with --start-method=spawn, from a fresh supervisor):
    either way a rank must look like a new ``python -u`` and end like one."""
    # Importing Lightning sets it in this process; the agent's own setting must not leak.
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    facts = TorchDistributor(
        num_processes=2, local_mode=True, use_gpu=False, torchrun_args=torchrun_args
    ).run(fresh_interpreter_facts, str(tmp_path))
    expected_threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    assert facts == {
        "torch_threads": int(expected_threads),
        "sigterm_default": True,
        "sigint_raises": True,
        "stdin": "",
        "name": "torch-rank-0",
        "nvml_check": None,  # the agent's own setting does not reach the user's code
    }
    for rank in (0, 1):  # the run ended only after each rank's thread and exit handlers
        assert (tmp_path / f"thread-{rank}").read_text() == "joined"
        assert (tmp_path / f"atexit-{rank}").read_text() == "ran"


def rank_process_facts() -> dict[str, Any]:
    return {
        "cmdline": Path("/proc/self/cmdline").read_bytes().decode().split("\0"),
        "name": Path("/proc/self/comm").read_text().strip(),
        "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
        "world": int(os.environ["WORLD_SIZE"]),
    }


def test_ranks_start_as_fresh_interpreters_where_a_fork_could_not_use_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU-only condition, simulated (the one mock here): torch reports that CUDA was
    initialised before the fork, so a forked rank could not use it. The supervisor must start
    the rank as a fresh interpreter instead, and the run must work as usual."""
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    facts = TorchDistributor(
        num_processes=2,
        local_mode=True,
        use_gpu=False,
        env=cuda_touched_before_fork_env(tmp_path),
    ).run(rank_process_facts)
    assert facts["cmdline"][1:4] == ["-u", "-m", "sparktorch_ops.rank.worker"], facts
    assert facts["name"] == "torch-rank-0"
    assert facts["nvml_check"] is None
    assert facts["world"] == 2


def forty_mib_tensor() -> Any:
    import torch

    if int(os.environ["RANK"]) != 0:
        return None
    return torch.arange(10 << 20, dtype=torch.int32)  # 40 MiB: three 16 MiB chunks


def test_a_40_mib_value_from_rank_0_arrives_whole() -> None:
    value = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(forty_mib_tensor)
    assert value.numel() == 10 << 20 and value.element_size() == 4
    assert int(value[0]) == 0 and int(value[-1]) == (10 << 20) - 1
    import torch

    assert int(value.sum(dtype=torch.int64)) == (10 << 20) * ((10 << 20) - 1) // 2


PLAIN_SCRIPT = """
import logging, sys
from sparktorch_ops import TorchDistributor
if sys.argv[1] == "configured":
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO, format="%(message)s")
def fn():
    import os, sys
    print("hello from rank", os.environ["RANK"])
    print("warn from rank", os.environ["RANK"], file=sys.stderr)
    return 7
print("value", TorchDistributor(2, True, False).run(fn))
"""


def test_a_plain_script_shows_rank_output_unless_logging_is_configured(tmp_path: Path) -> None:
    """No logger and no handler: rank lines on stdout/stderr, as torchrun prints them."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    log_file = tmp_path / "run.log"
    plain = subprocess.run(
        [sys.executable, str(script), "plain", str(log_file)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert "[rank 0|" in plain.stdout and "hello from rank 1" in plain.stdout
    assert "value 7" in plain.stdout
    assert "warn from rank 0" in plain.stderr and "warn from rank" not in plain.stdout
    configured = subprocess.run(
        [sys.executable, str(script), "configured", str(log_file)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert configured.returncode == 0, configured.stderr
    assert "hello from rank" not in configured.stdout + configured.stderr
    assert "hello from rank 1" in log_file.read_text()
