"""``gascan bench``: the sweep's cost against the naive loop, measured in one run.

For each model: one clean forward over the prompts is the unit (a forward-equivalent). The naive
loop (one full forward per head with a hook, as the papers' notebooks do), the engine's exact
all-position sweep, its query-position sweep and the attribution screen are each timed (wall
clock, peak resident memory above the baseline) on the same heads and prompts, and the engine's
effects are compared with the naive loop's (max |Δ logit diff|). Cost is reported two ways:
wall-time ratio to the naive loop, and compute in forward-equivalents counted by the engine
(layer-rows recomputed ÷ layers × prompts; a query-position row counts 1/positions). The
attribution screens estimate every head of the model at once; their compute is their measured
matmul FLOPs ÷ the clean forward's, and their ratios are to the naive loop over as many heads
(one forward per head, timed per head on the benchmarked ones).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import torch

from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine, single_head_ablations
from discovery.model.intervene import PassConfig
from discovery.model.loading import LoadedModel


class PeakMemory:
    """Peak resident memory (MiB above the start) of this process while the block runs."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak_mb = 0.0
        self._stop = threading.Event()

    @staticmethod
    def rss_mb() -> float:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.rss_mb() - self.base)
            time.sleep(self.interval)

    def __enter__(self) -> Self:
        self.base = self.rss_mb()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self.rss_mb() - self.base)


@dataclass
class Measure:
    name: str
    seconds: float
    peak_mb: float
    forward_equivalents: float | None
    max_diff: float | None
    heads: int  # heads covered (the naive loop's cost grows with them)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    with PeakMemory() as mem:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    return out, seconds, mem.peak_mb


def _vs_naive(m: Measure, naive: Measure) -> tuple[float | None, float]:
    """``m``'s compute and wall time over the naive loop's, scaled to the heads ``m`` covers."""
    scale = m.heads / naive.heads
    compute = None if m.forward_equivalents is None else m.forward_equivalents / (naive.forward_equivalents * scale)
    return compute, m.seconds / (naive.seconds * scale)


def bench_model(lm: LoadedModel, batch, heads: list[HeadId], *, max_memory_mb: float | None = None,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure naive loop, exact sweep, query sweep and AtP on ``heads``; returns a JSON-able dict."""
    torch.manual_seed(0)
    engine, t_setup, _ = _timed(lambda: AblationEngine(lm, batch, max_memory_mb=max_memory_mb))
    n_layers, n_prompts = lm.inventory.n_layers, len(batch)
    unit = n_layers * n_prompts  # layer-rows of one clean forward over the prompts

    def clean_forward():
        return engine._forward(1, PassConfig())

    _, t_clean, _ = _timed(clean_forward)
    _, t_clean, _ = _timed(clean_forward)  # warm
    results: dict[str, Measure] = {}
    for name, scope in (("all", ("all",)), ("query", ("query",))):
        ablations = single_head_ablations(heads, "zero", scope)
        engine.layer_rows = 0
        naive, t_naive, m_naive = _timed(lambda abl=ablations: engine.run_naive(abl))
        naive_cost = engine.layer_rows / unit
        engine.layer_rows = 0
        fast, t_fast, m_fast = _timed(lambda abl=ablations: engine.run(abl))
        fast_cost = engine.layer_rows / unit
        diff = float((fast.logit_diff - naive.logit_diff).abs().max())
        results[f"naive_{name}"] = Measure(f"naive loop ({name})", t_naive, m_naive, naive_cost, None, len(heads))
        results[f"sweep_{name}"] = Measure(f"engine sweep ({name})", t_fast, m_fast, fast_cost, diff, len(heads))
        log(f"  {name}: naive {t_naive:.2f}s, engine {t_fast:.2f}s, max |Δ| {diff:.2e}")
    from discovery.measure.attribution import atp_effects

    for key, label, qk_fix in (("atp", "attribution screen (AtP)", False), ("atp_qk", "AtP with the QK fix", True)):
        # the screen estimates every head of the model at once; its cost is its measured matmul FLOPs
        # over those of the clean forward it runs
        atp, t_atp, m_atp = _timed(lambda q=qk_fix: atp_effects(lm, batch, method="zero", scope=("all",), qk_fix=q))
        results[key] = Measure(f"{label}, all {len(atp.heads)} heads", t_atp, m_atp,
                               float(atp.forward_equivalents), None, len(atp.heads))
        log(f"  {label}: {atp.forward_equivalents:.2f} forward-equivalents for all {len(atp.heads)} heads, {t_atp:.2f}s")
    naive = results["naive_all"]
    measures = {}
    for key, m in results.items():  # each measure against the naive loop over as many heads
        compute, wall = _vs_naive(m, naive)
        measures[key] = {**vars(m), "vs_naive_compute": compute, "vs_naive_wall": wall}
    out = {
        "model": lm.name, "n_layers": n_layers, "n_prompts": n_prompts, "positions": engine.n_positions,
        "heads": len(heads), "clean_forward_s": t_clean, "engine_setup_s": t_setup,
        "max_memory_mb": max_memory_mb,
        "measures": measures,
        "ratios": {
            "exact_vs_naive_wall": measures["sweep_all"]["vs_naive_wall"],
            "exact_vs_naive_compute": measures["sweep_all"]["vs_naive_compute"],
            "query_vs_naive_wall": measures["sweep_query"]["vs_naive_wall"],
            "query_vs_naive_compute": measures["sweep_query"]["vs_naive_compute"],
            "atp_vs_naive_compute": measures["atp"]["vs_naive_compute"],
            "atp_qk_vs_naive_compute": measures["atp_qk"]["vs_naive_compute"],
            "atp_forward_equivalents_wall": results["atp"].seconds / t_clean,
            "atp_qk_forward_equivalents_wall": results["atp_qk"].seconds / t_clean,
        },
    }
    # the engine's chunking promise: its sweeps' peak resident memory (above the start) stays within --max-memory
    out["engine_peak_within_budget"] = (None if not max_memory_mb else
                                        all(results[k].peak_mb <= max_memory_mb for k in ("sweep_all", "sweep_query")))
    return out
