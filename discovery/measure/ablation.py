"""The ablation engine: every head's causal effect, batched and prefix-reusing.

One engine serves every caller (the sweep, pair tests, group ablations, placement, benchmarks).
An :class:`Ablation` names heads edited together, how (``zero``, ``mean``, ``knockout``) and where
(position classes), and optionally heads *held* at their clean outputs meanwhile (``hold``: the
mediation test, how much of an edit's effect flows through the held heads).
:meth:`AblationEngine.run` evaluates many ablations at once:

- rows = ablation × prompt in one forward (chunked to a memory budget);
- the clean run's hidden state before layer l is reused, so an ablation whose first edited layer is
  l only recomputes layers l..L (layers before l are stubbed by the :class:`Intervener`);
- ablations that agree on their edits up to a layer share those layers (:mod:`discovery.measure.shared`:
  random controls, spare-one groups and holds part late);
- on attention-only models a query-position ablation recomputes the last token only, on the clean
  prefix's keys and values; the mediation test's held heads likewise, on the ablated prefix's;
- :meth:`AblationEngine.run_naive` is the reference: one full forward per ablation, as the papers'
  notebooks do; tests and ``gascan bench`` check the two agree.

Scores are read at the query position (the last real token; batches are left-padded) over the
candidates' first tokens: accuracy, logit difference (gold minus mean of the others), gold log-prob.
With ``readout_layer=k`` every pass runs the model truncated after layer k (later layers pass their
input through; the final norm and unembedding read layer k's output): the paper's minimal model.
"""
from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch

from discovery.measure.edits import (
    METHODS,
    SCOPES,
    Ablation,
    _after,
    _capture_components,
    _knockout_probs,
    _knockout_ssm,
    class_index,
    class_means,
    keep_only,
    replace_heads,
    scope_positions,
    single_head_ablations,
    unit_columns,
)
from discovery.measure.flops import MatmulFlops, layer_flops
from discovery.measure.mediation import MediationTests, mediated_share
from discovery.measure.scores import (
    METRICS,
    CandidateReadout,
    Progress,
    Scores,
    query_scores,
    stage_ticker,
)
from discovery.measure.shared import plan_passes
from discovery.model.intervene import Intervener, PassConfig
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch

# the module's API; Ablation and its constructors live in discovery.measure.edits, scores and progress in
# discovery.measure.scores, re-exported here
__all__ = ["METHODS", "METRICS", "SCOPES", "Ablation", "AblationEngine", "Progress", "Scores", "class_index",
           "class_means", "keep_only", "mediated_share", "query_scores", "scope_positions", "single_head_ablations",
           "stage_ticker"]

class AblationEngine(MediationTests):
    """Ablation effects of heads on one annotated batch of prompts (see module docstring)."""

    def __init__(self, lm: LoadedModel, batch: AnnotatedBatch, *, max_rows: int | None = None,
                 max_memory_mb: float | None = None, readout_layer: int | None = None) -> None:
        from discovery.model.loading import as_loaded

        lm = as_loaded(lm)  # a LoadedModel, an nnsight LanguageModel or a transformers model
        if batch.padding_side != "left":
            raise ValueError("the ablation engine needs a left-padded batch (annotate(..., padding_side='left'))")
        n_layers = lm.inventory.n_layers
        if readout_layer is not None and not 0 <= readout_layer < n_layers:
            raise ValueError(f"readout_layer {readout_layer} is outside the model's layers 0..{n_layers - 1}")
        self.lm = lm
        self.model = lm.model
        self.inventory = lm.inventory
        self.readout_layer = readout_layer  # None: the whole model; k: truncated after layer k
        self.n_active_layers = n_layers if readout_layer is None else readout_layer + 1
        self.device = next(self.model.parameters()).device
        self.batch = batch.to(self.device)
        self.n_prompts = len(batch)
        self.intervener = Intervener(lm.adapter)
        self.classes = self.batch.position_classes()  # name -> [prompt, pos] bool
        self._accepts_position_ids = "position_ids" in inspect.signature(self.model.forward).parameters
        self.max_rows = max_rows or self._rows_for_budget(max_memory_mb)
        self._means: dict[tuple[int, str], torch.Tensor] = {}
        self._clean_proj: dict[tuple[int, str], torch.Tensor] = {}  # held heads' clean values
        self._cache = None  # clean keys/values of the prefix, for the query fast path
        self.n_positions = int(self.batch.input_ids.shape[1])
        self.intervener.learn_layer_output_format(self.batch.input_ids)
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> clean output [prompt, pos, d_model]
        self.query_inputs: dict[tuple[int, str], torch.Tensor] = {}  # (layer, kind) -> clean [prompt, in_features]
        # cost so far in layer units (one layer-unit = a clean forward's FLOPs / n_layers, on one prompt): each
        # layer weighs its measured share of the clean forward, the readout (final norm, unembedding) its own
        self.layer_rows = 0.0
        self._layer_units: list[float] = [1.0] * n_layers  # [layer], measured by the clean pass
        self._readout_units = 0.0
        self._unit_flops = 0.0  # FLOPs of one layer unit: a clean forward over the batch / n_layers (0: unmeasured)
        self._candidate_units = 0.0  # the candidates-only readout, in layer units (as _readout_units)
        self.readout: CandidateReadout | None = None  # set by the clean pass
        self.clean = self._clean_pass()

    # -- inputs -----------------------------------------------------------------------------------
    def _rows_for_budget(self, max_memory_mb: float | None) -> int:
        if not max_memory_mb:
            return 512
        cfg = self.model.config
        d = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0) or 512)
        t = int(self.batch.input_ids.shape[1])
        heads = max(1, max((g.count for g in self.inventory.groups), default=1))
        per_row = 4 * t * (16 * d + 2 * heads * t)  # activations of one layer + attention probs, fp32
        return max(1, int(max_memory_mb * 2**20 // per_row))

    def _inputs(self, repeat: int) -> dict[str, torch.Tensor]:
        ids = self.batch.input_ids.repeat(repeat, 1)
        mask = self.batch.attention_mask.repeat(repeat, 1)
        kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
        if self._accepts_position_ids:
            kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        if "logits_to_keep" in inspect.signature(self.model.forward).parameters:
            kwargs["logits_to_keep"] = 1
        return kwargs

    def _forward(self, repeat: int, config: PassConfig, candidates: bool = False) -> torch.Tensor:
        """Logits at the last position, ``[repeat * prompt, vocab]``; with ``candidates`` the last layer's
        output there instead, ``[repeat * prompt, d_model]``, for :attr:`readout` (no whole-vocabulary logits)."""
        config.stop_layer = self.readout_layer
        query = self._halt_at_readout(config) if candidates else None
        out = None  # a pass halted at the readout layer returns nothing
        with torch.no_grad(), self.intervener.run(config):
            out = self.model(**self._inputs(repeat))
        return self._query_output(out, query, repeat * self.n_prompts, config.start_layer)

    def _halt_at_readout(self, config: PassConfig) -> dict[str, torch.Tensor]:
        """Make ``config`` stop after the readout layer and keep that layer's output at the query (filled by the
        pass, key ``hidden``: ``[row, d_model]``)."""
        last, kept = self.n_active_layers - 1, {}
        before = config.layer_sinks.get(last)

        def sink(h: torch.Tensor) -> None:
            if before is not None:
                before(h)
            kept["hidden"] = h[:, -1].detach()

        config.layer_sinks = {**config.layer_sinks, last: sink}
        config.halt_after = last
        return kept

    @property
    def query_fast_path(self) -> bool:
        """Query-position ablations reuse the clean keys/values, later layers process one token: attention-only
        models (SSM and hybrid models take the full-sequence path, which gives the same numbers)."""
        return all(g.pattern == "attention" for g in self.inventory.groups)

    def fresh_stage(self) -> None:
        """Forget what runs kept beyond the clean pass (the fast path's prefix, mean and held values): a stage
        that reuses this engine then plans and spends as on a fresh one, so its budget decisions do not depend
        on what ran before it in the same process."""
        self._cache = None
        self._means.clear()
        self._clean_proj.clear()

    def _prefix_cache(self):
        """Keys/values of every layer up to the readout layer for all but the last position (computed once)."""
        if self._cache is None:
            self._cache = self._prefix_pass(PassConfig())
        return self._cache

    def _prefix_pass(self, config: PassConfig):
        """One pass over every prompt's positions but the last with ``config``'s edits (planned for those
        positions), every layer up to the readout layer: the keys/values a last-token pass reads."""
        inputs = {k: (v[:, :-1] if isinstance(v, torch.Tensor) else v) for k, v in self._inputs(1).items()}
        inputs["use_cache"] = True
        config.stop_layer = self.readout_layer
        with torch.no_grad(), self.intervener.run(config):
            out = self.model(**inputs)
        self.layer_rows += self.n_prompts * self._prefix_units()
        # transformers 5.x names the returned cache ``cache`` (``past_key_values`` is its deprecated alias)
        return out["cache"] if "cache" in out else out.past_key_values

    def _forward_last(self, repeat: int, config: PassConfig, prefix: object = None, candidates: bool = False
                      ) -> torch.Tensor:
        """Logits at the last position with only the last token recomputed, ``[repeat * prompt, vocab]``, on the
        keys/values of ``prefix`` (default the clean prefix); with ``candidates`` as :meth:`_forward`."""
        import copy

        cache = copy.deepcopy(self._prefix_cache() if prefix is None else prefix)
        cache.reorder_cache(torch.arange(repeat * self.n_prompts, device=self.device) % self.n_prompts)
        inputs = self._inputs(repeat)
        inputs["input_ids"] = inputs["input_ids"][:, -1:]
        if "position_ids" in inputs:
            inputs["position_ids"] = inputs["position_ids"][:, -1:]
        cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        inputs.update({cache_arg: cache, "use_cache": True})
        config.stop_layer = self.readout_layer
        query = self._halt_at_readout(config) if candidates else None
        out = None  # a pass halted at the readout layer returns nothing
        with torch.no_grad(), self.intervener.run(config):
            out = self.model(**inputs)
        return self._query_output(out, query, repeat * self.n_prompts, config.start_layer, last_only=True)

    def _query_output(self, out, query: dict | None, rows: int, start: int, last_only: bool = False) -> torch.Tensor:
        """A scored pass's result, counted in :attr:`layer_rows`: the last position's logits, or with ``query``
        (:meth:`_halt_at_readout`; ``out`` None, the pass halted) the readout layer's output there."""
        self.layer_rows += rows * (self._pass_units(start, last_only=last_only, readout=query is None)
                                   + (self._candidate_units if query is not None else 0.0))
        return query["hidden"] if query is not None else out.logits[:, -1, :].float()

    def _clean_pass(self) -> Scores:
        """The clean scores, every layer's output (:attr:`hidden`) and every head group's out-projection input
        at the query (:attr:`query_inputs`, for direct logit attribution without another pass)."""
        sinks = {i: (lambda h, i=i: self.hidden.__setitem__(i, h.detach())) for i in range(self.inventory.n_layers)}
        rows = torch.arange(self.n_prompts, device=self.device)

        def grab(key: tuple[int, str]) -> Callable[[torch.Tensor], torch.Tensor]:
            def edit(x: torch.Tensor) -> torch.Tensor:  # x [prompt, pos, in_features]
                self.query_inputs[key] = x[rows, self.batch.query_pos].detach()  # [prompt, in_features]
                return x
            return edit

        edits = {(g.layer, g.kind): grab((g.layer, g.kind)) for g in self.inventory.groups
                 if g.layer < self.n_active_layers}
        with layer_flops(self.lm.adapter.layers()) as measured:
            logits = self._forward(1, PassConfig(layer_sinks=sinks, proj_edits=edits))
        self._weigh_layers(*measured)
        self.layer_rows = self.n_prompts * self._pass_units(0)
        self.readout = self._candidate_readout(logits)
        return query_scores(logits[None], self.batch)

    def _candidate_readout(self, clean_logits: torch.Tensor) -> CandidateReadout | None:
        """The candidates-only readout, when it gives this model's logits (checked on the clean pass: a model
        whose readout does more than final norm, unembedding and soft-capping keeps the full readout; None)."""
        readout = CandidateReadout(self.lm.adapter, self.batch)
        query = self.hidden[self.n_active_layers - 1][:, -1][None]  # [1, prompt, d_model]
        try:
            with MatmulFlops() as counter:
                short = readout.cand_logits(query)[0]  # [prompt, cand]
        except (AttributeError, TypeError, RuntimeError):  # an unembedding without a weight matrix
            return None
        full = clean_logits.gather(1, self.batch.cand_first_token)  # [prompt, cand]
        if not torch.allclose(short, full, atol=1e-4, rtol=1e-4):
            return None
        self._candidate_units = counter.total / self._unit_flops if self._unit_flops else 0.0
        return readout

    def _weigh_layers(self, per_layer: list[int], total: list[int]) -> None:
        """Each layer's and the readout's share of a clean forward, in layer units (they sum to ``n_layers``
        for the whole model). A truncated engine's clean pass runs layers ``0..readout_layer``: the whole model's
        forward is estimated as its readout plus its mean layer times ``n_layers``."""
        n_layers = self.inventory.n_layers
        active = per_layer[: self.n_active_layers]
        readout = total[0] - sum(active)
        whole = total[0] if self.readout_layer is None else readout + sum(active) / len(active) * n_layers
        if whole <= 0 or any(f <= 0 for f in active):  # nothing counted (an unusual layer): plain layer counts
            return
        unit = whole / n_layers
        self._unit_flops = unit
        self._layer_units = [f / unit for f in active]
        self._readout_units = readout / unit

    def _pass_units(self, first: int, last: int | None = None, *, last_only: bool = False,
                    readout: bool = True) -> float:
        """Layer units of one prompt's pass that recomputes layers ``first..last`` (default: to the readout
        layer; one token of T on the query fast path) and, with ``readout``, reads the logits out."""
        last = self.n_active_layers - 1 if last is None else last
        layers = sum(self._layer_units[first:last + 1])
        return (layers / self.n_positions if last_only else layers) + (self._readout_units if readout else 0.0)

    def _prefix_units(self) -> float:
        """Layer units per prompt of the query fast path's prefix pass (every layer, all but the last token)."""
        return self._pass_units(0) * (self.n_positions - 1) / self.n_positions

    # -- passes that read heads -----------------------------------------------------------------
    @staticmethod
    def watch_span(config: PassConfig, layers: Iterable[int]) -> tuple[int, int]:
        """The layers a :meth:`watch` pass recomputes: from the first one ``config`` edits or reads (or of
        ``layers``) to the last of ``layers``."""
        layers = list(layers)
        touched = [*layers, *(layer for layer, _ in config.proj_edits), *config.prob_edits, *config.prob_sinks,
                   *config.qk_sinks, *config.mixer_sinks, *config.layer_sinks]
        return min(touched), max(layers)

    def predicted_watch_fe(self, first: int, last: int) -> float:
        """What a :meth:`watch` pass over every prompt recomputing layers ``first..last`` costs, in
        forward-equivalents (the count :meth:`predicted_forward_equivalents` uses)."""
        return self._pass_units(first, last, readout=False) / self.inventory.n_layers

    def watch(self, config: PassConfig, layers: Iterable[int], rows: slice | None = None) -> None:
        """One forward over the prompts ``rows`` (default all) for a pass that only reads heads (patterns, read
        tests): ``config``'s edits and sinks apply, the layers before the first one it edits or reads return the
        clean pass's hidden states (prefix reuse), and the pass stops after the last of ``layers`` (no later
        layer, no unembedding). Costs :meth:`predicted_watch_fe` of :meth:`watch_span`."""
        first, last = self.watch_span(config, layers)
        if last >= self.n_active_layers:
            raise ValueError(f"layer {last} is after readout layer {self.readout_layer}")
        rows = rows if rows is not None else slice(0, self.n_prompts)
        if first > 0:
            config.start_layer = first
            config.start_hidden = self.hidden[first - 1][rows]
        self._halted_pass(config, last, rows)

    def _halted_pass(self, config: PassConfig, last: int, rows: slice | None = None) -> None:
        """One forward over the prompts ``rows`` (default all) from ``config``'s start layer, halted after
        ``last`` (no later layer, no unembedding), counted in :attr:`layer_rows`: watch passes and stems."""
        rows = rows if rows is not None else slice(0, self.n_prompts)
        inputs = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in self._inputs(1).items()}
        config.halt_after = last
        with torch.no_grad(), self.intervener.run(config):
            self.model(**inputs)
        self.layer_rows += int(inputs["input_ids"].shape[0]) * self._pass_units(config.start_layer, last,
                                                                                readout=False)

    # -- edits ----------------------------------------------------------------------------------
    def _proj_inputs(self, keys: Iterable[tuple[int, str]]) -> dict[tuple[int, str], torch.Tensor]:
        """The clean out-projection inputs of several head groups, each ``[prompt, pos, in_features]``, in one
        forward (a mean ablation over every layer needs one pass, not one per layer)."""
        captured: dict[tuple[int, str], torch.Tensor] = {}

        def grab(key: tuple[int, str]) -> Callable[[torch.Tensor], torch.Tensor]:
            def edit(x: torch.Tensor) -> torch.Tensor:
                captured[key] = x.detach()
                return x
            return edit

        edits = {key: grab(key) for key in keys}
        if edits:
            self.watch(PassConfig(proj_edits=edits), [layer for layer, _ in edits])
        return captured

    def prefetch_cost(self, ablations: Iterable[Ablation]) -> float:
        """What :meth:`prefetch` costs for ``ablations`` in forward-equivalents: one watch pass over the layers
        of the inputs still to keep (0 when all are kept)."""
        means, holds = self._missing_inputs(ablations)
        if not means and not holds:
            return 0.0
        layers = [layer for layer, _ in means | holds]
        return self._pass_units(min(layers), max(layers), readout=False) / self.inventory.n_layers

    def _missing_inputs(self, ablations: Iterable[Ablation]) -> tuple[set[tuple[int, str]], set[tuple[int, str]]]:
        """The groups whose clean inputs the ablations' mean edits / holds need and the engine has not kept yet."""
        ablations = list(ablations)
        means = {(h.layer, h.kind) for a in ablations if a.method == "mean" for h in a.heads} - set(self._means)
        holds = {(h.layer, h.kind) for a in ablations for h in a.hold} - set(self._clean_proj)
        return means, holds

    def prefetch(self, ablations: Sequence[Ablation]) -> None:
        """Capture, in one clean pass, every group input the ablations' mean edits and holds need and the engine
        has not kept yet (:meth:`run` and :meth:`mediation` do it themselves; a caller planning several
        mediation tests calls it once first, at :meth:`prefetch_cost`)."""
        means, holds = self._missing_inputs(ablations)
        if not means and not holds:
            return
        captured = self._proj_inputs(means | holds)
        for key in means:
            self._means[key] = class_means(captured[key], self.classes)  # [class, in]
        for key in holds:
            self._clean_proj[key] = captured[key]

    def _mean_values(self, layer: int, kind: str) -> torch.Tensor:
        """Mean of the out-projection input per position class over the batch: ``[class, in_features]``."""
        key = (layer, kind)
        if key not in self._means:
            self._means[key] = class_means(self._proj_inputs([key])[key], self.classes)  # [class, in]
        return self._means[key]

    def _clean_values(self, layer: int, kind: str) -> torch.Tensor:
        """The clean out-projection input, kept for held heads: ``[prompt, pos, in_features]``."""
        key = (layer, kind)
        if key not in self._clean_proj:
            self._clean_proj[key] = self._proj_inputs([key])[key]
        return self._clean_proj[key]

    def plan(self, ablations: Sequence[Ablation], rows: slice | None = None) -> PassConfig:
        """The Intervener edits that apply ``ablations`` to the prompts ``rows`` of this batch (default all),
        rows ablation-major. Callers that run their own passes (patterns under an ablation, pair tests)
        use this instead of writing edits of their own."""
        return self._plan(list(ablations), rows)

    def _plan(self, ablations: list[Ablation], rows: slice | None = None, positions: slice | None = None
              ) -> PassConfig:
        """Edit functions for a chunk of ablations (rows ablation-major), for the positions ``positions``
        (default all; a prefix for a pass that stops before the query)."""
        classes = self.classes if rows is None else {k: v[rows] for k, v in self.classes.items()}
        if positions is not None:
            classes = {k: v[:, positions] for k, v in classes.items()}
        n, p = len(ablations), int(classes["all"].shape[0])
        late = [a.name for a in ablations if max(h.layer for h in (*a.heads, *a.hold)) >= self.n_active_layers]
        if late:
            raise ValueError(f"ablation {late[0]} edits or holds a layer after readout layer {self.readout_layer}")
        config = PassConfig(stop_layer=self.readout_layer)
        touched = sorted({(h.layer, h.kind) for a in ablations for h in a.heads})
        for layer, kind in touched:
            group = self.inventory.group(layer, kind)
            # [row, pos, head] bool: which head outputs to edit where
            proj_mask = torch.zeros(n, p, classes["all"].shape[1], group.n_units, dtype=torch.bool,
                                    device=self.device)
            knock: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (ablation, head, q mask, k mask)
            for a, abl in enumerate(ablations):
                heads = [h.index for h in abl.heads if h.layer == layer and h.kind == kind]
                if not heads:
                    continue
                if abl.method == "knockout":
                    for h in heads:
                        knock.append((a, h, scope_positions(classes, abl.scope), scope_positions(classes, abl.keys)))
                else:
                    pos = scope_positions(classes, abl.scope)  # [prompt, pos]
                    proj_mask[a][:, :, heads] = pos[:, :, None]
            methods = {abl.method for abl in ablations}
            if proj_mask.any():
                edit_mask = proj_mask.reshape(n * p, -1, group.n_units)
                units = unit_columns(group, self.device)
                if "mean" in methods:
                    per_row_mean = torch.tensor([abl.method == "mean" for abl in ablations], device=self.device)
                    means = self._mean_values(layer, kind)[class_index(classes)]  # [prompt, pos, in]
                    config.proj_edits[(layer, kind)] = replace_heads(edit_mask, group.width, means,
                                                                      per_row_mean.repeat_interleave(p), units)
                else:
                    config.proj_edits[(layer, kind)] = replace_heads(edit_mask, group.width, None, None, units)
            if knock and kind == "attn":
                config.prob_edits[layer] = _knockout_probs(knock, n, p, group.count, classes["all"].shape[1],
                                                           self.device)
            elif knock:
                holder: dict[str, object] = {}
                mixer = self.lm.adapter.mixer(layer, kind)
                config.mixer_sinks[layer] = _capture_components(mixer, holder)
                previous = config.proj_edits.get((layer, kind))
                config.proj_edits[(layer, kind)] = _knockout_ssm(mixer, holder, knock, p, group, previous)
        for layer, kind in sorted({(h.layer, h.kind) for a in ablations for h in a.hold}):
            group = self.inventory.group(layer, kind)
            hold_mask = torch.zeros(n, p, classes["all"].shape[1], group.n_units, dtype=torch.bool,
                                    device=self.device)  # [ablation, prompt, pos, head]
            for a, abl in enumerate(ablations):
                heads = [h.index for h in abl.hold if h.layer == layer and h.kind == kind]
                if heads:
                    hold_mask[a][:, :, heads] = scope_positions(classes, abl.hold_scope)[:, :, None]
            clean = self._clean_values(layer, kind)
            clean = clean if rows is None else clean[rows]  # [prompt, pos, in]
            # held heads take their clean values: replace_heads with every row replacing
            hold = replace_heads(hold_mask.reshape(n * p, -1, group.n_units), group.width, clean,
                                 torch.ones(n * p, dtype=torch.bool, device=self.device),
                                 unit_columns(group, self.device))
            config.proj_edits[(layer, kind)] = _after(config.proj_edits.get((layer, kind)), hold)
        return config

    # -- running --------------------------------------------------------------------------------
    def _last_only(self, ablation: Ablation) -> bool:
        """Whether ``ablation`` runs on the query fast path (only the last token recomputed)."""
        return self.query_fast_path and ablation.scope == ("query",)

    def predicted_forward_equivalents(self, ablations: Sequence[Ablation], *, logprob: bool = True) -> float:
        """What :meth:`run` will cost for ``ablations``, in forward-equivalents of the whole model over the
        batch, by the same count as :attr:`layer_rows` (layers recomputed × prompts, each layer and the readout
        weighed by its measured FLOPs; layers several ablations share computed once; one token of T on the query
        fast path; the passes that keep mean or held values and the fast path's prefix when they are still to
        run): exact, so the evidence stage can plan within a budget before it runs anything. ``logprob`` as
        :meth:`run`."""
        distinct = list({replace(a, label=""): a for a in ablations}.values())
        read = self._candidate_units if self._candidates(logprob) else self._readout_units  # per scored pass
        rows = sum(self._pass_units(a.first_layer, last_only=True, readout=False) + read
                   for a in distinct if self._last_only(a))
        rows += sum(self._pass_units(p.start, p.last, readout=False) + (read if p.last is None else 0.0) for p in
                    plan_passes([a for a in distinct if not self._last_only(a)], self.n_active_layers))
        rows += self.prefetch_cost(distinct) * self.inventory.n_layers
        if self._cache is None and any(self._last_only(a) for a in distinct):
            rows += self._prefix_units()  # the fast path's prefix keys and values, once
        return rows / self.inventory.n_layers

    @property
    def forward_equivalents(self) -> float:
        """:attr:`layer_rows` so far, in forward-equivalents of the whole model over the batch."""
        return self.layer_rows / (self.n_prompts * self.inventory.n_layers)

    def _candidates(self, logprob: bool) -> bool:
        """Whether a run scores from the candidates' unembedding rows alone (:attr:`readout`)."""
        return not logprob and self.readout is not None

    def run(self, ablations: Sequence[Ablation], progress: Callable[[int], None] | None = None, *,
            logprob: bool = True) -> Scores:
        """Scores for every ablation, ``[ablation, prompt]``, batched and prefix-reusing. Ablations that differ
        only in their label are computed once (control draws of neighbouring pairs overlap). ``logprob=False``:
        the caller reads accuracy and logit difference only, so the readout is the candidates' rows
        (``gold_logprob`` NaN) where :attr:`readout` reproduces the model's logits."""
        ablations = list(ablations)
        if not ablations:
            return Scores(*(torch.empty(0, self.n_prompts) for _ in METRICS))
        index: dict[Ablation, int] = {}
        slot = [index.setdefault(replace(a, label=""), len(index)) for a in ablations]
        if len(index) < len(ablations):
            distinct = list(index)
            scores = self._run(distinct, progress, self._candidates(logprob))
            if progress is not None:
                progress(len(ablations) - len(distinct))  # the duplicates are done too
            pick = torch.tensor(slot)
            return Scores(*(scores[m][pick] for m in METRICS))
        return self._run(ablations, progress, self._candidates(logprob))

    def _scores(self, out: torch.Tensor, n: int, candidates: bool) -> Scores:
        """Scores ``[ablation, prompt]`` of a pass's output: logits, or query states for :attr:`readout`."""
        out = out.view(n, self.n_prompts, -1)
        return self.readout.scores(out) if candidates and self.readout is not None else query_scores(out, self.batch)

    def _run(self, ablations: list[Ablation], progress: Callable[[int], None] | None, candidates: bool) -> Scores:
        """:meth:`run` for distinct ablations: the query fast path's, then the others on their shared prefixes."""
        self.prefetch(ablations)
        results: dict[int, Scores] = {}
        fast = [i for i, a in enumerate(ablations) if self._last_only(a)]
        self._run_last_only(ablations, fast, results, progress, candidates)
        full = [i for i, a in enumerate(ablations) if not self._last_only(a)]
        self._run_shared([ablations[i] for i in full], full, results, progress, candidates)
        return Scores.cat([results[i] for i in range(len(ablations))])

    def _run_last_only(self, ablations: list[Ablation], chosen: list[int], results: dict[int, Scores],
                       progress: Callable[[int], None] | None, candidates: bool) -> None:
        """Query fast path: chunks of ablations with one first layer, the last token from that layer on."""
        order = sorted(chosen, key=lambda i: ablations[i].first_layer)
        per_chunk = max(1, self.max_rows // self.n_prompts)
        start = 0
        while start < len(order):
            layer = ablations[order[start]].first_layer
            chunk = [order[start]]
            while (start + len(chunk) < len(order) and len(chunk) < per_chunk
                   and ablations[order[start + len(chunk)]].first_layer == layer):
                chunk.append(order[start + len(chunk)])
            config = self._plan([ablations[i] for i in chunk])
            if layer > 0:
                config.start_layer = layer
                config.start_hidden = self.hidden[layer - 1][:, -1:].repeat(len(chunk), 1, 1)
            scores = self._scores(self._forward_last(len(chunk), config, candidates=candidates), len(chunk),
                                  candidates)
            for j, i in enumerate(chunk):
                results[i] = Scores(*(scores[m][j : j + 1] for m in METRICS))
            if progress is not None:
                progress(len(chunk))
            start += len(chunk)

    def _run_shared(self, ablations: list[Ablation], index: list[int], results: dict[int, Scores],
                    progress: Callable[[int], None] | None, candidates: bool) -> None:
        """Whole-sequence ablations on the prefix tree of :func:`~discovery.measure.shared.plan_passes`: shared
        layers run once (a stem keeps its output until its last branch ran), sibling scored passes that start
        at one layer from one state run in one chunk. ``results[index[i]]`` gets ablation ``i``'s scores."""
        passes = plan_passes(ablations, self.n_active_layers)
        branches_left = Counter(p.parent for p in passes if p.parent is not None)
        kept: dict[int, torch.Tensor] = {}  # stem -> its output [prompt, pos, d_model]
        per_chunk = max(1, self.max_rows // self.n_prompts)
        j = 0
        while j < len(passes):
            first = passes[j]
            chunk = [first]
            while (first.last is None and j + len(chunk) < len(passes) and len(chunk) < per_chunk
                   and passes[j + len(chunk)].last is None and passes[j + len(chunk)].parent == first.parent
                   and passes[j + len(chunk)].start == first.start):
                chunk.append(passes[j + len(chunk)])
            config = self._plan([ablations[p.ablation] for p in chunk])
            if first.start > 0:
                hidden = self.hidden[first.start - 1] if first.parent is None else kept[first.parent]
                config.start_layer, config.start_hidden = first.start, hidden.repeat(len(chunk), 1, 1)
            if first.last is not None:
                kept[j] = self._stem(config, first.last)
            else:
                scores = self._scores(self._forward(len(chunk), config, candidates), len(chunk), candidates)
                for k, p in enumerate(chunk):
                    for i in p.members:
                        results[index[i]] = Scores(*(scores[m][k : k + 1] for m in METRICS))
                if progress is not None:
                    progress(sum(len(p.members) for p in chunk))
            if first.parent is not None:
                branches_left[first.parent] -= len(chunk)
                if not branches_left[first.parent]:
                    del kept[first.parent]
            j += len(chunk)

    def _stem(self, config: PassConfig, last: int) -> torch.Tensor:
        """A shared prefix's pass: ``config``'s edits from its start layer, halted after ``last``; returns
        that layer's output ``[prompt, pos, d_model]``."""
        out: dict[str, torch.Tensor] = {}
        config.layer_sinks = {last: lambda h: out.__setitem__("hidden", h.detach())}
        self._halted_pass(config, last)
        return out["hidden"]

    def run_naive(self, ablations: Sequence[Ablation]) -> Scores:
        """Reference: one full forward over all prompts per ablation, no prefix reuse."""
        parts = []
        for abl in ablations:
            logits = self._forward(1, self._plan([abl]))
            parts.append(query_scores(logits[None], self.batch))
        return Scores.cat(parts)

    def effects(self, ablations: Sequence[Ablation], scores: Scores | None = None) -> Scores:
        """Per-prompt change from the clean run, ``[ablation, prompt]``."""
        scores = scores if scores is not None else self.run(ablations)
        return Scores(*(scores[m] - self.clean[m] for m in METRICS))
