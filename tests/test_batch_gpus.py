"""Ray placement of batch shards on GPUs, on a local Ray cluster that declares two fake GPUs.

No GPU is needed: Ray hands out the declared ``GPU`` resource, and sets ``CUDA_VISIBLE_DEVICES`` in
each actor to the ids it was given, exactly as on a real GPU node. The shard function records what
the worker saw (Ray's GPU ids, ``CUDA_VISIBLE_DEVICES``, the device the model would load on, its
PID), so the tests check the placement that ``gascan batch --executor ray --gpus-per-worker G`` makes:
one actor per GPU (or ``1/G`` actors per GPU), every shard of an actor on that actor's GPU, models
loaded with ``device="cuda"``, and a clear error when the cluster has too few GPUs.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict

import polars as pl
import pytest

from discovery.errors import GascanError
from pipelines.batch import ShardResult, load_spec, override, plan_shards
from pipelines.batch.executors import RayExecutor

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
GPUS = 2


def where_am_i(shard, cache, progress=None) -> ShardResult:
    """A shard function without model work: one row per head of the shard's layers, and the
    worker's view of its GPUs in the model info."""
    import ray

    start, stop = shard.layers or (0, 3)
    rows = [{"model": shard.checkpoint.name, "checkpoint": shard.checkpoint_hash, "task": shard.task,
             "layer": layer, "head": head, "kind": "attn", "depth": layer / 2}
            for layer in range(start, stop) for head in range(2)]
    info = {"gpu_ids": [str(i) for i in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": cache.load.device, "pid": os.getpid()}
    summary = {"task": shard.task, "clean": {"acc": 0.5, "logit_diff": 1.0}, "n_prompts": 8, "seconds": 0.0}
    return ShardResult(pl.DataFrame(rows), summary, info)


@pytest.fixture(scope="module")
def gpu_cluster():
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # where_am_i travels to the workers
    ray.init(num_cpus=2, num_gpus=GPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list:
    """Six shards: two tiny 3-layer checkpoints × one task × one layer per shard."""
    from transformers.utils import logging as hf_logging

    from discovery.model.tiny import tiny_model, tiny_tokenizer

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("gpu-run")
    for i, step in enumerate((100, 200)):
        dest = root / "checkpoints" / f"step-{step:06d}"
        tiny_model("llama", seed=i).save_pretrained(dest)
        tiny_tokenizer().save_pretrained(dest)
        (dest / "training.json").write_text(json.dumps({"step": step}))
    spec = override(load_spec(root), tasks=["mc"], layers_per_shard=1)
    planned = plan_shards(spec)
    assert len(planned) == 6
    return planned


def _placements(shards: list, gpus_per_worker: float) -> tuple[list[dict], RayExecutor]:
    executor = RayExecutor(gpus_per_worker=gpus_per_worker, cpus_per_worker=0.25, max_retries=0)
    outcomes = list(executor.run(list(shards), where_am_i, shards[0].load))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    assert len(outcomes) == len(shards)
    return [o.result.model_info | {"checkpoint": o.shard.checkpoint.name} for o in outcomes], executor


def test_one_actor_per_gpu_and_each_actor_keeps_its_gpu(gpu_cluster, shards):
    seen, executor = _placements(shards, 1.0)
    assert executor.workers == GPUS
    assert all(p["device"] == "cuda" for p in seen)  # a CPU load spec becomes cuda on a GPU actor
    assert all(len(p["gpu_ids"]) == 1 and p["visible"] == p["gpu_ids"][0] for p in seen)
    gpu_of_pid = defaultdict(set)
    for p in seen:
        gpu_of_pid[p["pid"]].add(p["gpu_ids"][0])
    assert len(gpu_of_pid) == GPUS and all(len(ids) == 1 for ids in gpu_of_pid.values())
    assert set().union(*gpu_of_pid.values()) == {str(i) for i in range(GPUS)}  # both GPUs used, none twice


def test_half_a_gpu_per_worker_packs_two_actors_per_gpu(gpu_cluster, shards):
    seen, executor = _placements(shards, 0.5)
    assert executor.workers == 2 * GPUS
    assert all(len(p["gpu_ids"]) == 1 and p["visible"] == p["gpu_ids"][0] for p in seen)
    gpu_of_pid = {p["pid"]: p["gpu_ids"][0] for p in seen}
    assert all(len({p["gpu_ids"][0] for p in seen if p["pid"] == pid}) == 1 for pid in gpu_of_pid)
    per_gpu = Counter(gpu_of_pid.values())
    assert max(per_gpu.values()) <= 2  # no GPU holds more than 1/0.5 actors


def test_too_few_gpus_is_one_line_error(gpu_cluster, shards):
    with pytest.raises(GascanError, match=f"has {GPUS} GPUs, a worker needs 4"):
        list(RayExecutor(gpus_per_worker=4, cpus_per_worker=0.25).run(list(shards), where_am_i, shards[0].load))


def test_cpu_workers_load_on_cpu(gpu_cluster, shards):
    seen, _ = _placements(shards, 0.0)
    assert all(p["device"] == "cpu" and p["gpu_ids"] == [] for p in seen)
