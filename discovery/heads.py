"""What a head is: ``HeadId(layer, index, kind)`` and the per-model head inventory."""
from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class HeadGroup:
    """The heads of one kind in one layer, and where their outputs live.

    ``out_proj`` is the module path (relative to the model) of the projection whose *input* slice
    ``[index * width, (index + 1) * width)`` carries head ``index``; ablations edit that slice.
    ``pattern`` names how the head's ``[query, key]`` pattern is computed (``"eager_attention"``,
    ``"mamba1"``, ``"mamba2"``).
    """

    layer: int
    kind: HeadKind
    count: int
    width: int
    out_proj: str
    mixer: str
    pattern: str

    def heads(self) -> list[HeadId]:
        return [HeadId(self.layer, i, self.kind) for i in range(self.count)]

    def columns(self, index: int) -> slice:
        return slice(index * self.width, (index + 1) * self.width)


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
        return [h for g in self.groups if kind in (None, g.kind) for h in g.heads()]

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
