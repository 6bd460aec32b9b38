"""The ablation engine: every head's causal effect, batched and prefix-reusing.

One engine serves every caller (the sweep, pair tests, group ablations, placement, benchmarks).
An :class:`Ablation` names heads edited together, how (``zero``, ``mean``, ``knockout``) and where
(position classes), and optionally heads *held* at their clean outputs meanwhile (``hold``: the
mediation test, how much of an edit's effect flows through the held heads).
:meth:`AblationEngine.run` evaluates many ablations at once:

- rows = ablation × prompt in one forward (chunked to a memory budget);
- the clean run's hidden state before layer l is reused, so an ablation whose first edited layer is
  l only recomputes layers l..L (layers before l are stubbed by the :class:`Intervener`);
- :meth:`AblationEngine.run_naive` is the reference: one full forward per ablation, as the papers'
  notebooks do; tests and ``gascan bench`` check the two agree.

Scores are read at the query position (the last real token; batches are left-padded) over the
candidates' first tokens: accuracy, logit difference (gold minus mean of the others), gold log-prob.
With ``readout_layer=k`` every pass runs the model truncated after layer k (later layers pass their
input through; the final norm and unembedding read layer k's output): the paper's minimal model.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from discovery.heads import HeadGroup, HeadId, Inventory
from discovery.model.intervene import Intervener, PassConfig
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch

METHODS = ("zero", "mean", "knockout")
SCOPES = ("all", "query", "summary", "segment", "label")
METRICS = ("acc", "logit_diff", "gold_logprob")
# Position classes for mean ablation, most specific first: a position takes the first class it is in.
MEAN_CLASSES = ("query", "summary", "label", "segment", "all")


@dataclass(frozen=True)
class Ablation:
    """Heads edited together in one forward.

    ``scope``: position classes where the heads' outputs are edited (``all`` = every real token);
    for ``knockout`` the scope gives the *query* rows and ``keys`` the key positions those rows may
    no longer read (attention probabilities, or implicit-attention entries for SSM heads, set to 0).
    ``hold``: heads whose outputs at ``hold_scope`` keep their clean-run values whatever the edit
    changes upstream; the part of the edit's effect that disappears is the part mediated by them.
    """

    heads: tuple[HeadId, ...]
    method: str = "zero"
    scope: tuple[str, ...] = ("all",)
    keys: tuple[str, ...] = ("segment",)
    label: str = ""
    hold: tuple[HeadId, ...] = ()
    hold_scope: tuple[str, ...] = ("query",)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown ablation method {self.method!r}; use one of {METHODS}")
        bad = [s for s in (*self.scope, *self.keys, *self.hold_scope) if s not in SCOPES]
        if bad:
            raise ValueError(f"unknown position class {bad[0]!r}; use one of {SCOPES}")
        if not self.heads:
            raise ValueError("an ablation needs at least one head")
        both = set(self.heads) & set(self.hold)
        if both:
            raise ValueError(f"head {min(both)} is both ablated and held; hold only heads the ablation leaves alone")

    @property
    def first_layer(self) -> int:
        return min(h.layer for h in self.heads)

    @property
    def name(self) -> str:
        held = f" holding {'+'.join(str(h) for h in self.hold)}" if self.hold else ""
        return self.label or "+".join(str(h) for h in self.heads) + held


def single_head_ablations(heads: Iterable[HeadId], method: str = "zero", scope: Sequence[str] = ("all",),
                          keys: Sequence[str] = ("segment",)) -> list[Ablation]:
    """One ablation per head (the sweep)."""
    return [Ablation((h,), method, tuple(scope), tuple(keys)) for h in heads]


def keep_only(inventory: Inventory, layers: Iterable[int], keep: Iterable[HeadId], method: str = "zero",
              scope: Sequence[str] = ("all",), label: str = "") -> Ablation:
    """Every head of ``layers`` ablated except ``keep``."""
    keep_set = set(keep)
    layer_set = set(layers)
    heads = tuple(h for h in inventory.heads() if h.layer in layer_set and h not in keep_set)
    return Ablation(heads, method, tuple(scope), label=label or f"keep_only({','.join(map(str, sorted(keep_set)))})")


@dataclass
class Scores:
    """Per-ablation, per-prompt scores: each tensor is ``[ablation, prompt]``."""

    acc: torch.Tensor
    logit_diff: torch.Tensor
    gold_logprob: torch.Tensor

    def __getitem__(self, metric: str) -> torch.Tensor:
        return getattr(self, metric)

    @staticmethod
    def cat(parts: Sequence[Scores], dim: int = 0) -> Scores:
        return Scores(*(torch.cat([getattr(p, m) for p in parts], dim=dim) for m in METRICS))


def query_scores(query_logits: torch.Tensor, batch: AnnotatedBatch) -> Scores:
    """Scores of ``query_logits`` ``[ablation, prompt, vocab]`` against the batch's candidates."""
    from discovery.tasks.scoring import next_token_scores

    parts = [next_token_scores(query_logits[a], batch) for a in range(query_logits.shape[0])]
    return Scores(*(torch.stack([p[m].float() for p in parts]) for m in METRICS))


def class_means(x: torch.Tensor, classes: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean of ``x`` ``[prompt, pos, in]`` per position class (MEAN_CLASSES order): ``[class, in]``.

    Each real position counts in the first class it belongs to; an empty class takes the mean over
    every real position. Shared by the engine and the attribution screen.
    """
    means = []
    taken = torch.zeros_like(classes["all"])
    for name in MEAN_CLASSES:
        sel = classes[name] & ~taken & classes["all"]
        taken |= sel
        means.append(x[sel].mean(0) if sel.any() else x[classes["all"]].mean(0))
    return torch.stack(means)  # [class, in]


def class_index(classes: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[prompt, pos]`` index into MEAN_CLASSES (first class that applies)."""
    index = torch.full_like(classes["all"], len(MEAN_CLASSES) - 1, dtype=torch.long)
    for i in reversed(range(len(MEAN_CLASSES))):
        index[classes[MEAN_CLASSES[i]]] = i
    return index


def scope_positions(classes: dict[str, torch.Tensor], scope: Sequence[str]) -> torch.Tensor:
    """``[prompt, pos]`` bool: the real positions in any of the ``scope`` classes."""
    mask = torch.zeros_like(classes["all"])
    for name in scope:
        mask |= classes[name]
    return mask & classes["all"]


@dataclass
class _Plan:
    """Edits of one chunk: rows are ablation-major (row = ablation * n_prompts + prompt)."""

    ablations: list[Ablation]
    n_prompts: int
    edits: PassConfig = field(default_factory=PassConfig)


Progress = Callable[[str, int, int], None]  # (stage, done, total): what a command's progress bar takes


def stage_ticker(progress: Progress | None, stage: str, total: int) -> Callable[[int], None]:
    """A callback for :meth:`AblationEngine.run` (``progress=``) that advances ``stage`` by the rows it finished."""
    done = [0]
    if progress:
        progress(stage, 0, total)

    def tick(n: int) -> None:
        done[0] += n
        if progress:
            progress(stage, done[0], total)

    return tick


class AblationEngine:
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
        self.layer_rows = 0  # prompt-rows × layers recomputed so far: cost in units of one layer on one prompt
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

    def _forward(self, repeat: int, config: PassConfig) -> torch.Tensor:
        """Logits at the last position, ``[repeat * prompt, vocab]``."""
        config.stop_layer = self.readout_layer
        with torch.no_grad(), self.intervener.run(config):
            out = self.model(**self._inputs(repeat))
        n_layers = self.n_active_layers - config.start_layer
        self.layer_rows += repeat * self.n_prompts * n_layers
        return out.logits[:, -1, :].float()

    @property
    def query_fast_path(self) -> bool:
        """Query-position ablations reuse the clean keys/values: later layers process one token.

        Used for attention-only models (every head reads earlier positions only through the KV
        cache); SSM and hybrid models take the full-sequence path, which gives the same numbers.
        """
        return all(g.pattern == "attention" for g in self.inventory.groups)

    def _prefix_cache(self):
        """Keys/values of every layer for all but the last position (computed once)."""
        if self._cache is None:
            inputs = self._inputs(1)
            inputs = {k: (v[:, :-1] if k != "use_cache" and k != "logits_to_keep" else v) for k, v in inputs.items()}
            inputs["use_cache"] = True
            with torch.no_grad():
                out = self.model(**inputs)
                # transformers 5.x names the returned cache ``cache`` (``past_key_values`` is its deprecated alias)
                self._cache = out["cache"] if "cache" in out else out.past_key_values
        return self._cache

    def _forward_last(self, repeat: int, config: PassConfig) -> torch.Tensor:
        """Logits at the last position with only the last token recomputed, ``[repeat * prompt, vocab]``."""
        import copy

        cache = copy.deepcopy(self._prefix_cache())
        cache.reorder_cache(torch.arange(repeat * self.n_prompts, device=self.device) % self.n_prompts)
        inputs = self._inputs(repeat)
        inputs["input_ids"] = inputs["input_ids"][:, -1:]
        if "position_ids" in inputs:
            inputs["position_ids"] = inputs["position_ids"][:, -1:]
        cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        inputs.update({cache_arg: cache, "use_cache": True})
        config.stop_layer = self.readout_layer
        with torch.no_grad(), self.intervener.run(config):
            out = self.model(**inputs)
        self.layer_rows += repeat * self.n_prompts * (self.n_active_layers - config.start_layer) / self.n_positions
        return out.logits[:, -1, :].float()

    def _clean_pass(self) -> Scores:
        sinks = {i: (lambda h, i=i: self.hidden.__setitem__(i, h.detach())) for i in range(self.inventory.n_layers)}
        logits = self._forward(1, PassConfig(layer_sinks=sinks))
        return query_scores(logits[None], self.batch)

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
            with torch.no_grad(), self.intervener.run(PassConfig(proj_edits=edits)):
                self.model(**self._inputs(1))
        return captured

    def _prefetch(self, ablations: Sequence[Ablation]) -> None:
        """Capture, in one clean pass, every group input the ablations' mean edits and holds need."""
        means = {(h.layer, h.kind) for a in ablations if a.method == "mean" for h in a.heads} - set(self._means)
        holds = {(h.layer, h.kind) for a in ablations for h in a.hold} - set(self._clean_proj)
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

    def _plan(self, ablations: list[Ablation], rows: slice | None = None) -> PassConfig:
        """Edit functions for a chunk of ablations (rows ablation-major)."""
        classes = self.classes if rows is None else {k: v[rows] for k, v in self.classes.items()}
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

    def predicted_forward_equivalents(self, ablations: Sequence[Ablation]) -> float:
        """What :meth:`run` will cost for ``ablations``, in forward-equivalents of the whole model over the
        batch, by the same count as :attr:`layer_rows` (layers recomputed × prompts; one token of T on the
        query fast path): exact, so the evidence stage can plan within a budget before it runs anything."""
        distinct = {replace(a, label=""): a for a in ablations}.values()
        rows = sum((self.n_active_layers - a.first_layer) / (self.n_positions if self._last_only(a) else 1)
                   for a in distinct)
        return rows / self.inventory.n_layers

    @property
    def forward_equivalents(self) -> float:
        """:attr:`layer_rows` so far, in forward-equivalents of the whole model over the batch."""
        return self.layer_rows / (self.n_prompts * self.inventory.n_layers)

    def run(self, ablations: Sequence[Ablation], progress: Callable[[int], None] | None = None) -> Scores:
        """Scores for every ablation, ``[ablation, prompt]``, batched and prefix-reusing. Ablations that differ
        only in their label are computed once (control draws of neighbouring pairs overlap)."""
        ablations = list(ablations)
        if not ablations:
            return Scores(*(torch.empty(0, self.n_prompts) for _ in METRICS))
        index: dict[Ablation, int] = {}
        slot = [index.setdefault(replace(a, label=""), len(index)) for a in ablations]
        if len(index) < len(ablations):
            distinct = list(index)
            scores = self._run(distinct, progress)
            if progress is not None:
                progress(len(ablations) - len(distinct))  # the duplicates are done too
            pick = torch.tensor(slot)
            return Scores(*(scores[m][pick] for m in METRICS))
        return self._run(ablations, progress)

    def _run(self, ablations: list[Ablation], progress: Callable[[int], None] | None) -> Scores:
        """:meth:`run` for distinct ablations."""
        self._prefetch(ablations)
        order = sorted(range(len(ablations)), key=lambda i: (ablations[i].first_layer, self._last_only(ablations[i])))
        per_chunk = max(1, self.max_rows // self.n_prompts)
        results: dict[int, Scores] = {}
        start = 0
        while start < len(order):
            layer = ablations[order[start]].first_layer
            chunk = [order[start]]
            while (start + len(chunk) < len(order) and len(chunk) < per_chunk
                   and ablations[order[start + len(chunk)]].first_layer == layer
                   and self._last_only(ablations[order[start + len(chunk)]]) == self._last_only(ablations[chunk[0]])):
                chunk.append(order[start + len(chunk)])
            config = self._plan([ablations[i] for i in chunk])
            last_only = all(self._last_only(ablations[i]) for i in chunk)
            if layer > 0:
                config.start_layer = layer
                hidden = self.hidden[layer - 1][:, -1:] if last_only else self.hidden[layer - 1]
                config.start_hidden = hidden.repeat(len(chunk), 1, 1)
            logits = self._forward_last(len(chunk), config) if last_only else self._forward(len(chunk), config)
            scores = query_scores(logits.view(len(chunk), self.n_prompts, -1), self.batch)
            for j, i in enumerate(chunk):
                results[i] = Scores(*(scores[m][j : j + 1] for m in METRICS))
            if progress is not None:
                progress(len(chunk))
            start += len(chunk)
        return Scores.cat([results[i] for i in range(len(ablations))])

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

    def mediation(self, ablation: Ablation, holds: Sequence[Sequence[HeadId]]) -> tuple[float, list[float]]:
        """The mediation test in one batched run: the mean logit-difference effect of ``ablation``, and
        its effect with each head set of ``holds`` held at its clean outputs (at ``ablation.hold_scope``).
        :func:`mediated_share` turns each pair into the share of the cost those heads carry."""
        runs = [replace(ablation, hold=()), *(replace(ablation, hold=tuple(h)) for h in holds)]
        effect = self.effects(runs).logit_diff.mean(1).double().tolist()  # [1 + hold set]
        return effect[0], effect[1:]


def unit_columns(group: HeadGroup, device: torch.device | str) -> torch.Tensor | None:
    """``[head, in_features]`` bool: the input columns of every head of ``group``, refined heads included;
    None for a group without refined heads (its heads are the ``width``-column blocks)."""
    if not group.spans:
        return None
    out = torch.zeros(group.n_units, group.count * group.width, dtype=torch.bool, device=device)
    for index in range(group.n_units):
        out[index, group.columns(index)] = True
    return out


def replace_heads(edit_mask: torch.Tensor, width: int, means: torch.Tensor | None,
                   mean_rows: torch.Tensor | None, units: torch.Tensor | None = None
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """An out-projection input edit: the masked heads' columns become 0, or, on the rows ``mean_rows``
    marks, the values ``means`` ``[prompt, pos, in]`` (class means, or a held head's clean values).
    ``units`` (:func:`unit_columns`) maps heads to columns when some heads are refined channel spans."""

    def edit(x: torch.Tensor) -> torch.Tensor:  # x [row, pos, in]
        rows, pos, _ = x.shape
        mask = edit_mask[:, -pos:]  # [row, pos, head]; a cached single-token pass sees the last position only
        if units is not None:  # heads -> the columns they own: [row, pos, in], one column per "head"
            mask = (mask.to(x.dtype) @ units.to(x.dtype)) > 0
        heads = x.view(rows, pos, -1, 1 if units is not None else width)  # [row, pos, head, width]
        if means is None:
            out = heads.masked_fill(mask[..., None], 0.0)
        else:
            repl = means[:, -pos:].reshape(means.shape[0], pos, *heads.shape[2:])  # [prompt, pos, head, width]
            repl = repl.repeat(rows // means.shape[0], 1, 1, 1)
            use = mask & mean_rows[:, None, None]
            out = torch.where(use[..., None], repl, heads.masked_fill(mask[..., None], 0.0))
        return out.reshape(rows, pos, -1)

    return edit


def mediated_share(cost: float, held: float, min_cost: float = 0.0) -> float | None:
    """The share of an ablation's cost (``cost`` < 0, logit-difference units) that holding heads at their
    clean outputs gives back (``held``: the effect with them held): ``1 - held / cost``. None when the
    ablation costs less than ``min_cost``, where the share would be noise."""
    if not cost < -abs(min_cost):  # also None for a NaN cost
        return None
    return 1.0 - held / cost


def _after(previous: Callable[[torch.Tensor], torch.Tensor] | None,
           edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``edit`` applied after ``previous`` (this layer's own ablation edits, when there are any)."""
    return edit if previous is None else (lambda x: edit(previous(x)))


def _knockout_probs(knock, n: int, p: int, n_heads: int, t: int, device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A probability edit: chosen heads' query rows may not read the chosen keys."""
    mask = torch.zeros(n, p, n_heads, t, t, dtype=torch.bool, device=device)  # [abl, prompt, head, q, k]
    for a, h, qmask, kmask in knock:
        mask[a, :, h] = qmask[:, :, None] & kmask[:, None, :]
    mask = mask.view(n * p, n_heads, t, t)

    def edit(probs: torch.Tensor) -> torch.Tensor:  # [row, head, q, k]
        return probs.masked_fill(mask[:, :, -probs.shape[2]:, -probs.shape[3]:], 0.0)

    return edit


def _capture_components(mixer: torch.nn.Module, holder: dict) -> Callable:
    """Mixer sink: recompute the SSM components of this pass's rows (for SSM edge knockout)."""
    from discovery.model import ssm

    def sink(hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        holder["comp"] = ssm.ssm_components(mixer, hidden, mask)

    return sink


def _knockout_ssm(mixer: torch.nn.Module, holder: dict, knock, p: int, group: HeadGroup,
                  previous: Callable | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Out-projection edit for SSM edge knockout: remove the chosen implicit-attention entries from
    the scan output, redo the mixer's gating/norm, and take only the knocked-out heads' columns
    (the gated norm would otherwise leak the change into the other heads)."""
    import dataclasses

    from discovery.model import ssm

    def edit(x: torch.Tensor) -> torch.Tensor:  # [row, pos, in]
        if previous is not None:
            x = previous(x)
        comp = holder["comp"]
        y = ssm.scan_output(comp)  # mamba2 [row, pos, head, d_head]; mamba1 [row, pos, channel]
        delta = torch.zeros_like(y)
        columns = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.bool, device=x.device)  # [row, in]
        for a, h, qmask, kmask in knock:
            rows = slice(a * p, (a + 1) * p)
            part = dataclasses.replace(comp, **{f: getattr(comp, f)[rows] for f in ("x", "B", "C", "dt", "gate")})
            start, end = group.span(h)
            units = [h] if comp.family == "mamba2" else list(range(start, end))
            delta[rows] += ssm.knockout_delta(part, None, qmask, kmask, heads=units)
            columns[rows, start:end] = True
        knocked = ssm.post_scan(mixer, y + delta, comp).to(x.dtype)  # [row, pos, in]
        return torch.where(columns[:, None, :], knocked, x)

    return edit
