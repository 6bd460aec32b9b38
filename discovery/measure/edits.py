"""What an ablation is (:class:`Ablation`: which heads, how, where) and how it edits heads inside a forward:
the position classes it edits at, the out-projection
input edits (zero, mean, clean values for held heads) and the edge knockouts (attention probabilities;
SSM implicit-attention entries), as functions the :class:`~discovery.model.intervene.Intervener`
applies. The ablation engine builds them (:meth:`~discovery.measure.ablation.AblationEngine.plan`);
the attribution screen shares the position classes."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from discovery.heads import HeadGroup, HeadId, Inventory

METHODS = ("zero", "mean", "knockout")
SCOPES = ("all", "query", "summary", "segment", "label")


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


# Position classes for mean ablation, most specific first: a position takes the first class it is in.
MEAN_CLASSES = ("query", "summary", "label", "segment", "all")


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
