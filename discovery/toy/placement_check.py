"""Validate placement advice by training: one hybrid per attention layer, same recipe and seeds.

``gascan place`` ranks the layers of a scanned model by where attention should be kept (DESIGN.md: the
G&A layers). The check the issue asks for trains Bamba hybrids (Mamba-2 everywhere, softmax attention
at exactly one layer) with attention at the recommended layer and at every other layer, same steps and
seed set, and compares their test accuracy: the recommended placement should win.

Each run is a normal toy directory ``ROOT/attn-L{layer}/seed-{seed}``; a finished run (its
``training.json`` exists) is read back instead of retrained, so an interrupted check resumes. The
table goes to ``ROOT/placement_check.json`` and ``ROOT/placement_check.md``, written atomically.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from discovery.errors import GascanError
from discovery.toy.config import TrainConfig

LEARNED = 0.9  # test accuracy at which a run counts as having learned the task (the speed column)


def layer_ranking(scan_dir: str | Path) -> list[dict[str, Any]]:
    """Every layer of a scan ranked by ``gascan place`` (unit layer), best first: layer, score, why."""
    return _ranked_layers(scan_dir)[0]


def _ranked_layers(scan_dir: str | Path) -> tuple[list[dict[str, Any]], int]:
    """:func:`layer_ranking` and the scanned model's depth, from one read of the scan."""
    from discovery.artifacts import read_scan
    from discovery.rank.placement import place
    from discovery.report import scored_heads

    scan = read_scan(scan_dir)
    n_layers = int(scan.summary.get("n_layers") or 0)
    if n_layers < 1:
        raise GascanError(f"{scan_dir} does not say how many layers its model has", "rescan with gascan scan")
    choices = place(scored_heads(scan), scan.summary, scan.pairs, budget=n_layers, unit="layer")
    if not choices:
        raise GascanError(f"{scan_dir} has no effects or probabilities to place attention by",
                          "scan the model with ablation (gascan scan without --ablation none)")
    return [{"layer": c.layer, "score": c.score, "why": c.why} for c in choices], n_layers


def run_dir(root: Path, layer: int, seed: int) -> Path:
    return root / f"attn-L{layer}" / f"seed-{seed}"


def check_placement(scan_dir: str | Path, base: TrainConfig, root: str | Path, *, layers: Sequence[int] | None = None,
                    seeds: Sequence[int] = (0, 1), progress: Callable[[str], None] | None = None,
                    show_bars: bool = False) -> dict[str, Any]:
    """Train one hybrid per (attention layer, seed), reuse finished runs, and write the comparison table.

    ``base`` is the recipe (``arch`` and ``attn_layers`` are set here); its ``layers`` must match the
    scanned model's depth, since the advice names that model's layers.
    """
    from discovery.io import write_json, write_text
    from discovery.toy.trainer import train

    root = Path(root)
    ranking, depth = _ranked_layers(scan_dir)
    if base.layers != depth:
        raise GascanError(f"the scanned model has {depth} layers but the hybrids would have {base.layers}",
                          f"pass --layers {depth} so the advice's layer numbers mean the same layers")
    layers = list(range(depth)) if layers is None else list(layers)
    bad = [x for x in layers if not 0 <= x < depth]
    if bad or not layers:
        raise GascanError(f"attention layers {bad or layers} are out of range for {depth} layers",
                          f"give layers between 0 and {depth - 1}")
    if not seeds:
        raise GascanError("no seeds to train with", "pass --seeds 0,1")
    runs = []
    for layer in layers:
        for seed in seeds:
            out = run_dir(root, layer, seed)
            cfg = replace(base, arch="hybrid", attn_layers=[layer], seed=seed).validate()
            meta_path = out / "training.json"
            if not meta_path.exists():
                if progress:
                    progress(f"training the hybrid with attention at layer {layer}, seed {seed}")
                train(cfg, out, progress=show_bars, overwrite=True)
            runs.append({"layer": layer, "seed": seed, "dir": str(out), **_read_run(meta_path, cfg)})
    table = {"scan": str(Path(scan_dir).resolve()), **_summarise(ranking, runs, layers, list(seeds), base)}
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "placement_check.json", table)
    write_text(root / "placement_check.md", placement_markdown(table))
    return table


def _read_run(meta_path: Path, cfg: TrainConfig) -> dict[str, Any]:
    """A finished run's figures; it is reused only when it was trained with ``cfg`` (thread count aside)."""
    import json

    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    # from_dict: a setting added after the run was trained gets its default, the value it had then
    done, want = TrainConfig.from_dict(meta.get("config") or {}).to_dict(), cfg.to_dict()
    differ = sorted(k for k in want if k != "threads" and done[k] != want[k])
    if differ:
        raise GascanError(f"{meta_path.parent} was trained with another recipe ({', '.join(differ)} differ)",
                          "use a new --out for a new recipe, or the same options to resume")
    reached = [h["step"] for h in meta.get("history") or [] if h["test_accuracy"] >= LEARNED]
    return {"test_accuracy": meta["test_accuracy"], "steps": meta["steps"], "train_seconds": meta["train_seconds"],
            "first_step_learned": reached[0] if reached else None, "command": meta["command"]}


def _summarise(ranking: list[dict[str, Any]], runs: list[dict[str, Any]], layers: list[int], seeds: list[int],
               base: TrainConfig) -> dict[str, Any]:
    rank_of = {r["layer"]: i + 1 for i, r in enumerate(ranking)}
    score_of = {r["layer"]: r["score"] for r in ranking}
    rows = []
    for layer in layers:
        mine = [r for r in runs if r["layer"] == layer]
        accs = [r["test_accuracy"] for r in mine]
        learned = [r["first_step_learned"] for r in mine]
        rows.append({"layer": layer, "advice_rank": rank_of.get(layer), "advice_score": score_of.get(layer),
                     "accuracies": accs, "mean_accuracy": sum(accs) / len(accs), "first_steps_learned": learned})
    # best: highest mean final accuracy; among equal ones, the layer whose runs learned first (a run that
    # never reached LEARNED counts as one step past the end)
    def speed(r: dict[str, Any]) -> float:
        return sum(s if s is not None else base.steps + 1 for s in r["first_steps_learned"]) / len(r["first_steps_learned"])

    best = max(rows, key=lambda r: (round(r["mean_accuracy"], 3), -speed(r)))
    recommended = ranking[0]["layer"]
    return {
        "recommended_layer": recommended, "recommended_why": ranking[0]["why"],
        "best_layer": best["layer"], "learned_at": LEARNED,
        "recommended_wins": best["layer"] == recommended,
        "seeds": seeds, "steps": base.steps, "rows": rows, "runs": runs, "ranking": ranking,
    }


def placement_markdown(table: dict[str, Any]) -> str:
    """The comparison as a markdown table, recommended layer marked."""
    seeds = table["seeds"]
    lines = [f"Hybrids with softmax attention at one layer (Mamba-2 elsewhere), {table['steps']} steps, "
             f"seeds {', '.join(map(str, seeds))}. Advice (gascan place, unit layer): layer "
             f"{table['recommended_layer']}; best (mean final accuracy, then speed): layer {table['best_layer']}; the recommended "
             f"placement {'wins' if table['recommended_wins'] else 'does not win'}."
             + (f" The advice comes from the scan {table['scan']}." if table.get("scan") else ""), "",
             "| attention at | advice rank | advice score | " + " | ".join(f"seed {s}" for s in seeds)
             + f" | mean accuracy | first step at ≥ {table['learned_at']} |",
             "|---|---:|---:|" + "---:|" * len(seeds) + "---:|---|"]
    for r in table["rows"]:
        mark = " (recommended)" if r["layer"] == table["recommended_layer"] else ""
        rank = "–" if r["advice_rank"] is None else str(r["advice_rank"])
        score = "–" if r["advice_score"] is None else f"{r['advice_score']:.3f}"
        lines.append(f"| layer {r['layer']}{mark} | {rank} | {score} | "
                     + " | ".join(f"{a:.3f}" for a in r["accuracies"]) + f" | {r['mean_accuracy']:.3f} | "
                     + ", ".join("never" if s is None else str(s) for s in r["first_steps_learned"]) + " |")
    return "\n".join(lines) + "\n"
