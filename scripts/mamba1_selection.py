"""Which Mamba-1 groups to refine, measured on the committed scan's prompts (issue 25; toy README).

Runs the group sweep of ``bundled:mc-mamba1`` on the scan's 64 prompts (seed 0) once, then compares:

- ``default``: the tree from the groups whose drop counts (>= 10% of clean, interval above 0);
- ``starts at 5%``: the tree at half that threshold (a group or a half counts from 5% of clean);
- ``channel AtP``: every group holding a channel whose AtP estimate (gradient x (0 - x) at each channel of
  the out-projection input) reaches 10%, added to the default starts.

For each: groups refined, ablations, forward-equivalents, and recall of the channel truth on the scan's prompts
(tests/data) and on the bundled truth's prompts (truth_channels.json). About 2 minutes on one core::

    OMP_NUM_THREADS=1 python scripts/mamba1_selection.py
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from discovery.measure.ablation import METRICS, AblationEngine, Scores, single_head_ablations
from discovery.measure.attribution import atp_effects
from discovery.measure.refine import RefineSettings, refine_channels
from discovery.model.adapter import adapter_for
from discovery.model.bundled import bundled_model_path
from discovery.model.loading import load_model
from pipelines import pipeline
from pipelines.options import ScanOptions
from pipelines.sweep import task_batch

ROOT = Path(__file__).resolve().parents[1]


def recall(found: set[tuple[int, int]], truth: dict) -> str:
    """``k of n``: how many of the truth's important channels are among ``found``."""
    top = [(r["layer"], r["channel"]) for r in truth["important"]]
    return f"{sum(c in found for c in top)} of {len(top)}"


def main() -> None:
    lm = load_model("bundled:mc-mamba1")
    options = ScanOptions(task_options=pipeline.task_options(lm.files, ["mc"], {}), prompts=64, seed=0)
    batch = task_batch(lm, "mc", options.options_for("mc"))
    truths = {"scan prompts": json.loads((ROOT / "tests/data/mc_mamba1_scan_channel_truth.json").read_text()),
              "truth prompts": json.loads((bundled_model_path("mc-mamba1") / "truth_channels.json").read_text())}
    engine = AblationEngine(lm, batch)
    clean = float(engine.clean.logit_diff.mean())
    heads = lm.inventory.heads()
    effects = engine.effects(single_head_ablations(heads, "zero", ("all",)))
    drops = (-effects.logit_diff.mean(1)).tolist()

    started = time.time()
    view = replace(lm, adapter=adapter_for(lm.model, 1))  # every channel its own head
    channels = [h for g in view.inventory.groups for h in g.heads()]
    atp = atp_effects(view, batch, heads=channels, method="zero", scope=("all",), metric="logit_diff")
    estimate = -atp.estimate.mean(-1) / clean
    width = lm.inventory.group(0, "ssm").width
    flagged = {(h.layer, h.index // width) for h, e in zip(channels, estimate.tolist()) if e >= 0.1}
    print(f"channel AtP: {atp.forward_equivalents:.2f} fe, {time.time() - started:.1f} s, largest estimate "
          f"{float(estimate.max()):.1%} of clean, {len(flagged)} groups flagged")

    chosen = {"default": [i for i, d in enumerate(drops) if d >= 0.1 * clean],
              "starts at 5%": [i for i, d in enumerate(drops) if d >= 0.05 * clean]}
    chosen["channel AtP"] = sorted(set(chosen["default"]) | {i for i, h in enumerate(heads)
                                                             if (h.layer, h.index) in flagged})
    for name, rows in chosen.items():
        effect = 0.05 if name == "starts at 5%" else 0.1
        starts = Scores(*(effects[m][rows] for m in METRICS))
        started = time.time()
        ref = refine_channels(engine, [heads[i] for i in rows], starts, RefineSettings(effect=effect))
        found = {(n.layer, c) for n in (ref.nodes[i] for i in ref.leaf_nodes) for c in range(n.start, n.end)}
        print(f"{name}: {sum(1 for n in ref.nodes if n.level == 0)} groups, {ref.ablations} ablations, "
              f"{ref.forward_equivalents:.1f} fe, {time.time() - started:.1f} s, {len(ref.leaf_nodes)} leaves; recall "
              + ", ".join(f"{k} {recall(found, t)}" for k, t in truths.items()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
