"""The variables a rank of a DataFrame run reads to find its shard, for tests that read shards
in this process as such a rank would (a run's planning sets them for every rank)."""

from __future__ import annotations

from sparktorch_ops.wire.env import DATA_FILE_ENV, EPOCH_ROWS_ENV, SCHEMA_FILE_ENV


def rank_env(shard_path: str, schema_path: str, rows_per_epoch: int) -> dict[str, str]:
    """The variables that point one rank at its shard."""
    return {
        DATA_FILE_ENV: shard_path,
        SCHEMA_FILE_ENV: schema_path,
        EPOCH_ROWS_ENV: str(int(rows_per_epoch)),
    }
