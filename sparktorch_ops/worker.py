"""The rank process: runs the user's function or script.

Started by :mod:`sparktorch_ops.bootstrap` (which forwards this process's output to the driver).
It opens its own channel connection for metrics, the failure record and rank 0's result.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from typing import Any

import cloudpickle

from sparktorch_ops import channel, reporting
from sparktorch_ops.payload import read_rank_payload
from sparktorch_ops.planning import CHANNEL_ENV, NODE_HOST_ENV, PAYLOAD_ENV, TOKEN_ENV


def _hello() -> dict[str, Any]:
    return {
        "role": "worker",
        "rank": int(os.environ["RANK"]),
        "host": os.environ.get(NODE_HOST_ENV, ""),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "pid": os.getpid(),
    }


def _record_torchelastic_error(exc: BaseException) -> None:
    """Write torchrun's error file too, so torchrun's own summary names the exception."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception:  # best effort: the channel already carries the failure
        pass


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")  # as the interpreter does for sys.exit("message")
    return 1


def run_payload(record: dict[str, Any], client: channel.ChannelClient, rank: int) -> int:
    """Run the function or script; send rank 0's result. Returns the exit code."""
    if record["kind"] == "function":
        fn, args, kwargs = cloudpickle.loads(record["data"])
        value = fn(*args, **kwargs)
        if rank == 0:
            client.send_result(cloudpickle.dumps(value))
        return 0
    path = record["path"]
    sys.argv = [path, *record["argv"]]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc)
    return 0


def main() -> int:
    """Entry point of ``python -m sparktorch_ops.worker``."""
    hello = _hello()
    client = channel.ChannelClient.connect(os.environ[CHANNEL_ENV], os.environ[TOKEN_ENV], hello)
    reporting.install(client)
    try:
        code = run_payload(read_rank_payload(os.environ[PAYLOAD_ENV]), client, hello["rank"])
    except BaseException as exc:
        text = traceback.format_exc()
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
        _record_torchelastic_error(exc)
        try:
            client.send_json(
                channel.FAILURE,
                {
                    "type": type(exc).__name__,
                    "message": str(exc)[:2000],
                    "traceback": text[-20000:],
                    "time": time.time(),
                },
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


if __name__ == "__main__":
    sys.exit(main())
