"""Where batch shards run: in this process (:class:`SerialExecutor`) or on Ray actors (:class:`RayExecutor`).

Both call the same function, :func:`pipelines.batch.work.execute_shard`, with the same model cache, so
they compute identical rows. An executor yields :class:`~pipelines.batch.work.ShardOutcome` objects in
completion order; the driver commits each one as it arrives. On Ray, each actor loads a model once
and serves that checkpoint's shards (the scheduler keeps a checkpoint's shards on the actor that
holds it); at most ``in_flight_per_worker`` calls are outstanding per actor (backpressure through
``ray.wait``). When an actor's process dies (killed, out of memory) the shard it was running is
charged one attempt and resubmitted to a fresh actor, up to ``max_retries`` times, then reported as
failed with the reason; calls queued behind it are resubmitted uncharged.

One outstanding call per actor (the default) makes the blame exact: a call's reply can be lost
when the process dies just after finishing it, so with deeper queues an innocent, finished shard
can be charged for its successor's crash. Shards take seconds to hours, so the idle round trip
between calls costs nothing measurable.
"""
from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from discovery.errors import GascanError
from pipelines.batch.shards import Shard, ShardOutcome
from pipelines.batch.work import ModelCache, ShardFn, execute_shard
from pipelines.options import LoadOptions
from pipelines.progress import PlainProgress, Progress, reporter


class Executor(Protocol):
    """Runs shards and yields their outcomes in completion order. ``shards`` may be a list that the caller
    appends to while it reads the outcomes (a checkpoint's finish shard once its sweeps are done): the
    executor runs what is appended too, on the workers it already has. ``progress`` hears each shard's
    stages: in this process (the serial executor), or as lines that Ray forwards from its actors."""

    def run(self, shards: Sequence[Shard], shard_fn: ShardFn, load: LoadOptions,
            progress: Progress | None = None) -> Iterator[ShardOutcome]: ...

    def describe(self) -> dict[str, Any]: ...


class SerialExecutor:
    """Every shard in this process, in plan order, with one model cache (a model loads once).

    ``threads``: torch threads while the batch runs (restored afterwards); None keeps torch's
    default. On a CPU shared with other jobs, 1 thread avoids OpenMP oversubscription.
    """

    name = "serial"

    def __init__(self, cache_size: int = 1, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise GascanError(f"--threads {threads} is not positive", "use 1 or more, or leave it out")
        self.cache_size = cache_size
        self.threads = threads
        self.loads = 0

    def run(self, shards: Sequence[Shard], shard_fn: ShardFn, load: LoadOptions,
            progress: Progress | None = None) -> Iterator[ShardOutcome]:
        cache = ModelCache(load, self.cache_size)  # a list grows while it is read: follow-ups run here too
        previous = None
        if self.threads is not None and shards:
            import torch

            previous = torch.get_num_threads()
            torch.set_num_threads(self.threads)
        try:
            pending = shards if isinstance(shards, list) else list(shards)  # the driver may append follow-ups
            held: str | None = None
            while pending:
                index = next((i for i, s in enumerate(pending) if s.checkpoint.name == held), 0)
                shard = pending.pop(index)  # the loaded model's shards first, as on a Ray actor
                held = shard.checkpoint.name
                yield execute_shard(shard_fn, shard, cache, progress)
        finally:
            self.loads += cache.loads
            if previous is not None:
                import torch

                torch.set_num_threads(previous)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "model_loads": self.loads, "threads": self.threads}


class ShardWorker:
    """The body of a Ray actor: a model cache and the shared shard function."""

    def __init__(self, shard_fn: ShardFn, load: LoadOptions, threads: int = 1) -> None:
        self.shard_fn = shard_fn
        self.cache = ModelCache(load, threads=max(1, threads))  # torch.set_num_threads on first model use

    def pid(self) -> int:
        return os.getpid()

    def run(self, shard: Shard, stage_lines: bool = False) -> ShardOutcome:
        """One shard; ``stage_lines``: its stages as plain progress lines on this process's stderr, which Ray
        forwards to the driver (prefixed with the actor's pid)."""
        if not stage_lines:
            return execute_shard(self.shard_fn, shard, self.cache, None)
        with reporter(plain=True) as progress:
            return execute_shard(self.shard_fn, shard, self.cache, progress)


@dataclass
class _Slot:
    """One live actor, the calls queued on it (oldest first) and the checkpoint it holds."""

    actor: Any
    queue: list[tuple[Any, Shard]] = field(default_factory=list)
    model: str | None = None


def _death_reason(err: BaseException) -> str:
    """One line for a dead worker: the error type and its most telling line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    telling = [line for line in lines if any(w in line.lower() for w in ("memory", "killed", "died", "exit", "signal"))]
    text = (telling or lines or [""])[0]
    return f"{type(err).__name__}: {text}"[:400]


class RayExecutor:
    """Shards on Ray actors: one model per actor, checkpoint affinity, bounded in-flight calls, restarts."""

    name = "ray"

    def __init__(self, *, address: str | None = None, workers: int | None = None, gpus_per_worker: float = 0.0,
                 cpus_per_worker: float = 1.0, max_retries: int = 2, in_flight_per_worker: int = 1,
                 init_options: dict[str, Any] | None = None) -> None:
        if max_retries < 0:
            raise GascanError(f"--max-retries {max_retries} is negative", "use 0 or more")
        if workers is not None and workers < 1:
            raise GascanError(f"--workers {workers} is not positive", "use 1 or more, or leave it out")
        if gpus_per_worker < 0:
            raise GascanError(f"--gpus-per-worker {gpus_per_worker} is negative", "use 0 (CPU), 1, or a fraction")
        self.address = address
        self.workers = workers
        self.gpus_per_worker = gpus_per_worker
        self.cpus_per_worker = cpus_per_worker
        self.max_retries = max_retries
        self.in_flight_per_worker = max(1, in_flight_per_worker)
        self.init_options = init_options or {}
        self.stats: dict[str, Any] = {"actors_started": 0, "worker_deaths": 0, "resubmitted": 0}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "workers": self.workers,
                "gpus_per_worker": self.gpus_per_worker, "max_retries": self.max_retries,
                "in_flight_per_worker": self.in_flight_per_worker, **self.stats}

    def _connect(self) -> bool:
        """Join the running Ray (or ``address``), else start a local one; True if started here."""
        import ray

        if ray.is_initialized():
            return False
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, **self.init_options}
        if self.address:
            options.pop("include_dashboard")
            try:
                ray.init(address=self.address, **options)
            except ConnectionError as err:
                raise GascanError(f"cannot reach the Ray cluster at {self.address} ({err})",
                                  "start it (`ray start --head`) or drop --ray-address for a local cluster") from None
        else:
            options.setdefault("num_cpus", max(1, math.ceil((self.workers or os.cpu_count() or 1)
                                                            * self.cpus_per_worker)))
            ray.init(**options)
        return True

    def _worker_count(self, n_shards: int) -> int:
        import ray

        resources = ray.cluster_resources()
        if self.gpus_per_worker > 0:
            gpus = resources.get("GPU", 0)
            if gpus < self.gpus_per_worker:
                raise GascanError(f"the Ray cluster has {gpus:g} GPUs, a worker needs {self.gpus_per_worker:g}",
                                  "use --gpus-per-worker 0 on a CPU cluster, or connect to a GPU cluster")
            fit = int(gpus // self.gpus_per_worker)
        else:
            fit = int(resources.get("CPU", 1) // self.cpus_per_worker) or 1
        wanted = self.workers or fit
        return max(1, min(wanted, n_shards))

    def run(self, shards: Sequence[Shard], shard_fn: ShardFn, load: LoadOptions,
            progress: Progress | None = None) -> Iterator[ShardOutcome]:
        """Where ``progress`` is plain lines (the driver's stderr is not a terminal), each actor prints its
        shards' stages as plain lines too, which Ray forwards to the driver; under rich bars the actors are
        quiet (their lines would break the bars) and the driver's bar counts shards."""
        if not shards:
            return
        import ray

        stage_lines = isinstance(progress, PlainProgress)
        if stage_lines:  # Ray colours the "(ShardWorker pid=N)" prefix of forwarded lines unless told not to
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")

        started_here = self._connect()
        if self.gpus_per_worker > 0 and load.device == "cpu":
            load = replace(load, device="cuda")  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs
        actor_class = ray.remote(ShardWorker).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0, max_task_retries=0)
        threads = max(1, int(self.cpus_per_worker))
        n_workers = self._worker_count(len(shards))
        self.workers = n_workers

        def new_actor() -> Any:
            self.stats["actors_started"] += 1
            return actor_class.remote(shard_fn, load, threads)

        slots = {i: _Slot(new_actor()) for i in range(n_workers)}
        pending = shards if isinstance(shards, list) else list(shards)  # the driver may append follow-ups
        charged: dict[str, int] = {}
        in_flight: dict[Any, int] = {}
        try:
            while pending or in_flight:
                for wid, slot in slots.items():
                    while pending and len(slot.queue) < self.in_flight_per_worker:
                        shard = self._pick(pending, slot, slots)
                        ref = slot.actor.run.remote(shard, stage_lines)
                        slot.queue.append((ref, shard))
                        slot.model = shard.checkpoint.name
                        in_flight[ref] = wid
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
                for ref in ready:
                    if ref not in in_flight:  # handled with its dead worker
                        continue
                    wid = in_flight[ref]
                    slot = slots[wid]
                    try:
                        outcome = ray.get(ref)
                    except ray.exceptions.RayTaskError as err:  # raised outside the shard function
                        in_flight.pop(ref)
                        shard = self._unqueue(slot, ref)
                        yield ShardOutcome(shard, error=_death_reason(err), attempts=charged.get(shard.key, 0) + 1)
                        continue
                    except ray.exceptions.RayError as err:  # the actor's process died
                        yield from self._worker_died(wid, slots, in_flight, pending, charged, err, new_actor)
                        continue
                    in_flight.pop(ref)
                    self._unqueue(slot, ref)
                    outcome.attempts = charged.get(outcome.shard.key, 0) + 1
                    yield outcome
        finally:
            for slot in slots.values():
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(slot.actor, no_restart=True)
            if started_here:
                ray.shutdown()

    @staticmethod
    def _unqueue(slot: _Slot, ref: Any) -> Shard:
        for i, (queued, shard) in enumerate(slot.queue):
            if queued == ref:
                del slot.queue[i]
                return shard
        raise KeyError(ref)

    @staticmethod
    def _pick(pending: list[Shard], slot: _Slot, slots: dict[int, _Slot]) -> Shard:
        """Next shard for ``slot``: one of the checkpoint it holds, else one no other worker holds."""
        if slot.model is not None:
            for i, shard in enumerate(pending):
                if shard.checkpoint.name == slot.model:
                    return pending.pop(i)
        held = {other.model for other in slots.values() if other is not slot}
        for i, shard in enumerate(pending):
            if shard.checkpoint.name not in held:
                return pending.pop(i)
        return pending.pop(0)

    def _worker_died(self, wid: int, slots: dict[int, _Slot], in_flight: dict[Any, int], pending: list[Shard],
                     charged: dict[str, int], err: BaseException, new_actor) -> Iterator[ShardOutcome]:
        """Settle every call queued on a dead actor and replace the actor.

        Calls run in submission order, so the oldest call that did not return is the one that was
        running: it is charged an attempt. Later calls never started and go back to the queue.
        """
        import ray

        self.stats["worker_deaths"] += 1
        slot = slots[wid]
        with contextlib.suppress(Exception):  # already gone
            ray.kill(slot.actor, no_restart=True)  # settles any call still pending on it
        blamed = False
        requeue: list[Shard] = []
        for ref, shard in slot.queue:
            in_flight.pop(ref, None)
            try:
                outcome = ray.get(ref)
            except ray.exceptions.RayTaskError as task_err:
                yield ShardOutcome(shard, error=_death_reason(task_err), attempts=charged.get(shard.key, 0) + 1)
                continue
            except ray.exceptions.RayError as death:
                if blamed:
                    requeue.append(shard)
                    continue
                blamed = True
                charged[shard.key] = charged.get(shard.key, 0) + 1
                if charged[shard.key] > self.max_retries:
                    reason = _death_reason(death if str(death) else err)
                    yield ShardOutcome(shard, error=f"worker died {charged[shard.key]} times; last: {reason}",
                                       attempts=charged[shard.key], crashed=True)
                else:
                    requeue.append(shard)
                continue
            outcome.attempts = charged.get(shard.key, 0) + 1
            yield outcome
        self.stats["resubmitted"] += len(requeue)
        pending[:0] = requeue
        slots[wid] = _Slot(new_actor())
