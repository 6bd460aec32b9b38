"""The mediation test (DESIGN.md: knock out the gather head, hold the aggregate head): how much of an
ablation's cost flows through held heads, as a mixin of :class:`~discovery.measure.ablation.AblationEngine`
(split from that module for size; it runs on the engine's passes and counts in its units)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from discovery.heads import HeadId
from discovery.measure.edits import Ablation
from discovery.measure.scores import query_scores


class MediationTests:
    """:meth:`mediation` and :meth:`mediation_cost` for the ablation engine."""

    def mediation(self, ablation: Ablation, holds: Sequence[Sequence[HeadId]]) -> tuple[float, list[float]]:
        """The mediation test in one batched run: the mean logit-difference effect of ``ablation``, and
        its effect with each head set of ``holds`` held at its clean outputs (at ``ablation.hold_scope``).
        :func:`mediated_share` turns each pair into the share of the cost those heads carry.

        On the query fast path, heads held at the query only and after the ablation's layers change nothing
        but the query from their layer on: the ablation runs once over the prefix (its keys and values kept)
        and each hold recomputes the last token from its layer (:meth:`mediation_cost`)."""
        runs = [replace(ablation, hold=()), *(replace(ablation, hold=tuple(h)) for h in holds)]
        if not self._mediation_fast(ablation, holds):
            effect = self.effects(runs).logit_diff.mean(1).double().tolist()  # [1 + hold set]
            return effect[0], effect[1:]
        self.prefetch(runs)  # the held heads' clean values, in one pass
        # the ablated prefix (all but the query, every layer), then the ablated query, keeping its layer outputs
        cache = self._prefix_pass(self._plan([runs[0]], positions=slice(0, self.n_positions - 1)))
        first = runs[0].first_layer
        at_query: dict[int, torch.Tensor] = {}  # layer -> the ablated run's output at the query [prompt, 1, d]
        config = self._plan([runs[0]])
        config.layer_sinks = {i: (lambda h, i=i: at_query.__setitem__(i, h.detach()))
                              for i in range(first, self.n_active_layers)}
        if first > 0:
            config.start_layer, config.start_hidden = first, self.hidden[first - 1][:, -1:]
        logits = {0: self._forward_last(1, config, cache)}  # run index -> [prompt, vocab]
        by_layer: dict[int, list[int]] = {}
        for i, run in enumerate(runs[1:], start=1):
            by_layer.setdefault(min(h.layer for h in run.hold), []).append(i)
        for layer, members in by_layer.items():  # one last-token pass per held layer, from that layer
            config = self._plan([runs[i] for i in members])
            config.start_layer, config.start_hidden = layer, at_query[layer - 1].repeat(len(members), 1, 1)
            out = self._forward_last(len(members), config, cache).view(len(members), self.n_prompts, -1)
            logits.update(zip(members, out))
        scores = query_scores(torch.stack([logits[i] for i in range(len(runs))]), self.batch)
        effect = (scores.logit_diff - self.clean.logit_diff).mean(1).double().tolist()  # [1 + hold set]
        return effect[0], effect[1:]

    def _mediation_fast(self, ablation: Ablation, holds: Sequence[Sequence[HeadId]]) -> bool:
        """Whether :meth:`mediation` can recompute only the query for the holds."""
        last_edit = max(h.layer for h in ablation.heads)
        return (self.query_fast_path and tuple(ablation.hold_scope) == ("query",) and ablation.method != "knockout"
                and not ablation.hold and all(h and min(x.layer for x in h) > last_edit for h in holds))

    def mediation_cost(self, ablation: Ablation, holds: Sequence[Sequence[HeadId]]) -> float:
        """What :meth:`mediation` costs in forward-equivalents (the count :attr:`layer_rows` keeps), with the
        :meth:`prefetch` of the clean inputs it needs when they are not kept yet."""
        runs = [replace(ablation, hold=()), *(replace(ablation, hold=tuple(h)) for h in holds)]
        if not self._mediation_fast(ablation, holds):
            return self.predicted_forward_equivalents(runs)
        units = self._prefix_units() + self._pass_units(ablation.first_layer, last_only=True) + sum(
            self._pass_units(min(x.layer for x in h), last_only=True) for h in holds)
        return units / self.inventory.n_layers + self.prefetch_cost(runs)


def mediated_share(cost: float, held: float, min_cost: float = 0.0) -> float | None:
    """The share of an ablation's cost (``cost`` < 0, logit-difference units) that holding heads at their
    clean outputs gives back (``held``: the effect with them held): ``1 - held / cost``. None when the
    ablation costs less than ``min_cost``, where the share would be noise."""
    if not cost < -abs(min_cost):  # also None for a NaN cost
        return None
    return 1.0 - held / cost
