"""``gascan bench``: the sweep's cost against the naive loop and the clean forward, measured in one run.

Methods, on the same heads (every head of the model unless limited) and prompts:

- ``clean``: one clean forward over the prompts, the unit (a forward-equivalent);
- ``naive_all`` / ``naive_query``: one full forward per head with a hook, as the papers' notebooks do
  (the reference; optionally timed on an evenly spread subset of the heads and scaled per head,
  since every naive forward costs the same);
- ``sweep_all`` / ``sweep_query``: the engine's exact all-position and query-position sweeps;
- ``atp`` / ``atp_qk``: the attribution screen without and with the QK fix (every head of the model).

Timing is honest about noise: one warm-up round, then ``repeats`` rounds that run every method once,
round-robin (the order rotates each round), so a load spike from other jobs hits every method alike.
Each method reports the median wall time and its min/max; the clean forward is timed inside the same
rounds, and its median is the unit of the wall ratios. Compute is counted, not timed: matmul FLOPs
(:class:`~discovery.measure.flops.MatmulFlops`) of one untimed run of each method over the clean
forward's. Each fast method's largest difference from the naive loop's numbers is reported too (for
the sweeps a check that they are exact; for the screens their approximation error).
"""
from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import torch

from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine, Scores, single_head_ablations
from discovery.measure.flops import MatmulFlops
from discovery.model.intervene import PassConfig
from discovery.model.loading import LoadedModel
from pipelines.progress import Progress

METHODS = ("clean", "naive_all", "sweep_all", "naive_query", "sweep_query", "atp", "atp_qk")
NAMES = {"clean": "clean forward", "naive_all": "naive loop (all)", "sweep_all": "engine sweep (all)",
         "naive_query": "naive loop (query)", "sweep_query": "engine sweep (query)",
         "atp": "attribution screen (AtP)", "atp_qk": "AtP with the QK fix"}
REFERENCE = {"sweep_all": "naive_all", "sweep_query": "naive_query", "atp": "naive_all", "atp_qk": "naive_all"}
# the targets: query sweep wall ≤ 3× its compute ideal, AtP+QK ≤ 6 forward-equivalents of wall
# time, the exact all-position sweep ≤ 0.55× the naive loop's wall time
TARGETS = {"query_wall_over_compute_ideal": 3.0, "atp_qk_forward_equivalents_wall": 6.0,
           "exact_vs_naive_wall": 0.55}


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


def spread(items: list[HeadId], n: int | None) -> list[HeadId]:
    """``n`` of ``items`` evenly spread over the list (all when ``n`` is None or not smaller)."""
    if n is None or n >= len(items):
        return list(items)
    return [items[(2 * i + 1) * len(items) // (2 * n)] for i in range(max(1, n))]


def machine() -> dict[str, Any]:
    """What the numbers were measured on (shared cores make wall times noisy: the load says how busy)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "load_average_1m": None if load is None else round(load[0], 2)}


class _Runs:
    """The methods as callables over one engine (``heads`` for the sweeps, ``naive`` for the naive loops)."""

    def __init__(self, lm: LoadedModel, batch, engine: AblationEngine, heads: list[HeadId],
                 naive: list[HeadId]) -> None:
        from discovery.measure.attribution import atp_effects

        self.engine = engine
        self.ablations = {s: single_head_ablations(heads, "zero", (s,)) for s in ("all", "query")}
        self.naive = {s: single_head_ablations(naive, "zero", (s,)) for s in ("all", "query")}
        self.calls: dict[str, Callable[[], Any]] = {
            "clean": lambda: engine._forward(1, PassConfig()),
            "naive_all": lambda: engine.run_naive(self.naive["all"]),
            "sweep_all": lambda: engine.run(self.ablations["all"]),
            "naive_query": lambda: engine.run_naive(self.naive["query"]),
            "sweep_query": lambda: engine.run(self.ablations["query"]),
            "atp": lambda: atp_effects(lm, batch, method="zero", scope=("all",), qk_fix=False),
            "atp_qk": lambda: atp_effects(lm, batch, method="zero", scope=("all",), qk_fix=True),
        }

    def warm_up(self) -> None:
        """Every code path once on a few heads (allocator, lazy caches, first-call overheads)."""
        few = {s: spread(abl, 3) for s, abl in self.naive.items()}
        for _ in range(2):
            self.engine._forward(1, PassConfig())
        for s in ("all", "query"):
            self.engine.run_naive(few[s])
            self.engine.run(few[s])
        self.calls["atp"]()
        self.calls["atp_qk"]()


def _sync() -> None:
    """Wait for queued GPU work, so wall time covers it (CUDA kernels run asynchronously)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    with PeakMemory() as mem:
        _sync()
        start = time.perf_counter()
        out = fn()
        _sync()
        seconds = time.perf_counter() - start
    return out, seconds, mem.peak_mb


def _flops(fn: Callable[[], Any]) -> int:
    with MatmulFlops() as counter:
        fn()
    return counter.total


def _max_diff(fast: Any, reference: Scores, clean: Scores, index: list[int]) -> float:
    """Largest |Δ logit diff| of ``fast`` (engine scores, or AtP estimates of the change) from the naive loop's."""
    if isinstance(fast, Scores):
        return float((fast.logit_diff[index] - reference.logit_diff).abs().max())
    exact = reference.logit_diff - clean.logit_diff  # the change AtP estimates, [head, prompt]
    return float((fast.estimate[index] - exact).abs().max())


def bench_model(lm: LoadedModel, batch, heads: list[HeadId], *, repeats: int = 3, naive_heads: int | None = None,
                max_memory_mb: float | None = None, log: Callable[[str], None] = print,
                progress: Progress | None = None) -> dict[str, Any]:
    """Measure every method of :data:`METHODS` on ``heads``; returns a JSON-able dict."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    torch.manual_seed(0)
    started = machine()
    engine, t_setup, _ = _timed(lambda: AblationEngine(lm, batch, max_memory_mb=max_memory_mb))
    naive = spread(heads, naive_heads)
    runs = _Runs(lm, batch, engine, heads, naive)
    stage = f"bench {lm.name}"
    total = 1 + repeats * len(METHODS) + len(METHODS)
    tick = (lambda done: progress(stage, done, total)) if progress else (lambda done: None)
    tick(0)
    runs.warm_up()
    tick(1)
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    peaks: dict[str, float] = dict.fromkeys(METHODS, 0.0)
    outputs: dict[str, Any] = {}
    for r in range(repeats):  # round-robin, the order rotating each round
        order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
        for i, method in enumerate(order):
            outputs[method], seconds, peak = _timed(runs.calls[method])
            samples[method].append(seconds)
            peaks[method] = max(peaks[method], peak)
            tick(2 + r * len(METHODS) + i)
        log(f"  round {r + 1}/{repeats}: " + ", ".join(f"{m} {samples[m][-1]:.2f}s" for m in METHODS))
    flops: dict[str, int] = {}
    rows: dict[str, float] = {}  # the engine's own count, layer rows over a clean forward's, as a cross-check
    for i, method in enumerate(METHODS):  # compute: one untimed, counted run of each
        if not method.startswith("atp"):  # the screen counts its own FLOPs over its own clean forward
            engine.layer_rows = 0
            flops[method] = _flops(runs.calls[method])
            scale = len(heads) / len(naive) if method.startswith("naive") else 1.0
            rows[method] = scale * engine.layer_rows / (lm.inventory.n_layers * len(batch))
        tick(1 + repeats * len(METHODS) + i + 1)
    out = _summarise(lm, batch, engine, heads, naive, samples, peaks, outputs, flops, repeats=repeats,
                     t_setup=t_setup, max_memory_mb=max_memory_mb)
    for method, value in rows.items():
        out["measures"][method]["layer_rows_forward_equivalents"] = value
    out["machine"] = started | {"load_average_1m_end": machine()["load_average_1m"]}
    return out


def _summarise(lm, batch, engine, heads, naive, samples, peaks, outputs, flops, *, repeats, t_setup,
               max_memory_mb) -> dict[str, Any]:
    """Medians, spreads, the ratios to the naive loop and to the clean forward, the targets."""
    n_heads_model = len(list(lm.inventory.heads()))
    covered = {m: len(heads) for m in METHODS} | {"clean": 0, "atp": n_heads_model, "atp_qk": n_heads_model}
    scale = {m: (len(heads) / len(naive) if m.startswith("naive") else 1.0) for m in METHODS}
    clean_s = statistics.median(samples["clean"])
    clean_flops = flops["clean"]
    index = [heads.index(h) for h in naive]
    measures: dict[str, dict[str, Any]] = {}
    for m in METHODS:
        wall = statistics.median(samples[m]) * scale[m]
        if m.startswith("atp"):
            compute = float(outputs[m].forward_equivalents)
        else:
            compute = flops[m] * scale[m] / clean_flops
        measures[m] = {"name": NAMES[m], "heads": covered[m], "seconds": wall,
                       "seconds_min": min(samples[m]) * scale[m], "seconds_max": max(samples[m]) * scale[m],
                       "samples_s": samples[m], "peak_mb": peaks[m], "forward_equivalents": compute,
                       "forward_equivalents_wall": wall / clean_s,
                       "wall_over_compute_ideal": (wall / clean_s) / compute if compute else None,
                       "max_diff": None}
        if m.startswith("naive") and len(naive) < len(heads):
            measures[m]["timed_heads"] = len(naive)
            measures[m]["note"] = (f"timed on {len(naive)} of {len(heads)} heads (evenly spread) and scaled per "
                                   "head: every naive forward costs the same")
    for m, ref in REFERENCE.items():  # against the naive loop over as many heads as m covers
        per_head_wall = measures[ref]["seconds"] / len(heads)
        per_head_compute = measures[ref]["forward_equivalents"] / len(heads)
        measures[m]["vs_naive_wall"] = measures[m]["seconds"] / (per_head_wall * covered[m])
        measures[m]["vs_naive_compute"] = measures[m]["forward_equivalents"] / (per_head_compute * covered[m])
        measures[m]["max_diff"] = _max_diff(_pick(outputs[m], heads, lm), outputs[ref], engine.clean, index)
    for m in ("naive_all", "naive_query"):
        measures[m]["vs_naive_wall"] = measures[m]["vs_naive_compute"] = 1.0
    ratios = {
        "exact_vs_naive_wall": measures["sweep_all"]["vs_naive_wall"],
        "exact_vs_naive_compute": measures["sweep_all"]["vs_naive_compute"],
        "query_vs_naive_wall": measures["sweep_query"]["vs_naive_wall"],
        "query_vs_naive_compute": measures["sweep_query"]["vs_naive_compute"],
        "query_wall_over_compute_ideal": measures["sweep_query"]["wall_over_compute_ideal"],
        "exact_wall_over_compute_ideal": measures["sweep_all"]["wall_over_compute_ideal"],
        "atp_vs_naive_compute": measures["atp"]["vs_naive_compute"],
        "atp_qk_vs_naive_compute": measures["atp_qk"]["vs_naive_compute"],
        "atp_forward_equivalents_wall": measures["atp"]["forward_equivalents_wall"],
        "atp_qk_forward_equivalents_wall": measures["atp_qk"]["forward_equivalents_wall"],
    }
    targets = {k: {"target": t, "measured": ratios[k], "met": ratios[k] is not None and ratios[k] <= t}
               for k, t in TARGETS.items()}
    out = {
        "model": lm.name, "n_layers": lm.inventory.n_layers, "n_prompts": len(batch),
        "positions": engine.n_positions, "heads": len(heads), "heads_in_model": n_heads_model,
        "naive_timed_heads": len(naive), "repeats": repeats, "warmup_rounds": 1,
        "clean_forward_s": clean_s, "clean_forward_flops": clean_flops, "engine_setup_s": t_setup,
        "max_memory_mb": max_memory_mb, "measures": measures, "ratios": ratios, "targets": targets,
    }
    # the engine's chunking promise: its sweeps' peak resident memory (above the start) stays within --max-memory
    out["engine_peak_within_budget"] = (None if not max_memory_mb else
                                        all(peaks[k] <= max_memory_mb for k in ("sweep_all", "sweep_query")))
    return out


def _pick(output: Any, heads: list[HeadId], lm: LoadedModel) -> Any:
    """The screens estimate every head of the model: keep the rows of ``heads``, in that order."""
    if isinstance(output, Scores):
        return output
    import dataclasses

    row = {h: i for i, h in enumerate(output.heads)}
    return dataclasses.replace(output, estimate=output.estimate[[row[h] for h in heads]])
