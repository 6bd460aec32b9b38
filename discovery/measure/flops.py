"""Counting the compute a piece of work really does: matrix-multiply FLOPs, forward and backward.

:class:`MatmulFlops` is a dispatch mode that adds up, with PyTorch's own per-operator formulas
(``torch.utils.flop_counter``: matmuls, linear layers, convolutions, fused attention), the FLOPs of
every operator run inside it, including the operators autograd runs for a backward. Element-wise
work is not counted, as usual for FLOP counts. PyTorch's ``FlopCounterMode`` would do the same but
its module tracker breaks ``torch.autograd.grad`` on leaf tensors, which the attribution screen
needs, so this is the bare counter without the tracker. The registry has no formula for the CPU
kernel of fused attention (``_scaled_dot_product_flash_attention_for_cpu``); it is counted here with
the registry's own attention formula, so sdpa passes on a CPU count their score and value matmuls as
eager passes do.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count


def _cpu_sdpa_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


_EXTRA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


class MatmulFlops(TorchDispatchMode):
    """``with MatmulFlops() as counter: ...`` then ``counter.total`` (FLOPs, 2 per multiply-add).

    Counters nest: an operator run inside two counters adds to both. :meth:`current` is the innermost
    counter entered (in this process), so a meter can read an enclosing counter instead of adding one.
    """

    _entered: ClassVar[list[MatmulFlops]] = []

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __enter__(self) -> Self:
        MatmulFlops._entered.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if MatmulFlops._entered and MatmulFlops._entered[-1] is self:
            MatmulFlops._entered.pop()

    @classmethod
    def current(cls) -> MatmulFlops | None:
        """The innermost counter now counting, or None."""
        return cls._entered[-1] if cls._entered else None

    def __torch_dispatch__(self, func, types, args: tuple = (), kwargs: dict[str, Any] | None = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket) or _EXTRA.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


@contextmanager
def layer_flops(layers: Sequence[torch.nn.Module]) -> Iterator[tuple[list[int], list[int]]]:
    """Count, during the block, each of ``layers``' matmul FLOPs and the whole block's: ``([layer], [total])``
    (filled when the block ends; how the ablation engine weighs a layer and the readout)."""
    per_layer, total, started = [0] * len(layers), [0], [0]
    with MatmulFlops() as counter:
        def enter(module, args):
            started[0] = counter.total

        def leave(i):
            def hook(module, args, output):
                per_layer[i] += counter.total - started[0]
            return hook

        handles = [h for i, layer in enumerate(layers)
                   for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave(i)))]
        try:
            yield per_layer, total
        finally:
            for h in handles:
                h.remove()
            total[0] = counter.total
