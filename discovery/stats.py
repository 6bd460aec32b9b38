"""Small statistics: bootstrap confidence intervals over prompts."""
from __future__ import annotations

import torch


def bootstrap_ci(values: torch.Tensor, n_boot: int = 1000, level: float = 0.95,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean and percentile bootstrap interval over the last dimension (prompts).

    ``values`` is ``[..., prompt]``; returns ``(mean, lo, hi)`` each ``[...]``. Deterministic for ``seed``.
    """
    values = values.double()
    n = values.shape[-1]
    mean = values.mean(-1)
    if n < 2:
        return mean, mean.clone(), mean.clone()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (n_boot, n), generator=gen)  # [boot, prompt]
    boots = values[..., idx].mean(-1)  # [..., boot]
    alpha = (1 - level) / 2
    lo = torch.quantile(boots, alpha, dim=-1)
    hi = torch.quantile(boots, 1 - alpha, dim=-1)
    return mean, lo, hi
