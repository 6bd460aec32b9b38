"""The example pattern: the attention (or implicit SSM attention) of the top gather and aggregate heads on
one prompt, computed with the model and kept in ``patterns.npz`` (numbers and strings only; read back with
``allow_pickle=False``) so a rebuild without the model can draw it again.

Without ``lm`` the saved file is used, or the model is loaded from ``summary["spec"]`` when that is cheap
(a ``tiny:`` model or weights under :data:`CHEAP_MODEL_BYTES`); otherwise the figure is skipped with a note.
"""
from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from discovery.artifacts import PATTERNS_FILE, Scan, restore_refined
from discovery.errors import GascanError
from discovery.report.common import head_name

CHEAP_MODEL_BYTES = 64 * 2**20


def top_heads(frame: pl.DataFrame, role: str, k: int = 1) -> list[tuple[int, int, str]]:
    """The k best heads of a role: by classifier probability, else by pattern × effect evidence."""
    from discovery.rank.classifier import head_features

    if frame.height == 0:
        return []
    column = {"gather": "p_gather", "aggregate": "p_aggregate"}[role]
    if column in frame.columns and frame[column].drop_nulls().len():
        score = frame[column].fill_null(-1.0).to_numpy()
    else:
        feats = head_features(frame)
        key = "gather_x_effect" if role == "gather" else "agg_x_effect"
        score = feats[key].fill_null(-1.0).to_numpy()
    order = np.argsort(-score, kind="stable")[:k]
    rows = frame.select("layer", "head", "kind").rows()
    return [rows[i] for i in order]


def compute_example(lm: Any, summary: Mapping[str, Any], task: str, heads: Sequence[tuple[int, int, str, str]],
                    index: int = 0) -> dict[str, Any]:
    """Patterns of ``heads`` (layer, head, kind, role) on prompt ``index`` of ``task`` as the scan built it."""
    from discovery.measure.patterns import collect_patterns
    from discovery.tasks import build_task
    from discovery.tasks.base import annotate

    options = dict(((summary.get("tasks") or {}).get(task) or {}).get("options") or {})
    prompts = build_task(task, options).prompts()
    prompt = prompts[min(index, len(prompts) - 1)]
    max_len = getattr(lm.model.config, "max_position_embeddings", None)
    batch = annotate([prompt], lm.tokenizer, padding_side="left", max_length=max_len)
    layers = sorted({h[0] for h in heads})
    kinds = sorted({h[2] for h in heads})
    pats = collect_patterns(lm, batch, layers=layers, kinds=kinds)  # {(layer, kind): [1, head, q, k]}
    real = batch.attention_mask[0].bool()
    offset = int((~real).sum())  # left padding
    ids = batch.input_ids[0][real].tolist()
    tokens = [lm.tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids]
    shown = []
    for layer, head, kind, _role in heads:
        p = pats[(layer, kind)][0, head].float()[offset:, offset:]  # [q, k] over real tokens
        shown.append(p.abs().numpy() if kind == "ssm" else p.numpy())
    n_seg = int(batch.seg_mask[0].sum())
    gold = int(batch.gold_segment[0]) if batch.gold_segment is not None else -1
    return {
        "task": task, "prompt_index": index, "tokens": tokens,
        "patterns": np.stack(shown).astype(np.float32),
        "layers": np.array([h[0] for h in heads]), "heads": np.array([h[1] for h in heads]),
        "kinds": [h[2] for h in heads], "roles": [h[3] for h in heads],
        "names": [head_name(h[0], h[1], h[2]) for h in heads],
        "summary_pos": (batch.summary_pos[0][:n_seg] - offset).tolist(),
        "query_pos": int(batch.query_pos[0]) - offset, "gold_segment": gold if gold < n_seg else -1,
    }


def save_example(path: Path, example: Mapping[str, Any]) -> Path:
    """Write the example as .npz of plain arrays (strings as unicode arrays: no pickle needed to read)."""
    from discovery.io import write_bytes

    arrays = {
        "task": np.array(str(example["task"])), "prompt_index": np.array(int(example["prompt_index"])),
        "tokens": np.array([str(t) for t in example["tokens"]], dtype=np.str_),
        "patterns": np.asarray(example["patterns"], dtype=np.float32),
        "layers": np.asarray(example["layers"], dtype=np.int64), "heads": np.asarray(example["heads"], dtype=np.int64),
        "kinds": np.array(list(example["kinds"]), dtype=np.str_), "roles": np.array(list(example["roles"]), dtype=np.str_),
        "names": np.array(list(example["names"]), dtype=np.str_),
        "summary_pos": np.asarray(example["summary_pos"], dtype=np.int64),
        "query_pos": np.array(int(example["query_pos"])), "gold_segment": np.array(int(example["gold_segment"])),
    }
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return write_bytes(path, buf.getvalue())


def load_example(path: Path) -> dict[str, Any]:
    with np.load(path, allow_pickle=False) as data:
        out: dict[str, Any] = {k: data[k] for k in data.files}
    for key in ("task",):
        out[key] = str(out[key])
    for key in ("tokens", "kinds", "roles", "names"):
        out[key] = [str(x) for x in out[key].tolist()]
    out["prompt_index"] = int(out["prompt_index"])
    out["query_pos"] = int(out["query_pos"])
    out["gold_segment"] = int(out["gold_segment"])
    return out


def _cheap_spec(spec: str | None) -> bool:
    """Whether loading ``spec`` again is cheap enough to do just for a figure."""
    if not spec:
        return False
    if spec.startswith("tiny:"):
        return True
    p = Path(spec)
    files = [p] if p.is_file() else (list(p.glob("*.safetensors")) + list(p.glob("*.gguf")) if p.is_dir() else [])
    return bool(files) and sum(f.stat().st_size for f in files) <= CHEAP_MODEL_BYTES


def example_for_report(scan: Scan, heads: pl.DataFrame, lm: Any = None) -> tuple[dict[str, Any] | None, str]:
    """The example pattern (computed with ``lm``, read from patterns.npz, or loaded cheaply) and a note."""
    path = scan.dir / PATTERNS_FILE
    task = scan.tasks[0] if scan.tasks else None
    if task is None:
        return None, "no task in this scan"
    frame = heads.filter(pl.col("task") == task)
    chosen = [(*h, "gather") for h in top_heads(frame, "gather")] + [(*h, "aggregate") for h in top_heads(frame, "aggregate")]
    if lm is None and path.is_file():
        try:
            return load_example(path), ""
        except (OSError, ValueError, KeyError) as err:  # an unreadable file is not fatal for the report
            note = f"could not read {PATTERNS_FILE} ({err.__class__.__name__})"
            if not _cheap_spec(scan.summary.get("spec")):
                return None, note
    if lm is None:
        spec = scan.summary.get("spec")
        if not _cheap_spec(spec):
            return None, ("the example attention pattern needs the model; rebuild with the model loaded "
                          "(`gascan scan` draws it) to include it")
        from discovery.model.loading import load_model

        try:
            lm = load_model(spec)
        except GascanError as err:
            return None, f"could not load {spec} for the example pattern ({err.problem})"
    if not chosen:
        return None, "no heads to show"
    try:
        restore_refined(lm.inventory, heads)  # refined Mamba-1 channel heads, as the sweep numbered them
    except GascanError as err:
        return None, f"the example pattern cannot show this scan's heads ({err.problem})"
    example = compute_example(lm, scan.summary, task, chosen)
    save_example(path, example)
    return example, ""
