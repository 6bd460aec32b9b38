"""Shared prefixes: ablations that make the same edits up to a layer have the same hidden state after it, so
the engine computes those layers once for all of them and branches where their edits part (a prefix tree of
passes, planned here without running anything).

The hidden state after layer l depends only on the edits at layers 0..l (each edit is layer-local: a head's
output replaced at some positions, attention or state entries knocked out, a held head set to its clean
value). Who gains:

- a pair test's random controls (x, y): the controls with the same gather head x agree until y's layer;
- a group's layer-matched random draws: draws whose first layers' heads coincide agree until they part;
- a group with one member spared: it agrees with the whole group up to the spared member's layer;
- the mediation test's holds (off the query fast path): each agrees with the bare ablation up to the held layer.

Single-head ablations (the sweep) part at their own layer: their plan is one scored pass each from their
layer, as before. The plan's cost is exact (:meth:`AblationEngine.predicted_forward_equivalents` sums it).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from discovery.measure.edits import Ablation


@dataclass(frozen=True)
class Pass:
    """One pass of a plan: recompute layers ``start..last`` with the edits of ablation ``ablation`` (an index),
    starting from the output at layer ``start - 1`` of pass ``parent`` (None: the clean pass's). A *stem*
    (``last`` set) keeps its output at ``last`` for the passes that branch from it; a *scored* pass (``last``
    None) runs to the readout and gives the scores of ``members`` (ablations whose edits are all equal)."""

    start: int
    last: int | None
    ablation: int
    parent: int | None
    members: tuple[int, ...] = ()


def edit_key(ablation: Ablation, layer: int) -> Hashable | None:
    """What ``ablation`` does at ``layer`` (None: nothing): the heads it edits there and how, the heads it
    holds there. A hold before the first edited layer is a no-op (nothing upstream changed) and is left out."""
    heads = tuple(sorted(h for h in ablation.heads if h.layer == layer))
    held = tuple(sorted(h for h in ablation.hold if h.layer == layer)) if layer >= ablation.first_layer else ()
    if not heads and not held:
        return None
    how = (ablation.method, ablation.scope, ablation.keys if ablation.method == "knockout" else ()) if heads else ()
    return heads, how, held, (ablation.hold_scope if held else ())


def plan_passes(ablations: Sequence[Ablation], n_layers: int) -> list[Pass]:
    """The prefix-tree plan for ``ablations`` over layers ``0..n_layers-1``, parents before children, each
    stem's scored children next to each other (so siblings that start at one layer batch together)."""
    keys = [[edit_key(a, layer) for layer in range(n_layers)] for a in ablations]
    passes: list[Pass] = []
    # (members, start, parent): members agree on every layer before start; parent holds their state there
    todo: list[tuple[list[int], int, int | None]] = [(list(range(len(ablations))), 0, None)]
    while todo:
        members, start, parent = todo.pop()
        part = start  # the first layer where the members' edits differ
        while part < n_layers and len({keys[i][part] for i in members}) == 1:
            part += 1
        edited = [layer for layer in range(start, part) if keys[members[0]][layer] is not None]
        first = edited[0] if parent is None and edited else start  # no edit yet: the clean state is free
        if part == n_layers:
            passes.append(Pass(first, None, members[0], parent, tuple(members)))
            continue
        if part > start and (parent is not None or edited):
            passes.append(Pass(first, part - 1, members[0], parent))
            parent = len(passes) - 1
        branches: dict[Hashable, list[int]] = {}
        for i in members:
            branches.setdefault(keys[i][part], []).append(i)
        groups = list(branches.values())
        # depth first; the branches that end in one scored pass first, in order, so they batch together
        singles = [g for g in groups if len(g) == 1]
        todo += [(g, part, parent) for g in groups if len(g) > 1][::-1]
        todo += [(g, part, parent) for g in singles][::-1]
    return passes
