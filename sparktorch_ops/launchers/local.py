"""Local mode: the run's torchrun agent on the driver, acting on a
:class:`~sparktorch_ops.wire.plan.RunPlan`."""

from __future__ import annotations

import os
import shutil
import tempfile

from sparktorch_ops.data.shards import epoch_rows, write_schema_file, write_shards
from sparktorch_ops.driver.collector import RunCollector
from sparktorch_ops.errors import ConfigError
from sparktorch_ops.launchers.base import LauncherStatus
from sparktorch_ops.node.prefork import (
    AgentProcess,
    ForkedAgent,
    TorchImportError,
    start_agent,
    stop_run,
)
from sparktorch_ops.spark.dataframe import PreparedInput, stream_batches
from sparktorch_ops.wire.channel import write_secret_file
from sparktorch_ops.wire.env import DATA_DIR_ENV, EPOCH_ROWS_ENV, SCHEMA_FILE_ENV
from sparktorch_ops.wire.payload import Payload, write_rank_payload
from sparktorch_ops.wire.plan import RunPlan


class LocalLauncher:
    """One torchrun agent on the driver, with every rank (its rendezvous store is its own; a
    lost rank is all there is to say, no cluster knows more)."""

    def __init__(
        self,
        plan: RunPlan,
        payload: Payload,
        secret: str,
        collector: RunCollector,
        data: PreparedInput | None = None,
    ) -> None:
        (self._node,) = plan.nodes
        self._data = data
        self._plan = plan
        self._payload = payload
        self._secret = secret
        self._collector = collector
        self._workdir: str | None = None
        self._agent: AgentProcess | ForkedAgent | None = None

    def start(self) -> None:
        """Write the payload into a fresh work directory and start the agent."""
        plan, node = self._plan, self._node
        self._workdir = tempfile.mkdtemp(prefix=f"{plan.run_id}-")
        try:
            agent = node.bind(
                os.environ,
                run_id=plan.run_id,
                channel=plan.channel_address,
                fingerprint=plan.channel_fingerprint,
                payload_path=write_rank_payload(self._payload, self._workdir, in_place=True),
                secret_path=write_secret_file(self._workdir, self._secret),
                launcher_pid=os.getpid(),
            )
            env = {**agent.env, **self._write_data(self._workdir)}
        except BaseException:
            # A write that failed (a full disk) leaves neither the directory nor the secret.
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
            raise
        try:
            self._agent = start_agent(
                agent.argv,
                env,
                None,
                on_stdout=self._collector.agent_output(0, node.host, stderr=False),
                on_stderr=self._collector.agent_output(0, node.host, stderr=True),
            )
        except TorchImportError as exc:
            raise ConfigError(
                "local_mode",
                f"local mode runs the ranks on this machine, but {agent.argv[0]} cannot import "
                f"torch ({exc}): install torch for it, or use local_mode=False with executors "
                "that have it",
            ) from None

    def _write_data(self, workdir: str) -> dict[str, str]:
        """DataFrame input: stream it here and share it out, one shard per rank."""
        if self._data is None:
            return {}
        directory = os.path.join(workdir, "data")
        os.makedirs(directory)
        shards = write_shards(
            stream_batches(self._data.dataframe),
            self._data.arrow_schema,
            directory,
            self._plan.num_processes,
        )
        if min(shard.rows for shard in shards) == 0:
            raise ConfigError(
                "dataframe",
                f"has {self._data.facts.rows} rows for {self._plan.num_processes} ranks: "
                "every rank needs at least one row",
            )
        self._collector.data_ready(sum(shard.rows for shard in shards))
        return {
            DATA_DIR_ENV: directory,
            SCHEMA_FILE_ENV: write_schema_file(self._data.facts.schema_json, workdir),
            EPOCH_ROWS_ENV: str(epoch_rows(shard.rows for shard in shards)),
        }

    def status(self, *, lost: bool = False) -> LauncherStatus:
        """The agent's exit status once it is gone."""
        assert self._agent is not None
        code = self._agent.poll()
        if code is None:
            return LauncherStatus()
        self._agent.finish_output()
        return LauncherStatus(exit=(code, "" if code == 0 else f"torchrun exited with code {code}"))

    def release(self) -> None:
        """After the run, however it ended: no straggler, no work directory."""
        self.stop()

    def stop(self) -> None:
        """Stop the agent (SIGTERM, then SIGKILL) and every process of the run."""
        agent = self._agent
        try:
            stop_run(agent, self._plan.run_id, succeeded=agent is not None and agent.poll() == 0)
        finally:  # the work directory (and the secret in it) goes whatever happened above
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)


__all__ = ["LocalLauncher"]
