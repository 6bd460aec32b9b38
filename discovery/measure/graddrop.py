"""AtP* GradDrop (Kramár et al. 2024): the attribution screen rerun with one layer's gradient dropped at a time.

Plain AtP multiplies a head's ablation direction by the metric's gradient at the head. When later
layers cancel a head's effect (one compensates for another, or a saturated nonlinearity sits in
between), that gradient can be small though the effect is not. GradDrop reruns the backward ``L-1``
times; in rerun ``l`` the gradient through layer ``l``'s block (its attention/SSM and MLP branches)
is dropped and only the residual path is kept, and a head is scored by the mean, over the layers
``l`` after it, of the absolute value of its estimate from rerun ``l``::

    graddrop[h, prompt] = mean_{l > layer(h)} | sum_{pos in scope} (x_ablated - x)[pos, h] · g_l[pos, h] |

where ``g_l`` is ``dMetric/dx`` with layer ``l``'s block treated as the identity's complement
(``out = in + block(in)`` with ``block`` held constant). A head in the last layer has no later
layer; its score is ``|AtP|``. The score is a magnitude: it ranks heads, it does not sign them.

Computed without ``L`` full backwards: the residual stream at layer ``l``'s input is a cut between the
heads below ``l`` and the metric, and with ``l``'s block dropped the gradient there equals the
(unchanged) gradient at ``l``'s output. So one full backward yields the gradient at every layer's
output, and rerun ``l`` is a backward from layer ``l``'s input, seeded with that gradient, through
layers ``< l`` only: about ``1 + 1 + (L-1)/2`` forward-equivalents in all, counted by
:class:`~discovery.measure.flops.MatmulFlops` like the other screens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from discovery.heads import HeadId
from discovery.measure.ablation import scope_positions
from discovery.model.intervene import PassConfig, _hidden_of
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch


@dataclass
class GradDropResult:
    """GradDrop scores ``estimate`` ``[head, prompt]`` (non-negative), with what they are made of.

    ``plain`` ``[head, prompt]``: the plain AtP estimate from the same forward and backward;
    ``dropped`` ``[layer, head, prompt]``: the signed estimate with layer ``l``'s gradient dropped
    (NaN where ``l`` is not after the head); ``forward_equivalents``: matmul FLOPs of the whole
    screen over one clean forward's.
    """

    heads: list[HeadId]
    estimate: torch.Tensor  # [head, prompt]
    plain: torch.Tensor  # [head, prompt]
    dropped: torch.Tensor  # [layer, head, prompt]
    metric: str
    method: str
    scope: tuple[str, ...]
    passes: int
    forward_equivalents: float


def graddrop_score(dropped: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """``[head, prompt]``: mean over the layers where ``dropped`` ``[layer, head, prompt]`` is defined of its
    absolute value; ``|plain|`` where no layer is (heads in the last layer)."""
    defined = ~torch.isnan(dropped)  # [layer, head, prompt]
    count = defined.sum(0)  # [head, prompt]
    total = torch.where(defined, dropped.abs(), torch.zeros_like(dropped)).sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), plain.abs())


class _Layers:
    """Hooks capturing each decoder layer's input and output hidden states (kept in the autograd graph)."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = []
        for index, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(index)))

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            self.inputs[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            self.outputs[index] = _hidden_of(output)

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def run_graddrop_chunk(screen: Any, rows: slice, plain: torch.Tensor, dropped: torch.Tensor) -> None:
    """Fill ``plain[:, rows]`` and ``dropped[:, :, rows]`` for one chunk of prompts.

    ``screen`` is the attribution screen's state (``attribution._Screen`` built without the QK fix):
    its intervener, batch, heads, replacement values and FLOP counter are reused."""
    from discovery.measure.attribution import capture_input

    part = screen.batch.select(rows)
    classes = part.position_classes()
    where = scope_positions(classes, screen.scope)  # [prompt, pos]
    xs: dict[tuple[int, str], torch.Tensor] = {}
    hooks = _Layers(screen.lm.adapter.layers())
    before = screen.flops.total
    try:
        with torch.enable_grad(), screen.intervener.run(PassConfig(proj_edits={k: capture_input(xs, k) for k in screen.groups})):
            out = screen.model(**screen._inputs(part))
            total = screen._metric(out.logits, part).sum()
    finally:
        hooks.close()
    screen.clean_flops += screen.flops.total - before
    keys = list(xs)
    lowest = min(layer for layer, _ in keys)
    drops = [m for m in sorted(hooks.outputs) if m > lowest and hooks.inputs[m].requires_grad]
    grads = torch.autograd.grad(total, [xs[k] for k in keys] + [hooks.outputs[m] for m in drops],
                                retain_graph=bool(drops), allow_unused=True)
    n = rows.stop - rows.start
    diffs = {key: (screen._replacement(key, xs[key].detach(), classes) - xs[key].detach()) * where[..., None]
             for key in keys}  # [prompt, pos, in]

    def per_head(key: tuple[int, str], g: torch.Tensor | None, into: torch.Tensor) -> None:
        diff = diffs[key]
        g = torch.zeros_like(diff) if g is None else g
        group = screen.inventory.group(*key)
        values = (diff.float() * g.float()).view(n, diff.shape[1], group.count, group.width).sum((1, 3))  # [prompt, head]
        for index in range(group.count):
            head = HeadId(key[0], index, key[1])
            if head in screen.row_of:
                into[screen.row_of[head], rows] = values[:, index]

    for key, g in zip(keys, grads[: len(keys)], strict=True):
        per_head(key, g, plain)
    for i, (m, seed) in enumerate(zip(drops, grads[len(keys):], strict=True)):
        below = [k for k in keys if k[0] < m]
        if seed is None or not below:
            continue
        last = i == len(drops) - 1
        g_below = torch.autograd.grad(hooks.inputs[m], [xs[k] for k in below], grad_outputs=seed,
                                      retain_graph=not last, allow_unused=True)
        for key, g in zip(below, g_below, strict=True):
            per_head(key, g, dropped[m])
    if rows.start == 0:  # each rerun is one backward over the whole batch, however it is chunked
        screen.passes += len(drops)


def graddrop_screen(lm: LoadedModel, batch: AnnotatedBatch, *, heads: Sequence[HeadId] | None = None,
                    method: str = "zero", scope: Sequence[str] = ("all",), metric: str = "logit_diff",
                    chunk_prompts: int = 8) -> GradDropResult:
    """AtP* GradDrop scores (magnitudes) of every head, or of ``heads``: the arguments as
    :func:`~discovery.measure.attribution.atp_effects` takes them (plain AtP gradients, no QK fix)."""
    from discovery.measure.attribution import _check
    from discovery.model.loading import as_loaded

    lm = as_loaded(lm)
    chosen = _check(lm, batch, heads, method, scope, metric, chunk_prompts)
    return graddrop_effects(lm, batch, chosen, method, scope, metric, chunk_prompts)


def graddrop_effects(lm: LoadedModel, batch: AnnotatedBatch, chosen: list[HeadId], method: str,
                     scope: Sequence[str], metric: str, chunk_prompts: int) -> GradDropResult:
    """GradDrop scores of ``chosen`` heads (checked by the caller, :func:`graddrop_screen`)."""
    from discovery.measure.attribution import _Screen

    screen = _Screen(lm, batch, chosen, method, scope, metric, False, 256)
    n, n_layers = len(batch), lm.inventory.n_layers
    chunks = [slice(s, min(s + chunk_prompts, n)) for s in range(0, n, chunk_prompts)]
    plain = torch.zeros(len(chosen), n, device=screen.device)  # [head, prompt]
    dropped = torch.full((n_layers, len(chosen), n), float("nan"), device=screen.device)  # [layer, head, prompt]
    with screen.flops:
        if method == "mean":
            screen.compute_means(chunks)
        for rows in chunks:
            run_graddrop_chunk(screen, rows, plain, dropped)
    screen.passes += 2  # the clean forward and the full backward
    for i, h in enumerate(chosen):  # a rerun that reached no head of a layer leaves it undefined there
        dropped[: h.layer + 1, i] = float("nan")
    plain, dropped = plain.cpu(), dropped.cpu()
    return GradDropResult(heads=chosen, estimate=graddrop_score(dropped, plain), plain=plain, dropped=dropped,
                          metric=metric, method=method, scope=tuple(scope), passes=screen.passes,
                          forward_equivalents=screen.flops.total / max(1, screen.clean_flops))
