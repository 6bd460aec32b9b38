"""``gascan batch``: many checkpoints x tasks as resumable shards, on one machine or a Ray cluster.

- :mod:`~pipelines.batch.spec`: the spec (checkpoints, the shared scan and load options);
- :mod:`~pipelines.batch.shards`: the shard plan, keys, completion markers and the output lock;
- :mod:`~pipelines.batch.work`: what runs a shard (model cache, sweep and finish shard functions);
- :mod:`~pipelines.batch.executors`: in this process, or on Ray actors, with identical results;
- :mod:`~pipelines.batch.run`: the driver (sweeps, then one finish per checkpoint through the one
  pipeline), the merge and ``batch_summary.json``; :mod:`~pipelines.batch.series`: the series figure.
"""
from pipelines.batch.run import BatchResult, merge_batch, run_batch
from pipelines.batch.shards import (
    Shard,
    ShardOutcome,
    ShardResult,
    commit_shard,
    plan_shards,
    read_marker,
    shard_key,
    shard_paths,
)
from pipelines.batch.spec import (
    BatchSpec,
    Checkpoint,
    discover_series,
    load_spec,
    override,
    resolve_task,
    spec_from_dict,
)
from pipelines.batch.work import ModelCache, execute_shard, scan_shard

__all__ = [
    "BatchResult", "BatchSpec", "Checkpoint", "ModelCache", "Shard", "ShardOutcome", "ShardResult", "commit_shard",
    "discover_series", "execute_shard", "load_spec", "merge_batch", "override", "plan_shards", "read_marker",
    "resolve_task", "run_batch", "scan_shard", "shard_key", "shard_paths", "spec_from_dict",
]
