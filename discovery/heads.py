"""What a head is: ``HeadId(layer, index, kind)`` and the per-model head inventory."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

HeadKind = Literal["attn", "ssm"]
HEAD_KINDS: tuple[HeadKind, ...] = ("attn", "ssm")


@dataclass(frozen=True, order=True)
class HeadId:
    """One head: a softmax attention head (query head under GQA) or an SSM head / channel group."""

    layer: int
    index: int
    kind: HeadKind

    def __str__(self) -> str:
        return f"L{self.layer}{'H' if self.kind == 'attn' else 'S'}{self.index}"

    def as_dict(self) -> dict[str, int | str]:
        return {"layer": self.layer, "head": self.index, "kind": self.kind}


def channel_label(name: str, start: int | None, end: int | None, note: str = "") -> str:
    """A head's name with its Mamba-1 channels when it is a refined channel head (``L1S32 (ch 195)``,
    ``L1S33 (ch 48-55)``; ``note`` goes inside the parentheses: ``L1S32 (ch 195, drop 1.19)``), else the
    name: the one wording of the report's tables and the verdict sentence."""
    if start is None or end is None:
        return name
    channels = str(start) if end - start == 1 else f"{start}-{end - 1}"
    return f"{name} (ch {channels}{note})"


@dataclass(frozen=True)
class HeadGroup:
    """The heads of one kind in one layer, and where their outputs live.

    ``out_proj`` is the module path (relative to the model) of the projection whose *input* slice
    ``[index * width, (index + 1) * width)`` carries head ``index``; ablations edit that slice.
    ``pattern`` names how the head's ``[query, key]`` pattern is computed (``"eager_attention"``,
    ``"mamba1"``, ``"mamba2"``).

    ``spans`` are *refined* heads (Mamba-1 channel refinement): head ``count + k`` owns the input columns
    ``[spans[k][0], spans[k][1])``, any contiguous channel range (it overlaps the group heads that hold
    those channels). ``heads()`` lists the ``count`` group heads only; ``refined_heads()`` the others.
    """

    layer: int
    kind: HeadKind
    count: int
    width: int
    out_proj: str
    mixer: str
    pattern: str
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def n_units(self) -> int:
        """Group heads plus refined heads: the head indices ``0 .. n_units - 1``."""
        return self.count + len(self.spans)

    def heads(self) -> list[HeadId]:
        return [HeadId(self.layer, i, self.kind) for i in range(self.count)]

    def refined_heads(self) -> list[HeadId]:
        return [HeadId(self.layer, self.count + k, self.kind) for k in range(len(self.spans))]

    def span(self, index: int) -> tuple[int, int]:
        """Head ``index``'s input columns as ``(start, end)`` (end exclusive)."""
        if index >= self.count:
            return self.spans[index - self.count]
        return index * self.width, (index + 1) * self.width

    def columns(self, index: int) -> slice:
        return slice(*self.span(index))


@dataclass
class Inventory:
    """Every head of a model, layer by layer."""

    architecture: str
    n_layers: int
    groups: list[HeadGroup] = field(default_factory=list)

    def layer_groups(self, layer: int) -> list[HeadGroup]:
        return [g for g in self.groups if g.layer == layer]

    def group(self, layer: int, kind: HeadKind) -> HeadGroup:
        for g in self.groups:
            if g.layer == layer and g.kind == kind:
                return g
        raise KeyError(f"layer {layer} has no {kind} heads")

    def heads(self, kind: HeadKind | None = None) -> list[HeadId]:
        """The group heads (refined channel heads excluded: they overlap them)."""
        return [h for g in self.groups if kind in (None, g.kind) for h in g.heads()]

    def refine(self, layer: int, kind: HeadKind, spans: Iterable[tuple[int, int]]) -> list[HeadId]:
        """Refined heads for the channel ``spans`` of one group (added after its existing ones; a span it
        already has keeps its head), in the order given."""
        group = self.group(layer, kind)
        known = list(group.spans)
        wanted = [(int(s), int(e)) for s, e in spans]
        for start, end in wanted:
            if not 0 <= start < end <= group.count * group.width:
                raise ValueError(f"channel span {start}:{end} is outside layer {layer}'s "
                                 f"{group.count * group.width} channels")
            if (start, end) not in known:
                known.append((start, end))
        self.set_spans(layer, kind, known)
        return [HeadId(layer, group.count + known.index(span), kind) for span in wanted]

    def restore_spans(self, rows: Iterable[tuple[int, int, str, int, int]]) -> None:
        """Set every group's refined heads to exactly ``rows`` ``(layer, head, kind, start, end)`` (a head
        table's refined rows; duplicates across tasks allowed): each head index must follow the group heads
        without gaps, as :meth:`refine` numbered them."""
        found: dict[tuple[int, str], dict[int, tuple[int, int]]] = {}
        for layer, head, kind, start, end in rows:
            spans = found.setdefault((int(layer), str(kind)), {})
            if spans.setdefault(int(head), (int(start), int(end))) != (int(start), int(end)):
                raise ValueError(f"head {head} of layer {layer} names two channel spans")
        for group in list(self.groups):
            spans = found.get((group.layer, group.kind), {})
            order = sorted(spans)
            if order != list(range(group.count, group.count + len(order))):
                raise ValueError(f"the refined heads of layer {group.layer} are numbered {order}, not from "
                                 f"{group.count} on without gaps")
            self.set_spans(group.layer, group.kind, [spans[i] for i in order])

    def set_spans(self, layer: int, kind: HeadKind, spans: Iterable[tuple[int, int]]) -> None:
        """Replace one group's refined heads by ``spans`` (head ``count + k`` = ``spans[k]``)."""
        group = self.group(layer, kind)
        self.groups[self.groups.index(group)] = replace(group, spans=tuple((int(s), int(e)) for s, e in spans))

    def n_heads(self) -> dict[str, int]:
        return {k: sum(g.count for g in self.groups if g.kind == k) for k in HEAD_KINDS}

    def as_json(self) -> dict:
        """The stable ``gascan inspect --json`` form."""
        layers = []
        for layer in range(self.n_layers):
            groups = self.layer_groups(layer)
            layers.append(
                {
                    "index": layer,
                    "kinds": [g.kind for g in groups],
                    "heads": {k: sum(g.count for g in groups if g.kind == k) for k in HEAD_KINDS},
                    "widths": {g.kind: g.width for g in groups},
                }
            )
        return {
            "architecture": self.architecture,
            "n_layers": self.n_layers,
            "layers": layers,
            "n_heads": self.n_heads(),
        }
