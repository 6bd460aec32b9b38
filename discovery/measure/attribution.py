"""The attribution screen: every head's ablation effect estimated from one forward and one backward.

**AtP** (attribution patching, Kramár et al. 2024). One clean forward through the
:class:`~discovery.intervene.Intervener` captures each head group's out-projection input ``x``
(the same place the ablation engine edits); the metric (per prompt, summed over prompts) is
backpropagated once. A head's estimated effect is the first-order change of the metric when its
slice of ``x`` is replaced, at the scope's positions, by the ablated value::

    estimate[h, prompt] = sum_{pos in scope} (x_ablated - x)[pos, h] · dMetric/dx[pos, h]

with ``x_ablated`` = 0 (zero) or the per-position-class mean over the batch (mean; the engine's
own :func:`~discovery.ablation.class_means`, so both ablate to the same values). Same sign as
``engine.run(...)[metric] - engine.clean[metric]``. SSM heads use exactly this.

**QK fix** (the attention-saturation fix of AtP*). Ablating a head changes the residual stream that
later attention layers read their queries and keys from; through a saturated softmax that change can
move a pattern far more (or far less) than the gradient says. AtP* fixes this by computing the change
of the attention *scores* and pushing it through the softmax exactly, weighting the change of the
probabilities with the gradient with respect to them. Here, for every wanted head ``h`` that writes
straight into the residual stream (its out-projection output, times the layer's fixed multiplier;
attention and SSM heads alike) and every later attention layer ``m``, at each prompt's query row
(where the metric is read):

1. ``delta_h``: ``h``'s direct write under the ablation, ``(x_ablated - x)[h] @ W_out[h]^T`` at
   every position (the same-layer MLP and later layers are not followed);
2. the query row's score change: exact for the query (layer ``m``'s own code recomputes the query
   and the query position's own key from the clean input plus ``delta_h`` there, one token per
   source head, so norms, RoPE and QK norms apply), first order for the keys at the other positions
   (``<d score_j / d input_j, delta_h[j]>``, the gradients taken once per query head by short
   backwards through the layer's key path); the product of the two changes is left out, as AtP*
   leaves it out by treating queries and keys as separate nodes;
3. the new row ``A'`` = softmax of the new scores (with the model's scale, soft-capping and mask),
   and the correction ``<dM/dA_m, A' - A_m> - <L_m, delta_h>`` added to the AtP estimate, where
   ``L_m`` (one backward of the row's ``<dM/dA_m, A_m>`` through layer ``m``'s query/key path) is
   what AtP itself counted for that path to first order. For a small ``delta_h`` the correction
   vanishes; when the pattern saturates it replaces the linear guess.

Exact when the sources move only the keys, linearly (tested on a model built that way). Heads whose
write passes through a norm or another block first (Gemma 2/3 and OLMo 2 post-norms, Zamba2's
shared attention block) get plain AtP. Cost: the query passes and key-path backwards are a fraction
of a layer each; on SmolLM2-135M (270 heads, 8 prompts) the fixed screen costs 3.3-3.4
forward-equivalents against 2.0 for plain AtP, both measured.

**Cost** is measured, not assumed: :class:`~discovery.flops.MatmulFlops` counts the matmul FLOPs
of everything the screen runs (means, forward, backward, the fix) and
:attr:`AttributionResult.forward_equivalents` divides them by those of the clean forward it runs.
With frozen weights a backward computes input gradients only, about one forward.

:func:`rank_agreement` compares an estimate with exact effects (Spearman, recall@k by |effect|).
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from discovery.errors import GascanError
from discovery.heads import HeadId
from discovery.measure.ablation import SCOPES, class_index, class_means, scope_positions
from discovery.measure.flops import MatmulFlops
from discovery.measure.patterns import model_inputs
from discovery.model.intervene import Intervener, PassConfig
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch
from discovery.tasks.scoring import next_token_scores, query_logits

ATP_METHODS = ("zero", "mean")
ATP_METRICS = ("logit_diff", "gold_logprob")  # differentiable; accuracy is not


@dataclass
class AttributionResult:
    """AtP estimates for ``heads``: ``estimate`` ``[head, prompt]`` (change of ``metric`` under the ablation).

    ``qk_correction`` ``[head, prompt]`` is the part of ``estimate`` that the QK fix added (``None``
    when it did not run; zero for heads it does not apply to). ``passes`` counts full-batch forwards
    and backwards (each backward counted once); ``forward_equivalents`` is the measured cost: matmul
    FLOPs of the whole screen over those of one clean forward over the batch.
    """

    heads: list[HeadId]
    estimate: torch.Tensor  # [head, prompt]
    metric: str
    method: str
    scope: tuple[str, ...]
    passes: int
    forward_equivalents: float
    qk_correction: torch.Tensor | None = None  # [head, prompt]

    def frame(self):
        """One row per head: ``layer, head, kind, atp_<metric>`` (mean over prompts)."""
        import polars as pl

        mean = self.estimate.float().mean(-1)  # [head]
        return pl.DataFrame({
            "layer": [h.layer for h in self.heads],
            "head": [h.index for h in self.heads],
            "kind": [h.kind for h in self.heads],
            f"atp_{self.metric}": mean.tolist(),
        })


def _check(lm: LoadedModel, batch: AnnotatedBatch, heads, method: str, scope: Sequence[str], metric: str,
           chunk_prompts: int) -> list[HeadId]:
    if method not in ATP_METHODS:
        raise GascanError(f"the attribution screen cannot estimate {method!r} ablations",
                          f"use one of {', '.join(ATP_METHODS)}, or the exact sweep for other interventions")
    bad = [s for s in scope if s not in SCOPES]
    if bad or not scope:
        raise GascanError(f"unknown position class {bad[0] if bad else '(none)'!r} in the attribution scope",
                          f"use one or more of {', '.join(SCOPES)}")
    if metric not in ATP_METRICS:
        raise GascanError(f"the attribution screen needs a differentiable metric, not {metric!r}",
                          f"use one of {', '.join(ATP_METRICS)}")
    if chunk_prompts < 1:
        raise GascanError(f"chunk_prompts must be at least 1, got {chunk_prompts}", "pass a positive number")
    known = set(lm.inventory.heads())
    chosen = list(lm.inventory.heads() if heads is None else heads)
    missing = [h for h in chosen if h not in known]
    if missing:
        raise GascanError(f"head {missing[0]} is not in this model", "pick heads from `gascan inspect MODEL`")
    return chosen


def capture_input(into: dict, key: tuple[int, str]):
    """A projection edit that keeps its input ``[prompt, pos, in]`` in ``into[key]``, in the autograd graph."""

    def edit(x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:  # frozen weights: make the captured input the graph's leaf
            x = x.detach().requires_grad_(True)
        into[key] = x
        return x

    return edit


class _Stop(Exception):
    """Raised by a sink to end a partial forward once the wanted tensors exist."""


@dataclass
class _Target:
    """What the QK fix knows of one later attention layer at each prompt's query row (clean run)."""

    layer: int
    probs: torch.Tensor  # [prompt, head, key] the query row's attention probabilities
    grad: torch.Tensor  # [prompt, head, key] dMetric/dA on that row
    raw: torch.Tensor  # [prompt, head, key] scaled scores before soft-capping (log-probs up to a constant)
    keys: torch.Tensor  # [prompt, head, key, d_head] keys as the attention function saw them, per query head
    valid: torch.Tensor  # [prompt, key] bool: the keys the query row may read
    at_query: torch.Tensor  # [prompt, key] bool: True at each prompt's query position
    key_grad: torch.Tensor  # [prompt, pos, d_model, head] d(raw on the query row)/d(layer input) via the keys
    linear: torch.Tensor  # [prompt, pos, d_model] d<grad, probs>/d(layer input): AtP's first order on this row
    query_input: torch.Tensor  # [prompt, d_model] the layer's clean input at the query position
    scale: float
    softcap: float | None

    def __post_init__(self) -> None:
        self.clean = self.pattern(self.raw.float())  # [prompt, head, key]: the row the scores above give

    def pattern(self, raw: torch.Tensor) -> torch.Tensor:
        """Softmax of ``raw`` ``[..., prompt, head, key]`` after the model's soft-capping, on the valid keys."""
        scores = raw if self.softcap is None else self.softcap * torch.tanh(raw / self.softcap)
        return torch.softmax(scores.masked_fill(~self.valid[:, None], float("-inf")), dim=-1)


DIRECTION_ELEMENTS = 1 << 26  # QK fix: elements of the targets' key-path gradients held at once (256 MiB float32)


def _key_path_grads(key: torch.Tensor, layer_input: torch.Tensor, cotangents: torch.Tensor) -> torch.Tensor:
    """``d<cotangent_h, key>/d layer_input`` for every row ``h`` of ``cotangents`` ``[h, *key.shape]``: one
    vmapped backward (``is_grads_batched``), or one backward per row where an op of the key path has no
    batching rule. ``[h, *layer_input.shape]``, detached."""
    try:
        (grads,) = torch.autograd.grad(key, layer_input, grad_outputs=cotangents, retain_graph=True,
                                       is_grads_batched=True)
        return grads.detach()
    except RuntimeError:  # an op without a vmap rule (a custom kernel): the plain per-row backward
        return torch.stack([torch.autograd.grad(key, layer_input, grad_outputs=c, retain_graph=True)[0].detach()
                            for c in cotangents])


def _valid_keys(mask, query_pos: torch.Tensor, n_keys: int) -> torch.Tensor:
    """``[prompt, key]`` bool from the attention function's mask at each prompt's query row."""
    rows = torch.arange(len(query_pos), device=query_pos.device)
    if mask is None:  # plain causal attention
        return torch.arange(n_keys, device=query_pos.device)[None] <= query_pos[:, None]
    row = mask[rows, 0, query_pos]  # [prompt, key]
    if row.dtype == torch.bool:
        return row
    return row > torch.finfo(row.dtype).min / 2


class _Screen:
    """State of one AtP run over a batch (see :func:`atp_effects`)."""

    def __init__(self, lm: LoadedModel, batch: AnnotatedBatch, heads: list[HeadId], method: str,
                 scope: Sequence[str], metric: str, qk_fix: bool, max_rows: int) -> None:
        self.lm, self.model, self.inventory = lm, lm.model, lm.inventory
        self.device = next(self.model.parameters()).device
        self.batch = batch.to(self.device)
        self.heads, self.method, self.scope, self.metric = heads, method, tuple(scope), metric
        self.max_rows = max_rows
        self.intervener = Intervener(lm.adapter)
        self.left = batch.padding_side == "left"
        self.keep_last = self.left and "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.groups = sorted({(h.layer, h.kind) for h in heads})
        self.row_of = {h: i for i, h in enumerate(heads)}
        self.passes = 0
        self.flops = MatmulFlops()
        self.clean_flops = 0  # FLOPs of the clean forward over the whole batch, measured as it runs
        attn_layers = sorted({g.layer for g in self.inventory.groups if g.kind == "attn"})
        # QK fix: sources are wanted heads that write straight into the residual stream and have a
        # later attention layer; targets are those later attention layers
        self.sources: dict[tuple[int, str], list[int]] = {}
        if qk_fix:
            for h in heads:
                if any(m > h.layer for m in attn_layers) and lm.adapter.residual_write_scale(h.layer, h.kind):
                    self.sources.setdefault((h.layer, h.kind), []).append(h.index)
        first = min((layer for layer, _ in self.sources), default=None)
        self.targets = [m for m in attn_layers if first is not None and m > first]
        self.means: dict[tuple[int, str], torch.Tensor] = {}  # [class, in]
        if self.sources:  # the query passes stub the layers before the target layer
            self.intervener.learn_layer_output_format(self.batch.input_ids)

    # -- inputs -----------------------------------------------------------------------------------
    def _inputs(self, part: AnnotatedBatch) -> dict[str, torch.Tensor]:
        kwargs = model_inputs(self.model, part)
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        return kwargs

    def _metric(self, logits: torch.Tensor, part: AnnotatedBatch) -> torch.Tensor:
        """Per-prompt metric ``[prompt]`` from the model's logits."""
        q = logits[:, -1] if self.left else query_logits(logits, part)  # [prompt, vocab]
        return next_token_scores(q, part)[self.metric]

    # -- mean ablation values -----------------------------------------------------------------------
    def compute_means(self, chunks: list[slice]) -> None:
        """Class means of every needed group's out-projection input over the whole batch (one forward)."""
        keys = list(self.groups)  # QK-fix sources are wanted heads, so their groups are here too
        parts: dict[tuple[int, str], list[torch.Tensor]] = {k: [] for k in keys}

        def grab(key):
            def edit(x: torch.Tensor) -> torch.Tensor:
                parts[key].append(x.detach())
                return x

            return edit

        for rows in chunks:
            part = self.batch.select(rows)
            with torch.no_grad(), self.intervener.run(PassConfig(proj_edits={k: grab(k) for k in keys})):
                self.model(**self._inputs(part))
        classes = self.batch.position_classes()
        for key, xs in parts.items():
            self.means[key] = class_means(torch.cat(xs), classes)  # [class, in]
        self.passes += 1

    def _replacement(self, key: tuple[int, str], x: torch.Tensor, classes: dict[str, torch.Tensor]) -> torch.Tensor:
        """The ablated value of ``x`` ``[prompt, pos, in]`` everywhere (0, or the class mean)."""
        if self.method == "zero":
            return torch.zeros_like(x)
        return self.means[key][class_index(classes)].to(x.dtype)  # [prompt, pos, in]

    # -- one chunk of prompts -------------------------------------------------------------------------
    def run_chunk(self, rows: slice, estimate: torch.Tensor, correction: torch.Tensor | None) -> None:
        """Fill ``estimate[:, rows]`` (and the QK ``correction[:, rows]``) for one chunk of prompts."""
        part = self.batch.select(rows)
        classes = part.position_classes()
        where = scope_positions(classes, self.scope)  # [prompt, pos]
        xs: dict[tuple[int, str], torch.Tensor] = {}
        probs: dict[int, torch.Tensor] = {}
        hidden: dict[int, torch.Tensor] = {}
        qk: dict[int, tuple] = {}

        def capture_probs(layer):
            def edit(p: torch.Tensor) -> torch.Tensor:
                probs[layer] = p
                return p

            return edit

        def capture_qk(layer):
            def sink(query, key, mask, kwargs) -> None:
                qk[layer] = (query, key, mask, kwargs.get("scaling"), kwargs.get("softcap"))

            return sink

        config = PassConfig(proj_edits={k: capture_input(xs, k) for k in self.groups})
        if self.sources:
            config.prob_edits = {m: capture_probs(m) for m in self.targets}
            config.qk_sinks = {m: capture_qk(m) for m in self.targets}
            config.layer_sinks = {m - 1: (lambda h, i=m - 1: hidden.__setitem__(i, h)) for m in self.targets}
        before = self.flops.total
        with torch.enable_grad(), self.intervener.run(config):
            out = self.model(**self._inputs(part))
            total = self._metric(out.logits, part).sum()
        self.clean_flops += self.flops.total - before
        keys = list(xs)
        targets = [m for m in self.targets if m in probs and probs[m].requires_grad and hidden[m - 1].requires_grad]
        inputs = [xs[k] for k in keys] + [probs[m] for m in targets]
        grads = torch.autograd.grad(total, inputs, retain_graph=bool(targets), allow_unused=True)
        n = rows.stop - rows.start
        diffs = {}  # ablated minus clean out-projection input at the scope's positions: [prompt, pos, in]
        for key, g in zip(keys, grads[: len(keys)], strict=True):
            x = xs[key].detach()
            g = torch.zeros_like(x) if g is None else g
            diff = diffs[key] = (self._replacement(key, x, classes) - x) * where[..., None]
            group = self.inventory.group(*key)
            per_head = (diff.float() * g.float()).view(n, x.shape[1], group.count, group.width).sum((1, 3))
            for index in range(group.count):
                head = HeadId(key[0], index, key[1])
                if head in self.row_of:
                    estimate[self.row_of[head], rows] = per_head[:, index]
        if not self.sources:
            return
        deltas = self._direct_writes(diffs)
        xs.clear()
        diffs.clear()
        order = sorted(deltas)  # source groups by layer: the sources before a target are a prefix
        sizes = [deltas[key].shape[2] for key in order]
        writes = torch.cat([deltas.pop(key) for key in order], dim=2)  # [prompt, pos, source head, d]
        before = {m: sum(size for key, size in zip(order, sizes, strict=True) if key[0] < m) for m in targets}
        fix = torch.zeros(writes.shape[2], n, device=self.device)  # [source head, prompt]
        pending = [(m, g) for m, g in zip(targets, grads[len(keys):], strict=True) if g is not None and before[m]]
        per_target = writes[:, :, 0].numel() * (probs[pending[0][0]].shape[1] + 1) if pending else 1
        size = max(1, DIRECTION_ELEMENTS // per_target)
        for first in range(0, len(pending), size):  # the targets' key paths are the screen's largest tensors
            group = [self._target(part, m, probs[m], g, hidden[m - 1], qk[m]) for m, g in pending[first:first + size]]
            self._fix_group(part, group, writes, before, fix)
        for (layer, kind), part_fix in zip(order, fix.split(sizes), strict=True):
            for a, index in enumerate(self.sources[(layer, kind)]):
                head = HeadId(layer, index, kind)
                estimate[self.row_of[head], rows] += part_fix[a]
                if correction is not None:
                    correction[self.row_of[head], rows] = part_fix[a]

    # -- the QK fix ------------------------------------------------------------------------------------
    def _target(self, part: AnnotatedBatch, layer: int, probs: torch.Tensor, grad: torch.Tensor, layer_input: torch.Tensor,
                captured: tuple) -> _Target:
        """The clean query row of one target layer, the gradient of its scores through the keys, and
        AtP's own first-order term for it (two short backwards through the layer's query/key path)."""
        query, key, mask, scale, softcap = captured
        n, n_heads = probs.shape[:2]
        rows = torch.arange(n, device=self.device)
        qpos = part.query_pos.to(self.device)
        n_rep = n_heads // key.shape[1]
        scale = float(query.shape[-1] ** -0.5 if scale is None else scale)
        q_row = query.detach()[rows, :, qpos]  # [prompt, head, d_head]
        keys = key.detach().repeat_interleave(n_rep, dim=1)  # [prompt, head, key, d_head]
        raw = scale * torch.einsum("nhd,nhkd->nhk", q_row, keys)
        row_grad = torch.zeros_like(probs)
        row_grad[rows, :, qpos] = grad[rows, :, qpos]
        (linear,) = torch.autograd.grad(probs, layer_input, grad_outputs=row_grad, retain_graph=True)
        # d(scale * q_h . k_j)/d(layer input at j), the query held fixed: one batched backward for all heads
        cotangents = torch.zeros((n_heads, *key.shape), dtype=key.dtype, device=key.device)  # [h, *key]
        for h in range(n_heads):
            cotangents[h, :, h // n_rep] = scale * q_row[:, h, None, :]
        key_grad = _key_path_grads(key, layer_input, cotangents)  # [h, prompt, pos, d_model]
        key_grad[:, rows, qpos] = 0.0  # the query position's own key is recomputed exactly in the query pass
        at_query = torch.arange(key.shape[2], device=self.device)[None] == qpos[:, None]  # [prompt, key]
        return _Target(layer=layer, probs=probs.detach()[rows, :, qpos], grad=grad.detach()[rows, :, qpos], raw=raw,
                       keys=keys, valid=_valid_keys(mask, qpos, key.shape[2]), at_query=at_query,
                       key_grad=key_grad.permute(1, 2, 3, 0), linear=linear.detach(),
                       query_input=layer_input.detach()[rows, qpos], scale=scale, softcap=softcap)

    def _query_pass(self, part: AnnotatedBatch, layer: int, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys that ``layer`` computes from ``start`` ``[prompt, k, d_model]``: k alternative
        inputs at each prompt's query position, run as k tokens that all sit at that position (so the
        model's own norm, projections, position encoding and QK norm apply); nothing after is computed."""
        n, k = start.shape[:2]
        qpos = part.query_pos.to(self.device)
        rows = torch.arange(n, device=self.device)
        token = part.input_ids.to(self.device)[rows, qpos]
        inputs: dict[str, object] = {"input_ids": token[:, None].expand(n, k),
                                     "attention_mask": torch.ones(n, k, dtype=torch.long, device=self.device),
                                     "use_cache": False}
        clean = model_inputs(self.model, part)  # the clean run's position ids, when the model takes them
        if "position_ids" in clean:
            inputs["position_ids"] = clean["position_ids"].to(self.device)[rows, qpos][:, None].expand(n, k)
        kept: list[torch.Tensor] = []

        def sink(query, key, mask, kwargs) -> None:
            kept.extend([query.detach(), key.detach()])
            raise _Stop

        config = PassConfig(qk_sinks={layer: sink}, start_layer=layer, start_hidden=start)
        try:
            with torch.no_grad(), self.intervener.run(config):
                self.model(**inputs)
        except _Stop:
            pass
        return kept[0], kept[1]  # [prompt, head, k, d_head], [prompt, kv_head, k, d_head]

    def _direct_writes(self, diffs: dict[tuple[int, str], torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
        """Each source head's direct write into the residual stream under the ablation,
        ``(x_ablated - x)[head] @ W_out[head]^T`` times the layer's write scale: ``[prompt, pos, head, d_model]``
        (heads next to the model dimension, so the fix contracts them with batched matmuls and no copies)."""
        out = {}
        for key, indices in self.sources.items():
            diff = diffs[key].float()  # [prompt, pos, in]
            group = self.inventory.group(*key)
            weight = self.lm.adapter.out_proj_weight(*key).detach().float()  # [d_model, in]
            write = self.lm.adapter.residual_write_scale(*key)
            out[key] = torch.stack([write * diff[..., group.columns(i)] @ weight[:, group.columns(i)].T
                                    for i in indices], dim=2)
        return out

    def _fix_group(self, part: AnnotatedBatch, group: list[_Target], writes: torch.Tensor, before: dict[int, int],
                   fix: torch.Tensor) -> None:
        """Add to ``fix`` ``[source head, prompt]`` the QK fix on each target of ``group`` of the source heads
        before it (their direct writes: the first ``before[layer]`` heads of ``writes`` ``[prompt, pos, head, d]``).

        One batched matmul contracts every source's write with every target's key-path gradients and
        first-order direction (on SmolLM2, per source-target pair einsums took 4/5 of the screen's wall time;
        the sources after a target are computed and dropped, cheaper than small matmuls)."""
        directions = torch.cat([torch.cat([t.key_grad.float(), t.linear.float()[..., None]], dim=-1) for t in group],
                               dim=-1)  # [prompt, pos, d, Σ(h+1)]
        reach = max(before[t.layer] for t in group)
        products = torch.matmul(writes[:, :, :reach], directions)  # [prompt, pos, source head, Σ(h+1)]
        prompt = torch.arange(len(part), device=self.device)
        query_rows = writes[prompt, part.query_pos.to(self.device)]  # [prompt, source head, d]
        column = 0
        for target in group:
            width = target.key_grad.shape[-1] + 1
            k = before[target.layer]
            own = products[:, :, :k, column:column + width]  # [prompt, pos, head, h+1]
            fix[:k] += self._fix_for(part, target, own, query_rows[:, :k])
            column += width

    def _fix_for(self, part: AnnotatedBatch, target: _Target, products: torch.Tensor, query_rows: torch.Tensor
                 ) -> torch.Tensor:
        """The QK fix ``[head, prompt]`` on one target layer's query row of source heads whose direct writes,
        contracted with the target's key-path gradients and first-order direction, are ``products``
        ``[prompt, pos, head, h+1]``, and whose writes at the query row are ``query_rows`` ``[prompt, head, d]``
        (see the module docstring). The queries are recomputed in passes of up to ``max_rows`` rows."""
        n = len(part)
        moved_all = products[..., :-1].permute(2, 0, 3, 1)  # keys, first order: [head, prompt, h, key]
        first_order = products[..., -1].sum(1).T  # AtP's own term for this row: [head, prompt]
        per_pass = max(1, self.max_rows // n)
        fixes = []
        for first in range(0, query_rows.shape[1], per_pass):
            block = slice(first, first + per_pass)
            # the query row itself: queries (and the query position's own key) exact, from the layer's code
            start = target.query_input[:, None].float() + query_rows[:, block]  # [prompt, head, d]
            q_new, k_new = self._query_pass(part, target.layer, start.to(target.query_input.dtype))
            q_new = q_new.float()  # [prompt, h, head, d_head]
            k_new = k_new.float().repeat_interleave(q_new.shape[1] // k_new.shape[1], dim=1)
            raw_q = target.scale * torch.einsum("nhkd,nhpd->knhp", q_new, target.keys.float())
            own = target.scale * (q_new * k_new).sum(-1)  # [prompt, h, head]: the new query . its own new key
            moved = torch.where(target.at_query[None, :, None, :], own.permute(2, 0, 1)[..., None],
                                moved_all[block] + raw_q) - target.raw[None].float()
            exact = ((target.pattern(target.raw[None].float() + moved) - target.clean[None])
                     * target.grad[None].float()).sum((2, 3))  # [head, prompt]
            fixes.append(exact - first_order[block])
        return torch.cat(fixes)


def atp_effects(lm: LoadedModel, batch: AnnotatedBatch, *, heads: Sequence[HeadId] | None = None,
                method: str = "zero", scope: Sequence[str] = ("all",), metric: str = "logit_diff",
                qk_fix: bool = True, chunk_prompts: int = 8, max_rows: int = 4096) -> AttributionResult:
    """AtP (with the QK fix for attention heads when ``qk_fix``) estimates of every head's ablation effect.

    ``method``: ``zero`` or ``mean`` (per-position-class mean over the batch, as the engine ablates);
    ``scope``: position classes where the head is ablated; ``metric``: ``logit_diff`` or
    ``gold_logprob`` at the query position over the candidates' first tokens, exactly as the ablation
    engine scores (whatever the task's own scoring). Prompts are processed ``chunk_prompts`` at a time; the
    QK fix's query passes hold at most ``max_rows`` rows. See the module docstring for exactly
    what is approximated. AtP* GradDrop: :func:`discovery.measure.graddrop.graddrop_screen`.
    """
    from discovery.model.loading import as_loaded

    lm = as_loaded(lm)  # a LoadedModel, an nnsight LanguageModel or a transformers model
    chosen = _check(lm, batch, heads, method, scope, metric, chunk_prompts)
    screen = _Screen(lm, batch, chosen, method, scope, metric, qk_fix, max_rows)
    n = len(batch)
    chunks = [slice(s, min(s + chunk_prompts, n)) for s in range(0, n, chunk_prompts)]
    estimate = torch.zeros(len(chosen), n, device=screen.device)  # [head, prompt]
    correction = torch.zeros_like(estimate) if qk_fix else None
    with screen.flops:
        if method == "mean":
            screen.compute_means(chunks)
        for rows in chunks:
            screen.run_chunk(rows, estimate, correction)
    screen.passes += 2  # the clean forward and the backward (in chunks, over the whole batch)
    return AttributionResult(
        heads=chosen, estimate=estimate.cpu(), metric=metric, method=method, scope=tuple(scope),
        passes=screen.passes, forward_equivalents=screen.flops.total / max(1, screen.clean_flops),
        qk_correction=None if correction is None else correction.cpu(),
    )


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n with ties given their average rank."""
    values = values.double()
    order = torch.argsort(values, stable=True)
    ranks = torch.empty_like(values)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    for v in torch.unique(values):
        tie = values == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a - a.mean(), b - b.mean()
    denom = float(a.norm() * b.norm())
    return None if denom == 0.0 else float((a * b).sum()) / denom


def rank_agreement(estimate: torch.Tensor, exact: torch.Tensor, k: int = 5) -> dict[str, float | int | None]:
    """How well ``estimate`` ``[head]`` ranks heads like ``exact`` ``[head]`` does.

    ``spearman``: rank correlation of the signed effects; ``spearman_abs``: of their magnitudes;
    ``recall_at_k``: the fraction of the ``k`` heads with the largest |exact| effect that are among
    the ``k`` largest |estimate| (ties broken by head order). ``None`` where undefined (a constant vector).
    """
    estimate, exact = estimate.detach().double().flatten().cpu(), exact.detach().double().flatten().cpu()
    if estimate.shape != exact.shape or estimate.numel() == 0:
        raise ValueError(f"estimate and exact need the same non-empty shape, got {estimate.shape} and {exact.shape}")
    k = max(1, min(k, estimate.numel()))
    top_exact = set(torch.argsort(-exact.abs(), stable=True)[:k].tolist())
    top_estimate = set(torch.argsort(-estimate.abs(), stable=True)[:k].tolist())
    return {
        "spearman": _pearson(_ranks(estimate), _ranks(exact)),
        "spearman_abs": _pearson(_ranks(estimate.abs()), _ranks(exact.abs())),
        "recall_at_k": len(top_exact & top_estimate) / k,
        "k": k,
    }
