"""The rank process: runs the user's function or script.

Forked by :mod:`sparktorch_ops.rank.bootstrap` (which forwards this process's output to the driver)
and entered through :func:`run_forked`, or started as ``python -u -m sparktorch_ops.rank.worker``
where a fork could not use CUDA. It opens its own channel connection for metrics, the
failure record and rank 0's result.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import runpy
import signal
import sys
import time
import traceback
from typing import Any

from sparktorch_ops import checkpoint
from sparktorch_ops.data import shards
from sparktorch_ops.node.process import exit_status, finish_like_an_interpreter, set_process_name
from sparktorch_ops.rank import reporting, stacks
from sparktorch_ops.rank.pickling import cloudpickle_module
from sparktorch_ops.wire import channel
from sparktorch_ops.wire.env import (
    CHANNEL_ENV,
    FINGERPRINT_ENV,
    NODE_HOST_ENV,
    NVML_CHECK_ADDED_ENV,
    NVML_CUDA_CHECK_ENV,
    PAYLOAD_ENV,
    SECRET_FILE_ENV,
    STACK_FDS_ENV,
)
from sparktorch_ops.wire.messages import FailureReport, Hello, Role
from sparktorch_ops.wire.payload import read_rank_payload


def connect(role: Role, secret: str, **hello: int) -> channel.ChannelClient:
    """This process's own connection to the driver's channel, as ``role`` of this rank (the
    supervisor and the rank process each have one)."""
    said = Hello(
        role=role,
        rank=int(os.environ["RANK"]),
        host=os.environ.get(NODE_HOST_ENV, ""),
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        pid=os.getpid(),
        **hello,
    )
    return channel.ChannelClient.connect(
        os.environ[CHANNEL_ENV], secret, said, fingerprint=os.environ.get(FINGERPRINT_ENV)
    )


def _record_torchelastic_error(exc: BaseException) -> None:
    """Write torchrun's error file too, so torchrun's own summary names the exception."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception:  # best effort: the channel already carries the failure
        pass


def run_payload(record: dict[str, Any], client: channel.ChannelClient, rank: int) -> int:
    """Run the function or script; send rank 0's result. Returns the exit code."""
    if record["kind"] == "function":
        cloudpickle = cloudpickle_module()
        fn, args, kwargs = cloudpickle.loads(record["data"])
        value = fn(*args, **kwargs)
        checkpoint.wait()  # a save still in flight is part of the run: it commits or fails it
        if rank == 0:
            client.send_result(cloudpickle.dumps(value))
        return 0
    path = record["path"]
    sys.argv = [path, *record["argv"]]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exit_status(exc)
    else:
        code = 0
    if code == 0:
        checkpoint.wait()
    return code


def main(secret: str | None = None) -> int:
    """Run this rank's payload and report it; returns the exit code.

    Args:
        secret: the run's secret, when the supervisor forked this process (else read from
            the file the launcher wrote).
    """
    set_process_name(f"torch-rank-{os.environ['RANK']}")
    stack_fds = os.environ.pop(STACK_FDS_ENV, None)
    if stack_fds:  # where this rank's threads are, when the driver asks (stalls, stops)
        stacks.serve(stack_fds, entry=run_payload.__code__)
    if os.environ.pop(NVML_CHECK_ADDED_ENV, None):
        os.environ.pop(NVML_CUDA_CHECK_ENV, None)  # the agent's setting, not the user's
    # The user's code must not find the way to the secret in its environment either.
    shards.select_rank_shard(os.environ)  # DataFrame input: this rank's own shard
    secret_path = os.environ.pop(SECRET_FILE_ENV)
    if secret is None:
        secret = channel.read_secret_file(secret_path)
    client = connect("worker", secret)
    reporting.install(client)
    try:
        rank = int(os.environ["RANK"])
        code = run_payload(read_rank_payload(os.environ[PAYLOAD_ENV]), client, rank)
    except BaseException as exc:
        text = traceback.format_exc()
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
        _record_torchelastic_error(exc)
        try:
            client.send_message(
                FailureReport(
                    type=type(exc).__name__,
                    message=str(exc)[:2000],
                    traceback=text[-20000:],
                    time=time.time(),
                )
            )
        except channel.ChannelError:
            pass
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        reporting.install(None)
        client.close()
    return code


# Handlers torchrun's agent installs, which a forked rank must not keep.
_INHERITED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _start_like_a_fresh_interpreter() -> None:
    """Undo what a fork inherits from the agent that a new ``python -u`` would not have."""
    for signum in _INHERITED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the agent's exit handlers are not the rank's
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    # Unbuffered, as ``python -u``: every line reaches the supervisor's pipe at once.
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.argv = [__file__]
    # What the agent left in memory is not the rank's garbage: keep the collector off it, so
    # that collections neither walk it nor copy its shared pages by writing to its headers.
    gc.freeze()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        # The OpenMP runtime read the agent's environment when torch was imported there.
        import torch

        torch.set_num_threads(int(threads))


def run_forked(secret: str) -> int:
    """The rank process's entry in a child forked from the supervisor. Returns the exit code."""
    _start_like_a_fresh_interpreter()
    code = main(secret)
    finish_like_an_interpreter()
    return code


if __name__ == "__main__":
    sys.exit(main())
