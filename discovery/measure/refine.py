"""Mamba-1 channel refinement: from the channel groups that matter down to the channels that carry them.

A Mamba-1 layer has channels, not heads; the sweep treats ``W`` contiguous channels as one head (a
*group*). The paper's resolution is the channel (Falcon-Mamba-7B's G&A channels: 3186, 5143, ...).
Sweeping every channel costs one ablation per channel (layer width × layers); refinement costs one per
split of a group that matters:

1. start from the groups whose drop *counts* (at least ``effect`` × the clean logit difference, its
   bootstrap interval excluding 0: the evidence stage's importance threshold);
2. split every node in two contiguous halves and ablate all halves of one level together, in one
   batched run of the one :class:`~discovery.measure.ablation.AblationEngine` (each half a refined head,
   :meth:`~discovery.heads.Inventory.refine`);
3. the split *separates* the effect when the halves' own drops add up to at least ``carry`` (a half) of
   the parent's; then each half that counts on its own or holds at least ``carry / 2`` of the parent's
   drop is followed. When the split does not separate it (each half alone costs little, together
   much: channels that stand in for each other), the parent is a *redundant set*, the smallest group
   found that carries the effect, and a leaf; a followed single channel is a leaf too. (The rule "one
   half carries at least ``carry`` of its parent" would call two independent channels in different
   halves a redundant set whenever the final norm makes each worth a little under half: the planted
   test's two channels are worth 0.47 each);
4. every node's implicit-attention pattern metrics and direct logit attribution are computed in one
   pattern pass and one DLA pass with every node a refined head (both kinds of evidence at every level).

The leaves stay in the inventory as refined heads (``count + k``) for the later stages; every other node
is removed again. The cost, in forward-equivalents (layer-rows the engine recomputed over
``prompts × layers``), grows with the number of important channels (about ``2 · log2(W)`` ablations per
followed path), not with the layer width; :func:`channel_sweep_cost` is what single-channel ablation of
every channel would cost the same engine.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from discovery.heads import HeadId
from discovery.measure.ablation import METRICS, Ablation, AblationEngine, Scores
from discovery.stats import bootstrap_ci


@dataclass(frozen=True)
class RefineSettings:
    """When a node counts (``effect``: share of the clean logit difference, interval excluding 0) and when
    a split separates its parent's effect (``carry``: the share of the parent's drop its halves must add up to);
    ``scope``: where the tree ablates."""

    effect: float = 0.1
    carry: float = 0.5  # a split separates the effect when its halves add up to this share of the parent's
    scope: tuple[str, ...] = ("all",)
    bootstrap: int = 1000
    seed: int = 0


@dataclass
class Node:
    """One channel range tested by the refinement (level 0: a group head of the sweep)."""

    layer: int
    start: int
    end: int
    level: int
    group: int  # the group head that holds it
    parent: int | None  # index into Refinement.nodes
    drop: float  # clean − ablated logit difference (positive = the channels help)
    drop_lo: float
    drop_hi: float
    share: float | None = None  # drop / parent's drop
    counts: bool = False
    outcome: str = ""  # split | channel | set | below (tested, not followed)
    metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "channel_start": self.start, "channel_end": self.end, "level": self.level,
                "group": self.group, "parent": self.parent, "drop": self.drop, "drop_lo": self.drop_lo,
                "drop_hi": self.drop_hi, "share": self.share, "counts": self.counts, "outcome": self.outcome,
                **{k: v for k, v in self.metrics.items()}}


@dataclass
class Refinement:
    """What :func:`refine_channels` found: every node, the leaves as refined heads, the cost."""

    nodes: list[Node]
    leaves: list[HeadId]  # refined heads left in the inventory, one per leaf node
    leaf_nodes: list[int]
    leaf_effects: Scores  # [leaf, prompt] at the tree's scope (effects: ablated − clean)
    ablations: int
    levels: int
    forward_equivalents: float

    def leaf_node(self, head: HeadId) -> Node:
        return self.nodes[self.leaf_nodes[self.leaves.index(head)]]


def channel_sweep_cost(engine: AblationEngine, layers: Sequence[int]) -> float:
    """Forward-equivalents of ablating every channel of the Mamba-1 ``layers`` alone with ``engine``
    (an ablation first editing layer ``l`` recomputes layers ``l..L-1``)."""
    total = 0
    for group in engine.inventory.groups:
        if group.pattern == "mamba1" and group.layer in layers and group.layer < engine.n_active_layers:
            total += group.count * group.width * (engine.n_active_layers - group.layer)
    return total / engine.n_active_layers


def _drop_ci(effects: torch.Tensor, settings: RefineSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drops (−effect) and their interval bounds, ``[node]`` each, from per-prompt effects ``[node, prompt]``."""
    mean, lo, hi = bootstrap_ci(effects, settings.bootstrap, seed=settings.seed)
    return -mean, -hi, -lo


def _counts(drop: float, drop_lo: float, threshold: float) -> bool:
    return drop >= threshold and drop_lo > 0


def _row(scores: Scores, i: int) -> Scores:
    return Scores(*(scores[m][i : i + 1] for m in METRICS))


def refine_channels(engine: AblationEngine, starts: Sequence[HeadId], start_effects: Scores,
                    settings: RefineSettings = RefineSettings()) -> Refinement:
    """Refine the Mamba-1 group heads ``starts`` (their per-prompt effects at ``settings.scope``:
    ``start_effects`` ``[start, prompt]``, as the sweep measured them); see the module docstring. Groups
    that do not count are not refined (they become no nodes)."""
    inv = engine.inventory
    clean_ld = float(engine.clean.logit_diff.mean())
    threshold = settings.effect * abs(clean_ld)
    rows_before = engine.layer_rows
    before = {g.layer: g.spans for g in inv.groups if g.pattern == "mamba1"}
    nodes: list[Node] = []
    effects: list[Scores] = []  # per node [1, prompt]
    heads: list[HeadId] = []  # per node: the head that ablates it
    frontier: list[int] = []
    drop, lo, hi = _drop_ci(start_effects.logit_diff, settings)
    for i, h in enumerate(starts):
        group = inv.group(h.layer, h.kind)
        start, end = group.span(h.index)
        node = Node(h.layer, start, end, 0, h.index, None, float(drop[i]), float(lo[i]), float(hi[i]))
        node.counts = _counts(node.drop, node.drop_lo, threshold)
        if node.counts:
            nodes.append(node)
            effects.append(_row(start_effects, i))
            heads.append(h)
            frontier.append(len(nodes) - 1)
    ablations, levels = 0, 0
    while frontier:
        halves: list[tuple[int, int, int]] = []  # (parent, start, end)
        for p in frontier:
            node = nodes[p]
            if node.size == 1:
                node.outcome = "channel"
                continue
            mid = node.start + node.size // 2
            halves += [(p, node.start, mid), (p, mid, node.end)]
        if not halves:
            break
        ids = [inv.refine(nodes[p].layer, "ssm", [(s, e)])[0] for p, s, e in halves]
        level_effects = engine.effects([Ablation((h,), "zero", settings.scope) for h in ids])
        ablations += len(ids)
        levels += 1
        drop, lo, hi = _drop_ci(level_effects.logit_diff, settings)
        first = len(nodes)
        for j, ((p, s, e), h) in enumerate(zip(halves, ids)):
            parent = nodes[p]
            child = Node(parent.layer, s, e, parent.level + 1, parent.group, p, float(drop[j]), float(lo[j]),
                         float(hi[j]))
            child.share = child.drop / parent.drop if parent.drop > 0 else None
            child.counts = _counts(child.drop, child.drop_lo, threshold)
            nodes.append(child)
            effects.append(_row(level_effects, j))
            heads.append(h)
        frontier = []
        for p in sorted({p for p, _, _ in halves}):
            kids = [i for i in range(first, len(nodes)) if nodes[i].parent == p]
            together = sum(nodes[i].drop for i in kids)
            if not nodes[p].drop > 0 or together < settings.carry * nodes[p].drop:
                nodes[p].outcome = "set"  # the split no longer separates the effect: a redundant set
                follow: list[int] = []
            else:
                nodes[p].outcome = "split"
                follow = [i for i in kids if nodes[i].counts or (nodes[i].share or 0.0) >= settings.carry / 2]
            for i in kids:
                if i not in follow:
                    nodes[i].outcome = "below"
            frontier += follow
    _node_evidence(engine, nodes, heads)
    leaf_nodes = [i for i, n in enumerate(nodes) if n.outcome in ("channel", "set")]
    for layer, spans in before.items():  # keep only the leaves (after the spans held before)
        inv.set_spans(layer, "ssm", spans)
    leaves = []
    for i in leaf_nodes:
        n = nodes[i]
        group = inv.group(n.layer, "ssm")
        leaves.append(HeadId(n.layer, n.group, "ssm") if n.level == 0 and n.size == group.width
                      else inv.refine(n.layer, "ssm", [(n.start, n.end)])[0])
    leaf_effects = Scores.cat([effects[i] for i in leaf_nodes]) if leaf_nodes else _row(start_effects, 0)
    if not leaf_nodes:
        leaf_effects = Scores(*(leaf_effects[m][:0] for m in METRICS))
    forward_eq = (engine.layer_rows - rows_before) / (engine.n_prompts * engine.n_active_layers)
    return Refinement(nodes, leaves, leaf_nodes, leaf_effects, ablations, levels, forward_eq)


def _node_evidence(engine: AblationEngine, nodes: list[Node], heads: list[HeadId]) -> None:
    """Every node's pattern metrics (means over prompts) and direct logit attribution, in place: one
    pattern pass and one DLA pass over the refined layers, every node a refined head of the inventory."""
    from discovery.measure import metrics
    from discovery.measure.dla import head_dla
    from discovery.measure.patterns import pattern_metric_values

    if not nodes:
        return
    lm, batch = engine.lm, engine.batch
    layers = sorted({n.layer for n in nodes})
    values = pattern_metric_values(lm, batch, layers=layers, kinds=["ssm"], engine=engine)
    groups = [g for g in lm.inventory.groups if g.layer in layers and g.kind == "ssm"]
    dla = head_dla(lm, batch, groups, engine)
    means = {key: metrics.summarise(named) for key, named in values.items()}
    for node, h in zip(nodes, heads):
        found = means.get((h.layer, h.kind), {})
        node.metrics = {name: _finite(v[h.index]) for name, v in found.items()}
        node.metrics["dla"] = _finite(dla[(h.layer, h.kind)][h.index])


def _finite(value: torch.Tensor) -> float | None:
    v = float(value.detach())
    return None if math.isnan(v) or math.isinf(v) else v


def summary_fields(ref: Refinement, engine: AblationEngine, settings: RefineSettings,
                   names: Mapping[HeadId, str] | None = None) -> dict[str, Any]:
    """The refinement's record for ``summary.json``: settings, cost against the channel sweep, leaves and
    the tree."""
    layers = sorted({n.layer for n in ref.nodes})
    sweep = channel_sweep_cost(engine, [g.layer for g in engine.inventory.groups if g.pattern == "mamba1"])
    leaves = []
    for h, i in zip(ref.leaves, ref.leaf_nodes):
        n = ref.nodes[i]
        leaves.append({"head": (names or {}).get(h, str(h)), "layer": h.layer, "index": h.index,
                       "channel_start": n.start, "channel_end": n.end, "level": n.level, "kind": n.outcome, "drop": n.drop,
                       "drop_lo": n.drop_lo, "drop_hi": n.drop_hi})
    return {
        "status": "done", "effect": settings.effect, "carry": settings.carry, "scope": list(settings.scope),
        "groups_refined": sum(1 for n in ref.nodes if n.level == 0), "layers": layers, "levels": ref.levels,
        "ablations": ref.ablations, "forward_equivalents": round(ref.forward_equivalents, 3),
        "channel_sweep_forward_equivalents": round(sweep, 3),
        "leaves": leaves, "nodes": [n.as_dict() for n in ref.nodes],
    }
