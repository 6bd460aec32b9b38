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
move a pattern far more (or far less) than the gradient says. The paper fixes this for query and key
nodes by computing the change of the attention *scores* exactly and pushing it through the softmax
exactly, weighting the change of probabilities with the gradient with respect to them. Our nodes are
head outputs, so for every attention head ``h`` (layer ``l``) and every later attention layer ``m``
the fix does, per prompt:

1. ``delta_h``: the exact change of layer ``l``'s output when ``h`` is ablated (one pass of layer
   ``l`` alone, with the clean hidden state before it; rows = heads x prompts);
2. ``A'``: layer ``m``'s attention probabilities recomputed by the model's own attention code from
   the clean input of layer ``m`` plus ``delta_h`` (one partial pass of layer ``m``, stopped as soon
   as its probabilities exist) — the *direct-path* change of every query and key, with scores and
   softmax exact (RoPE, QK norms, soft-capping, sliding windows included);
3. the correction ``<dM/dA_m, A' - A_m> - <G_m, delta_h>`` is added to the AtP estimate, where
   ``G_m = d<dM/dA_m, A_m>/d(input of layer m)`` (one short extra backward through layer ``m``'s
   query/key path) is what AtP already counted for that path to first order. For a small
   ``delta_h`` the correction vanishes; when a pattern saturates it replaces the linear guess.

What it does not fix: pattern changes mediated by intermediate layers (a head in layer ``l`` moving
layer ``l+1``'s output, which moves layer ``m``'s pattern) stay linear, as do MLP and norm
nonlinearities, and SSM heads (as sources or readers) get plain AtP. Its cost grows with
(attention heads) x (later attention layers): each source head costs about one layer per later
attention layer, which is far below the exact sweep only when few layers have attention. On
all-attention models it costs about as much as the exact sweep (11 vs 8 forward-equivalents on the
3-layer tiny llama, 13.5 vs 10 on a 4x4 toy, ~140 vs 140 on SmolLM2-135M): there, pass
``qk_fix=False`` for a cheap screen (3 forward-equivalents; 4 with mean ablation). The measured cost
of every run is in :attr:`AttributionResult.forward_equivalents`.

:func:`rank_agreement` compares an estimate with exact effects (Spearman, recall@k by |effect|).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .ablation import SCOPES, class_index, class_means, replace_heads, scope_positions
from .errors import GascanError
from .heads import HeadId
from .intervene import Intervener, PassConfig
from .loading import LoadedModel
from .patterns import model_inputs
from .tasks.base import AnnotatedBatch
from .tasks.scoring import next_token_scores, query_logits

ATP_METHODS = ("zero", "mean")
ATP_METRICS = ("logit_diff", "gold_logprob")  # differentiable; accuracy is not


@dataclass
class AttributionResult:
    """AtP estimates for ``heads``: ``estimate`` ``[head, prompt]`` (change of ``metric`` under the ablation).

    ``qk_correction`` ``[head, prompt]`` is the part of ``estimate`` that the QK fix added (``None``
    when it did not run; zero for heads it does not apply to). ``passes`` counts full-batch forwards
    and backwards (each backward counted once); ``forward_equivalents`` is the measured cost in
    units of one clean forward over the batch: a backward counts as two forwards and the QK fix's
    partial passes count the layers they ran, row by row.
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


class _Stop(Exception):
    """Raised by a sink to end a partial forward once the wanted tensor exists."""


def _keep_and_stop(store: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    def sink(tensor: torch.Tensor) -> None:
        store.append(tensor.detach())
        raise _Stop

    return sink


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
        self.n_layers = self.inventory.n_layers
        self.layer_rows = 0.0  # layers x prompt-rows computed (a backward counts twice)
        self.passes = 0
        attn_layers = sorted({g.layer for g in self.inventory.groups if g.kind == "attn"})
        # QK fix: sources are wanted attention heads with a later attention layer; targets those layers
        self.sources: dict[int, list[int]] = {}
        if qk_fix:
            for h in heads:
                if h.kind == "attn" and any(m > h.layer for m in attn_layers):
                    self.sources.setdefault(h.layer, []).append(h.index)
        first = min(self.sources, default=None)
        self.targets = [m for m in attn_layers if first is not None and m > first]
        self.means: dict[tuple[int, str], torch.Tensor] = {}  # [class, in]
        if self.sources:  # the QK fix's partial passes stub the layers before their start
            self.intervener.learn_layer_output_format(self.batch.input_ids)

    # -- inputs -----------------------------------------------------------------------------------
    def _inputs(self, part: AnnotatedBatch, repeat: int = 1) -> dict[str, torch.Tensor]:
        kwargs = model_inputs(self.model, part)
        kwargs = {k: (v.repeat(repeat, 1) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
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
        self.layer_rows += len(self.batch) * self.n_layers

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

        def capture_x(key):
            def edit(x: torch.Tensor) -> torch.Tensor:
                if not x.requires_grad:  # frozen weights: make the captured input the graph's leaf
                    x = x.detach().requires_grad_(True)
                xs[key] = x
                return x

            return edit

        def capture_probs(layer):
            def edit(p: torch.Tensor) -> torch.Tensor:
                probs[layer] = p
                return p

            return edit

        config = PassConfig(proj_edits={k: capture_x(k) for k in self.groups})
        if self.sources:
            config.prob_edits = {m: capture_probs(m) for m in self.targets}
            wanted = {m - 1 for m in self.targets} | set(self.sources) | {l - 1 for l in self.sources if l > 0}
            config.layer_sinks = {i: (lambda h, i=i: hidden.__setitem__(i, h)) for i in wanted}
        with torch.enable_grad(), self.intervener.run(config):
            out = self.model(**self._inputs(part))
            total = self._metric(out.logits, part).sum()
        keys = list(xs)
        targets = [m for m in self.targets if m in probs and probs[m].requires_grad]
        inputs = [xs[k] for k in keys] + [probs[m] for m in targets]
        grads = torch.autograd.grad(total, inputs, retain_graph=bool(targets), allow_unused=True)
        n = rows.stop - rows.start
        self.layer_rows += 3 * n * self.n_layers  # forward + backward (twice a forward)
        for key, g in zip(keys, grads[: len(keys)], strict=True):
            x = xs[key].detach()
            g = torch.zeros_like(x) if g is None else g
            diff = (self._replacement(key, x, classes) - x) * where[..., None]  # [prompt, pos, in]
            group = self.inventory.group(*key)
            per_head = (diff.float() * g.float()).view(n, x.shape[1], group.count, group.width).sum((1, 3))
            for index in range(group.count):
                head = HeadId(key[0], index, key[1])
                if head in self.row_of:
                    estimate[self.row_of[head], rows] = per_head[:, index]
        if not self.sources:
            return
        grad_probs = dict(zip(targets, grads[len(keys):], strict=True))
        linear: dict[int, torch.Tensor] = {}  # G_m [prompt, pos, d_model]
        for i, m in enumerate(targets):
            g_a = grad_probs[m]
            if g_a is None or not hidden[m - 1].requires_grad:
                continue
            (g_h,) = torch.autograd.grad(probs[m], hidden[m - 1], grad_outputs=g_a,
                                         retain_graph=i < len(targets) - 1, allow_unused=True)
            linear[m] = torch.zeros_like(hidden[m - 1]) if g_h is None else g_h.detach()
            self.layer_rows += 2 * n  # a backward through one layer's query/key path
        clean_probs = {m: probs[m].detach() for m in grad_probs}
        grad_probs = {m: g for m, g in grad_probs.items() if g is not None}
        hidden = {i: h.detach() for i, h in hidden.items()}
        xs.clear()  # free the graph's tensors before the partial passes
        probs.clear()
        grads = ()
        self._qk_fix(part, classes, where, hidden, clean_probs, grad_probs, linear, rows, estimate, correction)

    # -- the QK fix ------------------------------------------------------------------------------------
    def _partial(self, part: AnnotatedBatch, repeat: int, config: PassConfig, layer: int, what: str) -> torch.Tensor:
        """Run from ``config.start_layer`` until ``layer`` has produced ``what`` (``"output"``: its hidden
        state ``[row, pos, d_model]``; ``"probs"``: its attention probabilities ``[row, head, q, k]``), and
        return that; nothing after it is computed."""
        kept: list[torch.Tensor] = []
        sinks = config.layer_sinks if what == "output" else config.prob_sinks
        sinks[layer] = _keep_and_stop(kept)
        try:
            with torch.no_grad(), self.intervener.run(config):
                self.model(**self._inputs(part, repeat))
        except _Stop:
            pass
        self.layer_rows += repeat * len(part) * (layer - config.start_layer + 1)
        return kept[0]

    def _qk_fix(self, part, classes, where, hidden, clean_probs, grad_probs, linear, rows, estimate,
                correction) -> None:
        n = len(part)
        for layer, indices in sorted(self.sources.items()):
            group = self.inventory.group(layer, "attn")
            per_pass = max(1, self.max_rows // n)
            for start in range(0, len(indices), per_pass):
                block = indices[start:start + per_pass]
                k = len(block)
                # 1. delta: exact change of layer `layer`'s output when each head of `block` is ablated
                mask = torch.zeros(k, n, where.shape[1], group.count, dtype=torch.bool, device=self.device)
                for a, index in enumerate(block):
                    mask[a, :, :, index] = where
                means = None
                if self.method == "mean":
                    means = self.means[(layer, "attn")][class_index(classes)]  # [prompt, pos, in]
                edit = replace_heads(mask.view(k * n, -1, group.count), group.width, means,
                                     torch.ones(k * n, dtype=torch.bool, device=self.device))
                config = PassConfig(proj_edits={(layer, "attn"): edit})
                if layer > 0:
                    config.start_layer = layer
                    config.start_hidden = hidden[layer - 1].repeat(k, 1, 1)
                ablated = self._partial(part, k, config, layer, "output")  # [head * prompt, pos, d]
                delta = ablated.view(k, n, *ablated.shape[1:]) - hidden[layer][None]  # [head, prompt, pos, d]
                fix = torch.zeros(k, n, device=self.device)
                # 2-3. every later attention layer's pattern from (clean input + delta), exact softmax
                for m in self.targets:
                    if m <= layer or m not in grad_probs:
                        continue
                    start_hidden = (hidden[m - 1][None] + delta).reshape(k * n, *delta.shape[2:])
                    config = PassConfig(start_layer=m, start_hidden=start_hidden)
                    moved = self._partial(part, k, config, m, "probs")  # [head * prompt, head_m, q, k]
                    moved = moved.view(k, n, *moved.shape[1:]).float() - clean_probs[m][None].float()
                    exact = (moved * grad_probs[m][None].float()).sum((2, 3, 4))  # [head, prompt]
                    first_order = (delta.float() * linear[m][None].float()).sum((2, 3)) if m in linear else 0.0
                    fix += exact - first_order
                for a, index in enumerate(block):
                    head = HeadId(layer, index, "attn")
                    estimate[self.row_of[head], rows] += fix[a]
                    if correction is not None:
                        correction[self.row_of[head], rows] = fix[a]


def atp_effects(lm: LoadedModel, batch: AnnotatedBatch, *, heads: Sequence[HeadId] | None = None,
                method: str = "zero", scope: Sequence[str] = ("all",), metric: str = "logit_diff",
                qk_fix: bool = True, chunk_prompts: int = 8, max_rows: int = 256) -> AttributionResult:
    """AtP (with the QK fix for attention heads when ``qk_fix``) estimates of every head's ablation effect.

    ``method``: ``zero`` or ``mean`` (per-position-class mean over the batch, as the engine ablates);
    ``scope``: position classes where the head is ablated; ``metric``: ``logit_diff`` or
    ``gold_logprob`` at the query position over the candidates' first tokens, exactly as the ablation
    engine scores (whatever the task's own scoring). Prompts are processed ``chunk_prompts`` at a time; the
    QK fix's partial passes hold at most ``max_rows`` rows. See the module docstring for exactly
    what is approximated.
    """
    chosen = _check(lm, batch, heads, method, scope, metric, chunk_prompts)
    screen = _Screen(lm, batch, chosen, method, scope, metric, qk_fix, max_rows)
    n = len(batch)
    chunks = [slice(s, min(s + chunk_prompts, n)) for s in range(0, n, chunk_prompts)]
    estimate = torch.zeros(len(chosen), n, device=screen.device)  # [head, prompt]
    correction = torch.zeros_like(estimate) if qk_fix else None
    if method == "mean":
        screen.compute_means(chunks)
    for rows in chunks:
        screen.run_chunk(rows, estimate, correction)
    screen.passes += 2  # the clean forward and the backward (in chunks, over the whole batch)
    return AttributionResult(
        heads=chosen, estimate=estimate.cpu(), metric=metric, method=method, scope=tuple(scope),
        passes=screen.passes, forward_equivalents=screen.layer_rows / max(1, n * screen.n_layers),
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
