"""What runs a shard, wherever it runs (the driver or a Ray actor): the model cache, the shard
functions (sweep and finish) and the wrapper that turns an exception into a failed shard."""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from discovery.errors import GascanError
from pipelines.batch.shards import Shard, ShardOutcome, ShardResult, check_rows
from pipelines.batch.spec import Checkpoint
from pipelines.options import LoadOptions
from pipelines.progress import Progress, within


class ModelCache:
    """Loaded models by checkpoint (a worker loads each model once and serves all its shards);
    holds ``size`` models, least recently used evicted (1 by default: a big model fills a GPU)."""

    def __init__(self, load: LoadOptions, size: int = 1, threads: int | None = None) -> None:
        self.load = load
        self.size = size
        self.threads = threads  # torch threads, set before the first model work (a Ray actor: its CPUs)
        self.models: dict[tuple[str, str], Any] = {}
        self.loads = 0

    def get(self, checkpoint: Checkpoint):
        import torch

        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        key = (checkpoint.spec, checkpoint.name)
        if key in self.models:
            self.models[key] = self.models.pop(key)  # most recent last
            return self.models[key]
        while len(self.models) >= self.size:
            self.models.pop(next(iter(self.models)))
            _free_memory()
        lm = self.load.load(checkpoint.spec)
        self.loads += 1
        self.models[key] = lm
        return lm


def _free_memory() -> None:
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def scan_shard(shard: Shard, cache: ModelCache, progress: Progress | None = None) -> ShardResult:
    """The default shard function: a sweep shard scans one task on one layer range of a (cached)
    model; a finish shard runs the pipeline's later stages (:func:`finish_checkpoint`). ``progress``
    (the serial executor's, or a Ray actor's plain lines off a terminal) hears the shard's stages as
    ``CHECKPOINT: stage``."""
    from pipelines.sweep import scan_task

    if shard.stage == "finish":
        return finish_checkpoint(shard, cache, progress)
    lm = cache.get(shard.checkpoint)
    if lm.checkpoint_hash() != shard.checkpoint_hash:
        raise GascanError(f"checkpoint {shard.checkpoint.spec} changed after the batch was planned",
                          "rerun the batch (the changed checkpoint is rescanned)")
    if shard.n_layers is not None and lm.inventory.n_layers != shard.n_layers:
        raise GascanError(f"{shard.checkpoint.spec} has {lm.inventory.n_layers} layers, its config "
                          f"{shard.n_layers}", "drop layers_per_shard for this model")
    frame, summary = scan_task(lm, shard.task, shard.scan_options(), layers=shard.layer_list(),
                               progress=within(progress, shard.checkpoint.name))
    info = {"model": lm.name, "spec": lm.spec, "architecture": lm.inventory.architecture,
            "n_layers": lm.inventory.n_layers, "n_heads": lm.inventory.n_heads()}
    return ShardResult(frame, summary, info)


ShardFn = Callable[[Shard, ModelCache, Progress | None], ShardResult]


def execute_shard(shard_fn: ShardFn, shard: Shard, cache: ModelCache,
                  progress: Progress | None = None) -> ShardOutcome:
    """Run one shard where it is (driver or worker); an exception fails this shard, not the batch."""
    started = time.perf_counter()
    try:
        result = shard_fn(shard, cache, progress)
        check_rows(shard, result.frame)
    except Exception as err:  # noqa: BLE001 - any error in user data or a model fails only this shard
        message = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        return ShardOutcome(shard, error=message)
    result.seconds = round(time.perf_counter() - started, 3)
    result.pid = os.getpid()
    result.host = socket.gethostname()
    return ShardOutcome(shard, result=result)




def finish_checkpoint(shard: Shard, cache: ModelCache, progress: Progress | None = None) -> ShardResult:
    """The finish shard: the merged sweep tables into a private scan directory, then
    :func:`pipelines.pipeline.finish` there (evidence, pairs, verdict, report) with the cached model;
    returns every file of that directory, which the driver writes into the checkpoint's directory."""
    import io
    import tempfile

    from discovery.artifacts import HEADS_FILE, write_scan
    from discovery.measure.cost import Cost
    from pipelines import pipeline, resume

    if shard.inputs is None:
        raise ValueError(f"finish shard {shard.label} carries no sweep tables")
    lm = cache.get(shard.checkpoint)
    if lm.checkpoint_hash() != shard.checkpoint_hash:
        raise GascanError(f"checkpoint {shard.checkpoint.spec} changed after the batch was planned",
                          "rerun the batch (the changed checkpoint is rescanned)")
    heads = pl.read_parquet(io.BytesIO(shard.inputs["heads"]))
    with tempfile.TemporaryDirectory(prefix="gascan-finish-") as tmp:
        summary = shard.inputs["summary"]
        write_scan(tmp, heads, {**summary, "stages": {}})
        # the sweep ran as shards: mark it complete with their seconds, so each later stage records its cost
        seconds = sum(float(t.get("seconds") or 0) for t in (summary.get("tasks") or {}).values())
        resume.commit(tmp, "sweep", pipeline.STAGES, None, [HEADS_FILE], Cost(wall_s=seconds), None,
                      resume.new_run_id(), sharded=True)
        result = pipeline.finish(lm, tmp, report=True, progress=within(progress, shard.checkpoint.name))
        root = Path(tmp)
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                 if p.is_file() and not p.name.startswith(".")}
    return ShardResult(heads, result.summary, {}, files=files)
