"""Bind an architecture table to a loaded model: the head inventory and the modules behind it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from discovery.errors import GascanError
from discovery.heads import HeadGroup, Inventory
from discovery.model.tables import ArchTable, Component, supported_model_types, table_for

DEFAULT_MAMBA1_GROUPS = 32  # Mamba-1 has channels, not heads: about this many channel groups per layer
# A layer with one of these normalises each block's output before the residual add (Gemma 2/3, OLMo 2)
POST_NORM_MARKERS = ("post_feedforward_layernorm",)


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


@dataclass
class Adapter:
    """A model seen through its architecture table.

    ``inventory`` lists every head; ``out_proj(layer, kind)`` and ``mixer(layer, kind)`` return the
    modules that carry them. ``mamba1_group_width`` sets how many Mamba-1 channels form one head
    (the channel-level view is ``mamba1_group_width=1``).
    """

    model: nn.Module
    table: ArchTable
    mamba1_group_width: int | None = None
    inventory: Inventory = field(init=False)
    _components: dict[tuple[int, str], tuple[Component, nn.Module, nn.Module]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        layers = self.layers()
        self._components = {}
        groups: list[HeadGroup] = []
        for index, layer in enumerate(layers):
            for comp in self.table.components:
                mixer = _resolve(layer, comp.mixer)
                proj = _resolve(layer, comp.out_proj)
                if mixer is None or proj is None or (index, comp.kind) in self._components:
                    continue
                count, width = self._head_shape(comp, mixer, proj)
                self._components[(index, comp.kind)] = (comp, mixer, proj)
                prefix = f"{self.table.layers}.{index}."
                groups.append(
                    HeadGroup(index, comp.kind, count, width, prefix + comp.out_proj, prefix + comp.mixer, comp.pattern)
                )
        self.inventory = Inventory(self.model_type, len(layers), groups)

    @property
    def model_type(self) -> str:
        return str(getattr(self.model.config, "model_type", self.table.family))

    @property
    def config(self):
        return self.model.config

    def layers(self) -> nn.ModuleList:
        return self.model.get_submodule(self.table.layers)

    def final_norm(self) -> nn.Module:
        return self.model.get_submodule(self.table.final_norm)

    def unembed(self) -> nn.Module:
        return self.model.get_submodule(self.table.unembed)

    def component(self, layer: int, kind: str) -> Component:
        return self._components[(layer, kind)][0]

    def mixer(self, layer: int, kind: str) -> nn.Module:
        return self._components[(layer, kind)][1]

    def out_proj(self, layer: int, kind: str) -> nn.Module:
        return self._components[(layer, kind)][2]

    def out_proj_weight(self, layer: int, kind: str) -> torch.Tensor:
        """The output projection's weight as ``[d_model, in_features]`` (GPT-2's Conv1D stores it transposed)."""
        proj = self.out_proj(layer, kind)
        weight = proj.weight
        if type(proj).__name__ == "Conv1D":
            weight = weight.t()
        return weight

    def residual_write_scale(self, layer: int, kind: str) -> float | None:
        """The factor by which ``(layer, kind)``'s out-projection output enters the residual stream,
        or ``None`` when it passes through a norm or another block first (no direct linear write)."""
        comp = self.component(layer, kind)
        module = self.layers()[layer]
        if not comp.direct_write or any(_resolve(module, m) is not None for m in POST_NORM_MARKERS):
            return None
        if comp.write_scale is None:
            return 1.0
        return float(getattr(module, comp.write_scale))

    def _head_shape(self, comp: Component, mixer: nn.Module, proj: nn.Module) -> tuple[int, int]:
        in_features = int(proj.weight.shape[0] if type(proj).__name__ == "Conv1D" else proj.in_features)
        cfg = self.model.config
        if comp.pattern == "attention":
            n = getattr(mixer, "num_heads", None) or getattr(cfg, "num_attention_heads", None) or cfg.n_head
            n = int(n)
        elif comp.pattern == "mamba2":
            n = int(mixer.num_heads)
        elif comp.pattern == "mamba1":
            width = self.mamba1_group_width or max(1, in_features // DEFAULT_MAMBA1_GROUPS)
            if in_features % width:
                raise GascanError(
                    f"Mamba-1 channel group width {width} does not divide the {in_features} channels",
                    "choose a width that divides the channel count (--mamba1-group-width)",
                )
            return in_features // width, width
        else:  # pragma: no cover - tables are ours
            raise ValueError(comp.pattern)
        if in_features % n:
            raise GascanError(f"{in_features} output-projection inputs do not split into {n} heads",
                              "report this model to the gascan developers")
        return n, in_features // n


def adapter_for(model: nn.Module, mamba1_group_width: int | None = None) -> Adapter:
    """Pick the table for ``model`` by its config's ``model_type``; unsupported types fail clearly."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        table = table_for(str(model_type))
    except GascanError:
        raise GascanError(
            f"unsupported architecture {model_type!r}",
            f"gascan supports: {', '.join(supported_model_types())}",
        ) from None
    return Adapter(model, table, mamba1_group_width)
