"""The per-model report: ``report.md`` and a self-contained ``report.html`` rebuilt from a scan's tables.

``write_report(DIR)`` reads ``DIR/heads.parquet`` and ``DIR/summary.json`` (plus ``pairs.parquet`` and
``patterns.npz`` when present) and writes, atomically:

- clean scores per task, the verdict, the top pairs with their evidence, the heads with the largest
  effects, G&A head lists with classifier probabilities, heads whose pattern is not backed by an
  effect (possible decoys), published G&A heads when the model is one of the paper's, placement advice;
- figures (matplotlib, Agg), as ``DIR/figures/*.png`` and embedded in the HTML as base64: layer × head
  heatmaps of the main metrics and effects (attention and SSM heads separately), the G&A depth
  profile, and the attention pattern of the top gather and aggregate heads on an example prompt.

Every string that came from a model, tokenizer, dataset or task is passed through :func:`html.escape`
before it enters the HTML (and the Markdown, whose viewers may render inline HTML).

The example pattern needs the model: ``write_report(DIR, lm)`` computes it and saves ``patterns.npz``
(numbers and strings only; read back with ``allow_pickle=False``); without ``lm`` the saved file is used,
or the model is loaded from ``summary["spec"]`` when that is cheap (a ``tiny:`` model or weights under
:data:`CHEAP_MODEL_BYTES`); otherwise the figure is skipped with a note.
"""
from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from discovery.artifacts import PATTERNS_FILE, Scan, read_scan, with_evidence
from discovery.errors import GascanError

CHEAP_MODEL_BYTES = 64 * 2**20
MAX_PATTERN_KEYS = 160  # longer example prompts show their last keys only

# (column, label, colour scale): "seq" 0..1, "div" symmetric around 0, "prob" 0..1
HEATMAP_METRICS: tuple[tuple[str, str, str], ...] = (
    ("gather_score", "gather score", "seq"),
    ("agg_focus", "aggregate focus", "seq"),
    ("agg_select", "aggregate select", "seq"),
    ("selectivity", "selectivity", "seq"),
    ("dla", "direct logit attribution", "div"),
    ("d_ld_all", "Δ logit diff (all positions)", "div"),
    ("d_ld_query", "Δ logit diff (query only)", "div"),
    ("atp_ld", "AtP estimate of Δ logit diff", "div"),
    ("p_gather", "P(gather)", "prob"),
    ("p_aggregate", "P(aggregate)", "prob"),
)


def esc(value: Any) -> str:
    """HTML-escape anything that may have come from a model, tokenizer, dataset or user."""
    return html.escape(str(value), quote=True)


def md_esc(value: Any) -> str:
    """Escape for Markdown text: no raw HTML tags (``<`` and ``>`` become entities)."""
    return str(value).replace("<", "&lt;").replace(">", "&gt;")


def md_cell(value: Any) -> str:
    """Escape for a Markdown table cell: as :func:`md_esc`, plus pipes and line breaks."""
    return md_esc(value).replace("|", "\\|").replace("\n", " ")


def head_name(layer: int, head: int, kind: str) -> str:
    return f"L{layer}{'H' if kind == 'attn' else 'S'}{head}"


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(v):
        return "–"
    return f"{v:.{digits}f}"


# ---------------------------------------------------------------------------------------------
# reading a scan
# ---------------------------------------------------------------------------------------------


def scored_heads(scan: Scan) -> pl.DataFrame:
    """The head table with the evidence stage's columns and ``p_gather``/``p_aggregate`` (from the table,
    else the shipped classifier)."""
    heads = with_evidence(scan.heads, scan.evidence)
    if "p_gather" in heads.columns and "p_aggregate" in heads.columns:
        return heads
    try:
        from discovery.rank.classifier import score_heads

        return score_heads(heads, scan.summary)
    except GascanError:  # no classifier artifact in this install: report without probabilities
        return heads


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------


@dataclass
class Figure:
    name: str  # file stem under figures/
    title: str
    png: bytes
    caption: str = ""


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _matrix(frame: pl.DataFrame, column: str, n_layers: int) -> np.ndarray:
    """``[layer, head]`` values of one column (NaN where absent)."""
    n_heads = int(frame["head"].max()) + 1 if frame.height else 1
    out = np.full((n_layers, n_heads), np.nan)
    if column not in frame.columns:
        return out
    for layer, head, value in frame.select("layer", "head", column).iter_rows():
        if value is not None and 0 <= layer < n_layers:
            out[layer, head] = float(value)
    return out


def heatmap_figure(frame: pl.DataFrame, n_layers: int, title: str,
                   marks: Sequence[tuple[int, int, str]] = ()) -> bytes | None:
    """One panel per metric of :data:`HEATMAP_METRICS` present in ``frame`` (one task, one head kind)."""
    metrics = [(c, label, scale) for c, label, scale in HEATMAP_METRICS
               if c in frame.columns and frame[c].drop_nulls().len() > 0]
    if not metrics or frame.height == 0:
        return None
    plt = _plt()
    from matplotlib import patheffects

    n_heads = int(frame["head"].max()) + 1
    cols = min(4, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    width = min(4.2, 1.2 + 0.25 * n_heads)
    height = min(4.5, 1.0 + 0.22 * n_layers)
    with plt.rc_context({"text.parse_math": False}):
        fig, axes = plt.subplots(rows, cols, figsize=(cols * width, rows * height), squeeze=False)
        for ax in axes.flat[len(metrics):]:
            ax.axis("off")
        for ax, (column, label, scale) in zip(axes.flat, metrics):
            m = _matrix(frame, column, n_layers)
            if scale == "div":
                v = float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 1.0
                v = v or 1.0
                im = ax.imshow(np.ma.masked_invalid(m), cmap="RdBu", vmin=-v, vmax=v, aspect="auto",
                               interpolation="nearest")
            else:
                cmap = "viridis" if scale == "seq" else "magma"
                lo = min(0.0, float(np.nanmin(m))) if np.isfinite(m).any() else 0.0
                im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, vmin=lo, vmax=1.0, aspect="auto",
                               interpolation="nearest")
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("head", fontsize=8)
            ax.set_ylabel("layer", fontsize=8)
            ax.tick_params(labelsize=7)
            for layer, head, text in marks:
                ax.text(head, layer, text, ha="center", va="center", color="black", fontsize=8, fontweight="bold",
                        path_effects=[patheffects.withStroke(linewidth=2, foreground="white")])
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        return _png(fig)


def depth_profile_figure(frame: pl.DataFrame, n_layers: int, title: str) -> bytes | None:
    """Per layer: the strongest gather and aggregate evidence (probabilities, and pattern × effect)."""
    from discovery.rank.classifier import head_features

    if frame.height == 0:
        return None
    feats = head_features(frame).select("gather_x_effect", "agg_x_effect")
    f = pl.concat([frame.select("layer"), feats], how="horizontal")
    cols = [c for c in ("p_gather", "p_aggregate") if c in frame.columns]
    if cols:
        f = pl.concat([f, frame.select(cols)], how="horizontal")
    per_layer = f.group_by("layer").agg(pl.all().max()).sort("layer")
    layers = per_layer["layer"].to_numpy()
    plt = _plt()
    panels = 2 if cols else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.2), squeeze=False)
    ax = axes[0, 0]
    ax.plot(layers, per_layer["gather_x_effect"].fill_null(np.nan).to_numpy(), "o-", label="gather: score × effect")
    ax.plot(layers, per_layer["agg_x_effect"].fill_null(np.nan).to_numpy(), "s-",
            label="aggregate: select × query effect")
    ax.set_xlabel("layer")
    ax.set_ylabel("max over heads")
    ax.set_title("pattern × causal effect (relative to clean)", fontsize=9)
    ax.set_xlim(-0.5, n_layers - 0.5)
    ax.legend(fontsize=7)
    if cols:
        ax = axes[0, 1]
        if "p_gather" in cols:
            ax.plot(layers, per_layer["p_gather"].fill_null(np.nan).to_numpy(), "o-", label="max P(gather)")
        if "p_aggregate" in cols:
            ax.plot(layers, per_layer["p_aggregate"].fill_null(np.nan).to_numpy(), "s-", label="max P(aggregate)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("layer")
        ax.set_title("classifier", fontsize=9)
        ax.set_xlim(-0.5, n_layers - 0.5)
        ax.legend(fontsize=7)
    with plt.rc_context({"text.parse_math": False}):
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
    return _png(fig)


def _show_token(tok: str) -> str:
    """A token as a tick label: newlines and tabs visible, a leading space as '·'."""
    shown = tok.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if shown.startswith(" "):
        shown = "·" + shown[1:]
    return shown or "∅"


def pattern_figure(example: Mapping[str, Any]) -> bytes | None:
    """Rows: every summary token and the query; columns: the prompt's keys, labelled with their tokens."""
    tokens = [str(t) for t in example["tokens"]]
    patterns = np.asarray(example["patterns"])  # [shown head, q, k]
    if patterns.size == 0 or not tokens:
        return None
    summary_pos = [int(p) for p in example["summary_pos"]]
    query = int(example["query_pos"])
    gold = int(example["gold_segment"]) if int(example["gold_segment"]) >= 0 else None
    rows = summary_pos + [query]
    row_labels = [f"{_show_token(tokens[p])} @{p} (seg {i}{' gold' if i == gold else ''})"
                  for i, p in enumerate(summary_pos)] + [f"{_show_token(tokens[query])} @{query} (query)"]
    start = max(0, len(tokens) - MAX_PATTERN_KEYS)
    keys = list(range(start, len(tokens)))
    plt = _plt()
    n = patterns.shape[0]
    width = min(22.0, 2.5 + 0.13 * len(keys))
    with plt.rc_context({"text.parse_math": False}):
        fig, axes = plt.subplots(n, 1, figsize=(width, n * (1.2 + 0.28 * len(rows))), squeeze=False)
        for i in range(n):
            ax = axes[i, 0]
            m = patterns[i][np.ix_(rows, keys)]
            im = ax.imshow(m, cmap="viridis", aspect="auto", interpolation="nearest",
                           vmin=0.0, vmax=max(1e-9, float(np.abs(m).max())))
            ax.set_yticks(range(len(rows)), row_labels, fontsize=7)
            ax.set_xticks(range(len(keys)), [_show_token(tokens[k]) for k in keys], rotation=90, fontsize=6)
            role, name = str(example["roles"][i]), str(example["names"][i])
            ax.set_title(f"{role} head {name}: attention from summary tokens and the query", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01).ax.tick_params(labelsize=6)
        fig.tight_layout()
        return _png(fig)


# ---------------------------------------------------------------------------------------------
# the example pattern
# ---------------------------------------------------------------------------------------------


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
    example = compute_example(lm, scan.summary, task, chosen)
    save_example(path, example)
    return example, ""


# ---------------------------------------------------------------------------------------------
# report content
# ---------------------------------------------------------------------------------------------


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]]  # cells: str (escaped on output) or numbers


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)  # plain text, escaped on output
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    preformatted: list[str] = field(default_factory=list)


def _ci(row: Mapping[str, Any], column: str) -> str:
    v, lo, hi = row.get(column), row.get(f"{column}_lo"), row.get(f"{column}_hi")
    if v is None:
        return "–"
    return f"{fmt(v)} [{fmt(lo)}, {fmt(hi)}]" if lo is not None and hi is not None else fmt(v)


def verdict_text(scan: Scan) -> str:
    """The model's verdict: issue-8 verdict if the scan wrote one, else from the verified pairs."""
    evidence = scan.summary.get("evidence")
    if isinstance(evidence, Mapping) and evidence:
        parts = []
        for task, info in evidence.items():
            if isinstance(info, Mapping) and info.get("verdict"):
                label = VERDICT_WORDS.get(str(info["verdict"]), str(info["verdict"]))
                parts.append(f"{task}: {label}" + (f" — {info['reason']}" if info.get("reason") else ""))
        if parts:
            return " ".join(parts)
    return pair_verdict(scan)


VERDICT_WORDS = {"clean": "clean G&A pair(s) found", "distributed": "G&A distributed over several heads",
                 "none": "no G&A"}


def pair_verdict(scan: Scan) -> str:
    """What the pair ranking concluded (a confident pair, a verified pair of non-G&A heads, or neither)."""
    from discovery.rank.pairs import is_confident

    pairs = scan.summary.get("top_pairs") or []
    if not pairs:
        return "No ranked G&A pairs in this scan (pair ranking did not run)."
    best = pairs[0]
    name = lambda h: head_name(h["layer"], h["head"], h["kind"])
    confident = [p for p in pairs if is_confident(p)]
    if confident:
        v = confident[0]
        return (f"G&A pair found: gather {name(v['gather'])} → aggregate {name(v['aggregate'])} "
                f"(joint ablation {fmt(v.get('joint_effect'))} vs random same-layer pairs "
                f"{fmt(v.get('control_effect'))}).")
    verified = [p for p in pairs if p.get("verified")]
    if verified:
        v = verified[0]
        return (f"No confident G&A pair: {name(v['gather'])} → {name(v['aggregate'])} hurts more under joint "
                f"ablation than random same-layer pairs ({fmt(v.get('joint_effect'))} vs "
                f"{fmt(v.get('control_effect'))}), but its heads do not look like G&A heads (P(gather) "
                f"{fmt(v.get('p_gather'))}, P(aggregate) {fmt(v.get('p_aggregate'))}; evidence roles "
                f"{v.get('gather_role') or '–'}, {v.get('aggregate_role') or '–'}): important heads, not a G&A pair.")
    if best.get("verified") is None and best.get("joint_effect") is not None:
        return (f"Unverified G&A candidate: {name(best['gather'])} → {name(best['aggregate'])} (score "
                f"{fmt(best.get('score'))}, joint ablation {fmt(best.get('joint_effect'))}); its layers hold too few "
                "other heads for a random same-layer control.")
    return (f"No confident G&A pair: the best candidate {name(best['gather'])} → {name(best['aggregate'])} "
            f"(score {fmt(best.get('score'))}) did not beat random same-layer pairs under joint ablation.")


def _clean_section(scan: Scan) -> Section:
    rows = []
    for task in scan.tasks:
        info = (scan.summary.get("tasks") or {}).get(task) or {}
        c = info.get("clean") or {}
        rows.append([task, info.get("n_prompts"), c.get("acc"), c.get("logit_diff"), c.get("gold_logprob"),
                     info.get("seconds")])
    return Section("Clean scores", tables=[Table(["task", "prompts", "accuracy", "logit diff", "gold log-prob",
                                                  "seconds"], rows)])


def _top_heads_section(scan: Scan, heads: pl.DataFrame, k: int = 10) -> Section:
    sec = Section("Heads with the largest effects",
                  [("Zero ablation of one head; Δ = ablated − clean, mean over prompts with a 95% bootstrap "
                    "interval. Negative = the head helps the task.")])
    for task in scan.tasks:
        screen = ((scan.summary.get("tasks") or {}).get(task) or {}).get("attribution") or {}
        agreement = screen.get("agreement")
        if agreement:
            sec.paragraphs.append(
                f"{task}: the attribution screen (AtP with the QK fix, {fmt(screen.get('forward_equivalents'))} "
                f"forward-equivalents for every head) ranks heads like the exact sweep with Spearman "
                f"{fmt(agreement.get('spearman'))} (on |effect| {fmt(agreement.get('spearman_abs'))}); "
                f"recall@{agreement.get('k')} {fmt(agreement.get('recall_at_k'))}.")
        frame = heads.filter(pl.col("task") == task)
        column = next((c for c in ("d_ld_all", "d_ld_query", "atp_ld") if c in frame.columns
                       and frame[c].drop_nulls().len()), None)
        if column is None:
            sec.paragraphs.append(f"{task}: no ablation effects in this scan.")
            continue
        best = frame.filter(pl.col(column).is_not_null()).sort(column).head(k)
        rows = []
        for r in best.iter_rows(named=True):
            rows.append([task, head_name(r["layer"], r["head"], r["kind"]), _ci(r, "d_ld_all"), _ci(r, "d_ld_query"),
                         r.get("atp_ld"), r.get("gather_score"), r.get("agg_select"), r.get("selectivity"),
                         r.get("p_gather"), r.get("p_aggregate"), r.get("role", "")])
        sec.tables.append(Table(["task", "head", "Δ logit diff (all)", "Δ logit diff (query)", "AtP",
                                 "gather score", "agg select", "selectivity", "P(gather)", "P(aggregate)", "role"],
                                rows))
    return sec


def _roles_section(scan: Scan, heads: pl.DataFrame) -> Section:
    sec = Section("Gather and aggregate heads")
    listed = {r: scan.summary.get(f"{r}_heads") for r in ("gather", "aggregate")}
    for role in ("gather", "aggregate"):
        items = listed[role]
        if items is None and f"p_{role}" in heads.columns:
            part = heads.filter(pl.col(f"p_{role}") >= 0.5).sort(f"p_{role}", descending=True).head(20)
            items = [{"layer": r["layer"], "head": r["head"], "kind": r["kind"], "p": r[f"p_{role}"],
                      "task": r["task"]} for r in part.iter_rows(named=True)]
        if items is None:
            sec.paragraphs.append(f"{role}: no classifier probabilities in this scan.")
            continue
        if not items:
            sec.paragraphs.append(f"{role}: no head reaches P ≥ 0.5.")
            continue
        sec.tables.append(Table([f"{role} head", "task", "P"],
                                [[head_name(i["layer"], i["head"], i["kind"]), i.get("task", ""), i.get("p")]
                                 for i in items]))
    return sec


def _pairs_section(scan: Scan) -> Section:
    sec = Section("Top G&A pairs", [pair_verdict(scan)])
    pairs = scan.pairs
    if pairs is None or pairs.height == 0:
        sec.paragraphs.append("No pairs.parquet in this scan.")
        return sec
    sec.paragraphs.append(
        "Score: classifier probabilities and the interaction test (ablating the gather head changes the "
        "aggregate head's selection, or holding the aggregate head at its clean output gives back the gather "
        "head's cost: the mediated share). Rank: every gather head's best pair by score before any gather "
        "head's second, so the verified top pairs test different gather heads rather than one gather head "
        "with each member of a redundant aggregate set. Joint effect: Δ logit diff when both heads are "
        "ablated, with its 95% bootstrap interval; control: the same for random head pairs from the same two "
        "layers (mean and 5–95% range); verified when the joint effect lies below the control's 5th percentile.")
    rows = []
    for r in pairs.sort("rank").head(10).iter_rows(named=True):
        rows.append([
            r.get("rank"), r.get("task", ""),
            head_name(r["gather_layer"], r["gather_head"], r["gather_kind"]),
            head_name(r["aggregate_layer"], r["aggregate_head"], r["aggregate_kind"]),
            r.get("score"), r.get("p_gather"), r.get("p_aggregate"), r.get("select_drop"), r.get("mediated"),
            _ci(r, "joint_effect") if r.get("joint_effect") is not None else "–",
            (f"{fmt(r.get('control_mean'))} [{fmt(r.get('control_q05'))}, {fmt(r.get('control_q95'))}]"
             if r.get("control_mean") is not None else "–"),
            r.get("verified"),
        ])
    sec.tables.append(Table(["rank", "task", "gather", "aggregate", "score", "P(g)", "P(a)", "select drop",
                             "mediated", "joint Δ logit diff", "control Δ", "verified"], rows))
    return sec


def _decoys_section(scan: Scan, heads: pl.DataFrame) -> Section:
    """Heads whose pattern looks like G&A but whose ablation changes (almost) nothing."""
    from discovery.rank.classifier import head_features

    sec = Section("Pattern without effect (possible decoys)")
    if "role" in heads.columns:
        part = heads.filter(pl.col("role") == "decoy")
        sec.paragraphs.append("Heads the evidence stage labelled `decoy`.")
    else:
        feats = head_features(heads)
        strong = pl.max_horizontal(
            *(pl.col(c).fill_null(0.0) for c in ("agg_select", "selectivity") if c in heads.columns),
            *((pl.col("gather_score").fill_null(0.0) - 0.2,) if "gather_score" in heads.columns else ()),
        ) if heads.height else pl.lit(0.0)
        weak = pl.max_horizontal(pl.Series(feats["drop_all"]).abs().fill_null(0.0),
                                 pl.Series(feats["drop_query"]).abs().fill_null(0.0)) < 0.1
        part = heads.with_columns(strong.alias("_strong"), weak.alias("_weak")).filter(
            (pl.col("_strong") >= 0.6) & pl.col("_weak"))
        sec.paragraphs.append("Heads with agg select or selectivity ≥ 0.6, or gather score ≥ 0.8, whose single-head ablation "
                              "moves the logit difference by less than 10% of the clean value. A pattern alone "
                              "is not evidence (DESIGN.md); these may also be redundant copies, which only a "
                              "group ablation can tell.")
    if part.height == 0:
        sec.paragraphs.append("None.")
        return sec
    rows = [[r["task"], head_name(r["layer"], r["head"], r["kind"]), r.get("gather_score"), r.get("agg_select"),
             r.get("selectivity"), _ci(r, "d_ld_all"), _ci(r, "d_ld_query")] for r in part.head(20).iter_rows(named=True)]
    sec.tables.append(Table(["task", "head", "gather score", "agg select", "selectivity", "Δ logit diff (all)",
                             "Δ logit diff (query)"], rows))
    return sec


def _rank_in(frame: pl.DataFrame, column: str, value: float | None) -> int | None:
    """1 + how many rows of ``frame`` score above ``value`` in ``column``."""
    if value is None or column not in frame.columns:
        return None
    return int((frame[column] > value).sum()) + 1


def _evidence_section(scan: Scan, heads: pl.DataFrame) -> Section | None:
    """Roles with their evidence and the group ablations, from the evidence stage (discovery.evidence)."""
    if "role" not in heads.columns and scan.evidence_groups is None:
        return None
    sec = Section("Roles by the evidence standards",
                  [("A head is gather or aggregate only when its pattern and its causal effect at the right "
                    "positions agree; decoy = G&A-like pattern and no effect at any scope, minimal model included "
                    "(thresholds in summary.json, evidence.*.thresholds).")])
    if "role" in heads.columns:
        part = heads.filter(pl.col("role").is_not_null() & (pl.col("role") != "none"))
        order = {"gather": 0, "aggregate": 1, "other_important": 2, "decoy": 3}
        part = part.with_columns(pl.col("role").replace_strict(order, default=9).alias("_o")).sort("_o", "layer", "head")
        rows = [[r["task"], head_name(r["layer"], r["head"], r["kind"]), r["role"], r.get("where") or "",
                 r.get("evidence") or ""] for r in part.head(40).iter_rows(named=True)]
        if rows:
            sec.tables.append(Table(["task", "head", "role", "where the effect lives", "evidence"], rows))
        else:
            sec.paragraphs.append("No head has a role beyond none.")
    minimal = []
    for task, info in (scan.summary.get("evidence") or {}).items():
        mm = (info or {}).get("minimal_model") or {}
        if mm.get("depth") is not None:
            minimal.append(f"{task}: the minimal model keeps {mm['depth']} of {mm.get('n_layers')} layers.")
    sec.paragraphs += minimal
    groups = scan.evidence_groups
    if groups is not None and groups.height:
        rows = []
        for r in groups.iter_rows(named=True):
            control = (f"{fmt(r.get('control_mean'))} [{fmt(r.get('control_p05'))}, {fmt(r.get('control_p95'))}]"
                       if r.get("control_mean") is not None else "–")
            rows.append([r.get("task", ""), r.get("group"), r.get("scope"), r.get("n"), _ci(
                {"e": r.get("effect"), "e_lo": r.get("effect_lo"), "e_hi": r.get("effect_hi")}, "e"),
                control, r.get("significant"), ", ".join(r.get("credited") or [])])
        sec.tables.append(Table(["task", "group", "scope", "heads", "joint Δ logit diff", "control Δ (5–95%)",
                                 "significant", "credited"], rows))
    return sec


def minimal_depth_figure(scan: Scan) -> bytes | None:
    """Task score of the model truncated after each layer (the evidence stage's depth profile)."""
    depth = scan.evidence_depth
    if depth is None or depth.height == 0:
        return None
    plt = _plt()
    with plt.rc_context({"text.parse_math": False}):
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        groups = depth.partition_by("task", as_dict=True, maintain_order=True) if "task" in depth.columns \
            else {("",): depth}
        for (task,), part in groups.items():
            part = part.sort("depth")
            ax.plot(part["depth"].to_numpy(), part["acc"].to_numpy(), "o-", label=f"{task} accuracy")
            mm = (((scan.summary.get("evidence") or {}).get(task) or {}).get("minimal_model") or {}).get("depth")
            if mm is not None:
                ax.axvline(mm, color="0.5", linestyle="--", linewidth=1)
        if "chance" in depth.columns:
            ax.axhline(float(depth["chance"][0]), color="0.7", linewidth=1, label="chance")
        ax.set_xlabel("layers kept (read out through the final norm)")
        ax.set_ylabel("accuracy")
        ax.set_title("minimal model: score of the truncated model (dashed: minimal depth)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return _png(fig)


def _published_section(scan: Scan, heads: pl.DataFrame) -> Section | None:
    """Where the paper's G&A heads rank in this scan, when this model is one of the paper's."""
    from discovery.rank.classifier import label_rows, published_labels

    try:
        labels = published_labels()
    except (OSError, ValueError, KeyError):  # a broken install: report without this section
        return None
    labelled = label_rows(heads, labels)
    known = labelled.filter(pl.col("role_label").is_in(["gather", "aggregate"])) if labelled.height else labelled
    if known.height == 0:
        return None
    sec = Section("Published G&A heads (Bick et al. 2025)",
                  ["This model matches a checkpoint with published G&A heads; where they rank here:"])
    rows = []
    for r in known.iter_rows(named=True):
        task_rows = heads.filter(pl.col("task") == r["task"])
        column = f"p_{r['role_label']}"
        rows.append([r["task"], r["role_label"], head_name(r["layer"], r["head"], r["kind"]),
                     r.get(column), _rank_in(task_rows, column, r.get(column)),
                     _ci(r, "d_ld_all")])
    sec.tables.append(Table(["task", "role", "head", "P(role)", "rank by P", "Δ logit diff (all)"], rows))
    return sec


def _placement_section(scan: Scan, heads: pl.DataFrame) -> Section:
    from discovery.rank.placement import default_budget, place

    sec = Section("Where attention belongs (placement advice)")
    for unit in ("layer", "head"):
        budget = default_budget(scan.summary, unit)
        choices = place(heads, scan.summary, scan.pairs, budget=budget, unit=unit)
        if not choices:
            sec.paragraphs.append(f"No {unit}-level advice: the scan has no effects or probabilities to rank by.")
            continue
        sec.tables.append(Table([f"{unit} (budget {budget})", "action", "score", "why"],
                                [[c.name, c.action, c.score, c.why] for c in choices]))
    sec.paragraphs.append("`gascan place DIR --budget K --unit head|layer` gives other budgets.")
    return sec


def build_sections(scan: Scan, lm: Any = None) -> tuple[list[Section], list[Figure]]:
    """Every section of the report and every figure (figures also appear inside their sections)."""
    heads = scored_heads(scan)
    n_layers = int(scan.summary.get("n_layers") or (int(heads["layer"].max()) + 1 if heads.height else 1))
    sections = [_clean_section(scan), _pairs_section(scan), _roles_section(scan, heads),
                _top_heads_section(scan, heads), _decoys_section(scan, heads)]
    evidence = _evidence_section(scan, heads)
    if evidence:
        sections.insert(2, evidence)
    published = _published_section(scan, heads)
    if published:
        sections.append(published)
    figures: list[Figure] = []
    png = minimal_depth_figure(scan)
    profile = Section("G&A depth profile",
                      [("Per layer, the strongest gather evidence (gather score × all-position effect) and "
                        "aggregate evidence (agg select × query-position effect), effects relative to the clean "
                        "logit difference; and the largest classifier probabilities.")])
    if png:
        fig = Figure("minimal_model", "Minimal model: accuracy of the truncated model", png)
        profile.figures.append(fig)
        figures.append(fig)
    maps = Section("Layer × head maps", [("Red = ablating the head lowers the logit difference (blue: raises it). "
                                          "G / A mark the top gather and aggregate heads.")])
    for t, task in enumerate(scan.tasks):
        frame = heads.filter(pl.col("task") == task)
        png = depth_profile_figure(frame, n_layers, f"{task}")
        if png:
            fig = Figure(f"depth_profile_{t}", f"G&A depth profile: {task}", png)
            profile.figures.append(fig)
            figures.append(fig)
        marks = [(h[0], h[1], h[2], "G") for h in top_heads(frame, "gather")] + \
                [(h[0], h[1], h[2], "A") for h in top_heads(frame, "aggregate")]
        for kind in ("attn", "ssm"):
            part = frame.filter(pl.col("kind") == kind)
            if part.height == 0:
                continue
            km = [(layer, head, text) for layer, head, k, text in marks if k == kind]
            title = f"{task}: {'attention' if kind == 'attn' else 'SSM'} heads"
            png = heatmap_figure(part, n_layers, title, km)
            if png:
                fig = Figure(f"heatmap_{t}_{kind}", title, png)
                maps.figures.append(fig)
                figures.append(fig)
    sections += [profile, maps]
    pattern = Section("Example attention patterns")
    example, note = example_for_report(scan, heads, lm)
    if example is not None:
        png = pattern_figure(example)
        if png:
            fig = Figure("example_patterns", "Top gather and aggregate heads on an example prompt", png)
            pattern.figures.append(fig)
            figures.append(fig)
        pattern.paragraphs.append(f"Task {example['task']}, prompt {example['prompt_index']}; heads "
                                  + ", ".join(f"{r} {n}" for r, n in zip(example["roles"], example["names"]))
                                  + ". Tokens of the prompt:")
        pattern.preformatted.append(" | ".join(_show_token(t) for t in example["tokens"]))
    else:
        pattern.paragraphs.append(f"Skipped: {note}.")
    sections.append(pattern)
    sections.append(_placement_section(scan, heads))
    return sections, figures


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else fmt(value)


def _header(scan: Scan) -> list[tuple[str, str]]:
    s = scan.summary
    n_heads = s.get("n_heads") or {}
    return [("model", str(s.get("model", "?"))), ("spec", str(s.get("spec", "?"))),
            ("checkpoint", str(s.get("checkpoint", "?"))), ("architecture", str(s.get("architecture", "?"))),
            ("layers", str(s.get("n_layers", "?"))),
            ("heads", ", ".join(f"{v} {k}" for k, v in n_heads.items() if v) or "?"),
            ("tasks", ", ".join(scan.tasks))]


def render_markdown(scan: Scan, sections: Sequence[Section]) -> str:
    lines = [f"# gascan report: {md_esc(scan.summary.get('model', '?'))}", ""]
    lines += [f"- **{k}**: {md_esc(v)}" for k, v in _header(scan)]
    lines += ["", f"**Verdict.** {md_esc(verdict_text(scan))}", ""]
    for sec in sections:
        lines += [f"## {md_esc(sec.title)}", ""]
        for p in sec.paragraphs:
            lines += [md_esc(p), ""]
        for text in sec.preformatted:
            lines += ["<pre>" + esc(text) + "</pre>", ""]
        for table in sec.tables:
            lines.append("| " + " | ".join(md_cell(c) for c in table.columns) + " |")
            lines.append("|" + "---|" * len(table.columns))
            for row in table.rows:
                lines.append("| " + " | ".join(md_cell(_cell(v)) for v in row) + " |")
            lines.append("")
        for fig in sec.figures:
            lines += [f"![{md_cell(fig.title)}](figures/{fig.name}.png)", ""]
    return "\n".join(lines)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.4}
table{border-collapse:collapse;margin:0.6em 0;font-size:0.85em}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f2f2f2} img{max-width:100%;border:1px solid #eee;margin:0.4em 0}
pre{white-space:pre-wrap;background:#f7f7f7;padding:0.6em;font-size:0.8em}
.verdict{background:#eef6ff;border-left:4px solid #3a7bd5;padding:0.6em}
"""


def render_html(scan: Scan, sections: Sequence[Section]) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           ('<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
            'style-src \'unsafe-inline\'">'),
           f"<title>gascan report: {esc(scan.summary.get('model', '?'))}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>gascan report: {esc(scan.summary.get('model', '?'))}</h1>", "<table>"]
    out += [f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _header(scan)]
    out += ["</table>", f'<p class="verdict"><b>Verdict.</b> {esc(verdict_text(scan))}</p>']
    for sec in sections:
        out.append(f"<h2>{esc(sec.title)}</h2>")
        out += [f"<p>{esc(p)}</p>" for p in sec.paragraphs]
        out += [f"<pre>{esc(t)}</pre>" for t in sec.preformatted]
        for table in sec.tables:
            out.append("<table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in table.columns) + "</tr>")
            for row in table.rows:
                out.append("<tr>" + "".join(f"<td>{esc(_cell(v))}</td>" for v in row) + "</tr>")
            out.append("</table>")
        for fig in sec.figures:
            data = base64.b64encode(fig.png).decode("ascii")
            out.append(f'<figure><img alt="{esc(fig.title)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{esc(fig.title)}</figcaption></figure>")
    out.append("<p><small>Written by gascan from heads.parquet and summary.json; rebuild with "
               "<code>gascan report DIR</code>.</small></p></body></html>")
    return "\n".join(out)


def write_report(out_dir: str | Path, lm: Any = None) -> Path:
    """Rebuild ``report.md``, ``report.html`` and ``figures/*.png`` in a scan directory; returns the HTML path."""
    from discovery.io import write_bytes, write_text

    scan = read_scan(out_dir)
    sections, figures = build_sections(scan, lm)
    for fig in figures:
        write_bytes(scan.dir / "figures" / f"{fig.name}.png", fig.png)
    write_text(scan.dir / "report.md", render_markdown(scan, sections))
    return write_text(scan.dir / "report.html", render_html(scan, sections))
