"""What a piece of work cost: wall seconds, counted matmul FLOPs and peak memory, in one record.

``with Meter() as meter: ...`` then ``meter.cost``. FLOPs come from :class:`~discovery.measure.flops.MatmulFlops`
(an enclosing counter is read, not doubled: nested meters share the outermost counting). Forward-equivalents
are a cost's FLOPs over those of one clean forward over the same prompts (:meth:`Cost.forward_equivalents`).
Memory is cheap to read, never sampled: the process's resident high-water mark (``ru_maxrss``) at the end and
how much the work raised it, and on CUDA the peak allocated during the work (``max_memory_allocated``).
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch

from discovery.measure.flops import MatmulFlops


def max_rss_mib() -> float:
    """The process's peak resident memory so far, in MiB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


@dataclass
class Cost:
    """One piece of work's cost (see module docstring); ``peak_cuda_mib`` is None off CUDA."""

    wall_s: float = 0.0
    flops: int = 0
    peak_rss_mib: float = 0.0
    rss_growth_mib: float = 0.0
    peak_cuda_mib: float | None = None

    def forward_equivalents(self, unit_flops: float) -> float | None:
        """FLOPs over ``unit_flops`` (one clean forward over the same prompts); None without a unit."""
        return self.flops / unit_flops if unit_flops else None

    def __add__(self, other: Cost) -> Cost:
        cuda = [c for c in (self.peak_cuda_mib, other.peak_cuda_mib) if c is not None]
        return Cost(self.wall_s + other.wall_s, self.flops + other.flops,
                    max(self.peak_rss_mib, other.peak_rss_mib), self.rss_growth_mib + other.rss_growth_mib,
                    max(cuda) if cuda else None)

    def record(self, unit_flops: float | None = None) -> dict[str, Any]:
        """The JSON record: rounded numbers and, given a unit, ``forward_equivalents``."""
        out: dict[str, Any] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        if unit_flops:
            out["forward_equivalents"] = round(self.flops / unit_flops, 3)
        return out


class Meter:
    """Measure the block it wraps: ``with Meter() as m: ...``; ``m.cost`` afterwards. Meters nest (the
    CUDA peak of an inner block still counts for the outer one)."""

    _open: ClassVar[list[Meter]] = []

    def __init__(self) -> None:
        self.cost = Cost()
        self._own: MatmulFlops | None = None
        self._cuda_peak = 0.0  # the CUDA peak before inner meters reset the counter

    def __enter__(self) -> Self:
        self._counter = MatmulFlops.current()
        if self._counter is None:
            self._own = self._counter = MatmulFlops()
            self._own.__enter__()
        self._flops0 = self._counter.total
        self._rss0 = max_rss_mib()
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            for outer in Meter._open:
                outer._cuda_peak = max(outer._cuda_peak, torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.reset_peak_memory_stats()
        Meter._open.append(self)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        if Meter._open and Meter._open[-1] is self:
            Meter._open.pop()
        if self._own is not None:
            self._own.__exit__(*exc)
        rss = max_rss_mib()
        cuda = max(self._cuda_peak, torch.cuda.max_memory_allocated() / 2**20) if self._cuda else None
        for outer in Meter._open:
            outer._cuda_peak = max(outer._cuda_peak, cuda or 0.0)
        self.cost = Cost(wall, self._counter.total - self._flops0, rss, rss - self._rss0, cuda)
