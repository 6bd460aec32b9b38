"""How long a batch has left, for its progress bar: shards weighted by their predicted seconds.

Counting shards as equal misleads: on Gemma3-270M a finish shard (evidence, pairs, verdict, report) ran
about three times as long as the checkpoint's whole sweep, so a two-shard batch showed "eta 2m45s" at
5 minutes with 7 minutes to go. The forecast predicts each shard's seconds from what the batch has
measured:

- a sweep shard: the mean seconds of the finished sweep shards of its checkpoint, else of every
  checkpoint, else unknown (nothing has finished yet);
- a finish shard, once its checkpoint's sweep is complete (:func:`finish_seconds`): the share of its
  evidence budget (forward-equivalents, by the rule the evidence stage applies) that evidence and pairs
  spent on the committed real scans, at the sweep's measured seconds per forward-equivalent, times measured /
  predicted seconds of the batch's finished finish shards (:meth:`Forecast.calibration`); before that, the checkpoint's predicted sweep seconds times the ratio (finish /
  sweep seconds) of the last checkpoint predicted that way, or :data:`FINISH_RATIO_PRIOR`.

The time left (:meth:`Forecast.eta`), when the last shard ended, is the predicted seconds of the shards not
yet done at the batch's throughput so far (measured shard seconds per wall second: about the number of busy
workers), and at least the longest chain one worker must still run (a checkpoint's longest sweep shard, then
its finish); it counts down with the wall clock until the next shard ends, and is unknown (None) once the
running shards overrun their prediction.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipelines.batch.shards import Shard

FINISH_RATIO_PRIOR = 2.0  # finish / sweep seconds before any is predicted: with the budget that counts passes
# (2026-12-07) Gemma3-270M's batch 1.0 and scan 1.3, SmolLM2-135M's scan 2.9 (2.3-3.1 before it: docs/batch.md)
UNBOUNDED_FACTOR = 10.0  # --budget none: evidence + pairs cost about this many sweeps (5-20x measured)
BUDGET_SHARE = 0.9  # of its budget, what a finish spends: the committed default scans of 2026-12-07 (budget that
# counts passes) spend 0.98 Gemma3-270M, 0.92 SmolLM2-135M, where the budget binds; the toys, at their 200 fe, 0.56-0.76
# (reports/*/summary.json budget.spent / budget.budget). A Gemma3-270M batch's finish shard, predicted with it at
# 1 min 34 s once its sweep shard ended, took 1 min 36 s (docs/scale.md)


def finish_seconds(summary: Mapping[str, Any], layers_by_task: Mapping[str, Sequence[int]],
                   budget: str) -> float | None:
    """A finish shard's predicted seconds from its checkpoint's merged sweep summary: per task,
    :data:`BUDGET_SHARE` of the evidence budget in forward-equivalents
    (:func:`~discovery.evidence.budget.resolve_budget`, as the evidence stage resolves it from the head layers)
    times the sweep's seconds per forward-equivalent; None when the sweep recorded no cost."""
    from discovery.evidence.budget import resolve_budget
    from pipelines.validate import budget as parse_budget

    unit, amount = parse_budget(budget)
    n_layers = summary.get("n_layers")
    total = 0.0
    for task, info in (summary.get("tasks") or {}).items():
        seconds = float(info.get("seconds") or 0.0)
        fe = float((info.get("cost") or {}).get("forward_equivalents") or 0.0)
        layers = list(layers_by_task.get(task) or ())
        if seconds <= 0 or fe <= 0 or not layers or not n_layers:
            return None
        planned = resolve_budget(unit, amount, layers, int(n_layers), info)
        total += (UNBOUNDED_FACTOR * fe if planned is None else BUDGET_SHARE * planned) * seconds / fe
    return total if total > 0 else None


@dataclass
class _Pending:
    checkpoint: str
    stage: str
    predicted: float | None = None  # finish shards: set once the checkpoint's sweep is complete


@dataclass
class Forecast:
    """The batch's shards still to run and the seconds measured so far (see the module docstring). ``started``
    is the run's start on the same clock as :meth:`eta`'s ``now``."""

    started: float
    pending: dict[str, _Pending] = field(default_factory=dict)
    sweep_seconds: dict[str, list[float]] = field(default_factory=dict)  # measured, by checkpoint
    done_seconds: float = 0.0  # measured seconds of the shards finished in this run
    ratio: float = FINISH_RATIO_PRIOR
    last_event: float | None = None  # when a shard of this run last ended
    finishes: list[tuple[float, float]] = field(default_factory=list)  # (measured, predicted) finish seconds

    def expect(self, shard: Shard) -> None:
        """A shard that will run (a checkpoint's finish shard may be expected before it is queued)."""
        self.pending[shard.key] = _Pending(shard.checkpoint.name, shard.stage)

    def expect_finish(self, checkpoint: str) -> None:
        """The finish shard of ``checkpoint``, before its key exists (its sweep is not complete)."""
        self.pending[f"finish:{checkpoint}"] = _Pending(checkpoint, "finish")

    def queued_finish(self, shard: Shard, seconds: float | None, sweep_seconds: float) -> None:
        """A finish shard is queued, with its predicted seconds (:func:`finish_seconds`) and its checkpoint's
        measured sweep seconds (every sweep shard's, this run's or an earlier run's)."""
        self.pending.pop(f"finish:{shard.checkpoint.name}", None)
        self.pending[shard.key] = _Pending(shard.checkpoint.name, "finish", seconds)
        if seconds is not None and sweep_seconds > 0:
            self.ratio = seconds / sweep_seconds

    def finished(self, shard: Shard, seconds: float | None, now: float) -> None:
        """A shard of this run ended at ``now`` (``seconds``: its measured wall seconds; None when it failed)."""
        item = self.pending.pop(shard.key, None)  # a finish shard's placeholder went when it was queued
        self.last_event = now
        if seconds is None:
            return
        if item is not None and item.predicted:
            self.finishes.append((seconds, item.predicted))
        self.done_seconds += seconds
        if shard.stage == "sweep":
            self.sweep_seconds.setdefault(shard.checkpoint.name, []).append(seconds)

    def measured_before(self, shard: Shard, seconds: float | None) -> None:
        """A sweep shard an earlier run finished: its seconds predict its checkpoint's other sweep shards."""
        if shard.stage == "sweep" and seconds:
            self.sweep_seconds.setdefault(shard.checkpoint.name, []).append(float(seconds))

    def dropped(self, checkpoint: str) -> None:
        """A checkpoint's finish will not run in this batch (a sweep shard failed, or it was done already)."""
        self.pending.pop(f"finish:{checkpoint}", None)

    def _sweep_mean(self, checkpoint: str) -> float | None:
        own = self.sweep_seconds.get(checkpoint)
        every = [s for values in self.sweep_seconds.values() for s in values]
        values = own or every
        return sum(values) / len(values) if values else None

    def _sweep_total(self, checkpoint: str) -> float:
        """The checkpoint's sweep seconds, measured and predicted."""
        pending = sum(1 for p in self.pending.values() if p.checkpoint == checkpoint and p.stage == "sweep")
        return sum(self.sweep_seconds.get(checkpoint, ())) + (self._sweep_mean(checkpoint) or 0.0) * pending

    def calibration(self) -> float:
        """Measured / predicted seconds of this run's finished finish shards (1 before any): the budget is the
        most a finish may plan, so the first finish of a series corrects the prediction of the others."""
        if not self.finishes:
            return 1.0
        return sum(m for m, _ in self.finishes) / sum(p for _, p in self.finishes)

    def predicted(self, item: _Pending) -> float | None:
        """One pending shard's predicted seconds (None: nothing measured to predict it from)."""
        if item.stage == "sweep":
            return self._sweep_mean(item.checkpoint)
        if item.predicted is not None:
            return item.predicted * self.calibration()
        sweep = self._sweep_total(item.checkpoint)
        return self.ratio * sweep * self.calibration() if sweep > 0 else None

    def eta(self, now: float) -> float | None:
        """Seconds left at ``now`` (see the module docstring): 0 when nothing is pending; None while a pending
        shard cannot be predicted (no sweep shard has finished yet) or once the prediction is overrun."""
        if not self.pending:
            return 0.0
        predictions = {key: self.predicted(item) for key, item in self.pending.items()}
        if any(p is None for p in predictions.values()):
            return None
        chains: dict[str, float] = {}
        for key, item in self.pending.items():
            if item.stage == "sweep":
                chains[item.checkpoint] = max(chains.get(item.checkpoint, 0.0), predictions[key])
        longest = max([chains.get(item.checkpoint, 0.0) + predictions[key] for key, item in self.pending.items()
                       if item.stage == "finish"] + list(chains.values()))
        at = self.last_event if self.last_event is not None else self.started
        elapsed = at - self.started
        left = longest if self.done_seconds <= 0 or elapsed <= 0 else \
            max(sum(predictions.values()) * elapsed / self.done_seconds, longest)
        left -= now - at  # the running shards' progress since the last shard ended
        return left if left > 0 else None
