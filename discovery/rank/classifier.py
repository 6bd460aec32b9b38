"""P(gather) and P(aggregate) for every head, from the head table.

Features (:data:`FEATURES`) are normalised per model and task so one classifier serves models of any
size: pattern metrics are already fractions; depth is a fraction of the model's depth; effects are
divided by the clean logit difference (floored at :data:`CLEAN_FLOOR`, so a model at chance does not
blow them up) and also expressed as a share of the model's largest drop; products of a pattern metric
and the matching effect encode "pattern *and* effect agree" (DESIGN.md: a pattern without an effect is
a decoy), which a linear model could not express otherwise.

The model is two standardised logistic regressions (one per role, each on the features its role can use:
:data:`ROLE_EXCLUDED`) fitted with scikit-learn and shipped
as explicit parameters in JSON (``discovery/data/classifier.json``): loading it executes no code, and
inference is a few lines of numpy that reproduce scikit-learn's probabilities exactly.

Labels are ``{model | checkpoint, layer, head, kind, role[, task]}`` records (JSON list, or an object
with a ``labels`` list); ``role`` is ``gather`` or ``aggregate``; every other head of a labelled model is
a negative. Mamba-1 labels may name ``channels`` (with ``d_inner``) instead of a head: the channels are
mapped onto gascan's channel groups of the scanned model.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import polars as pl

from discovery.errors import GascanError

VERSION = 1
ROLES = ("gather", "aggregate")
CLEAN_FLOOR = 0.5  # logit-diff units: effects are divided by max(|clean logit diff|, this)
DEFAULT_ARTIFACT = "classifier.json"
PUBLISHED_LABELS = "published_heads.json"
GROUP_KEYS = ("model", "checkpoint", "task")
T = TypeVar("T")

PATTERN_FEATURES = ("gather_score", "gather_entropy", "agg_focus", "agg_focus_segment", "agg_select", "agg_margin",
                    "selectivity", "agg_after")
FEATURES: tuple[str, ...] = (
    *PATTERN_FEATURES,
    "depth", "is_ssm",
    "drop_all", "drop_query", "drop_segment", "drop_summary", "drop_nonquery",
    "acc_drop_all", "acc_drop_query",
    "dla_rel", "atp_rel",
    "share_all", "share_query",
    "sig_all", "sig_query",
    "gather_x_effect", "agg_x_effect", "focus_x_effect",
)
# Features a role's regression does not use (their coefficients are 0). A gather head's work is done
# before the query, so what removing it costs *at the query* says nothing about gathering: in a hybrid
# with attention at layer 0 the gather head also costs 1.7 logits at the query, and the query-effect
# weights learned from toys whose gather heads cost nothing there ranked it 4th of four layer-0 heads.
ROLE_EXCLUDED: dict[str, tuple[str, ...]] = {
    "gather": ("drop_query", "acc_drop_query", "share_query", "sig_query"),
    "aggregate": (),
}


# ---------------------------------------------------------------------------------------------
# features
# ---------------------------------------------------------------------------------------------


def attach_clean(frame: pl.DataFrame, summary: Mapping[str, Any] | None) -> pl.DataFrame:
    """Add ``clean_ld`` and ``clean_acc`` per row from a scan's summary.json (null where unknown)."""
    tasks = (summary or {}).get("tasks", {}) or {}
    ld = {t: (info.get("clean") or {}).get("logit_diff") for t, info in tasks.items()}
    acc = {t: (info.get("clean") or {}).get("acc") for t, info in tasks.items()}
    out = frame
    if "clean_ld" not in frame.columns:
        out = out.with_columns(pl.col("task").replace_strict(ld, default=None, return_dtype=pl.Float64)
                               .alias("clean_ld"))
    if "clean_acc" not in frame.columns:
        out = out.with_columns(pl.col("task").replace_strict(acc, default=None, return_dtype=pl.Float64)
                               .alias("clean_acc"))
    return out


def _col(frame: pl.DataFrame, name: str) -> pl.Expr:
    """A float column, or nulls when the table does not have it (older scans, other ablation modes)."""
    if name in frame.columns:
        return pl.col(name).cast(pl.Float64)
    return pl.lit(None, dtype=pl.Float64)


def head_features(frame: pl.DataFrame) -> pl.DataFrame:
    """The :data:`FEATURES` of every row (null = not measured), normalised per (model, checkpoint, task)."""
    from discovery.measure.metrics import (
        SELECTION_METRICS,  # here, not at the top: importing the classifier needs no torch
    )

    if frame.height == 0:
        return pl.DataFrame({f: [] for f in FEATURES}, schema={f: pl.Float64 for f in FEATURES})
    keys = [k for k in GROUP_KEYS if k in frame.columns]
    f = frame.with_row_index("_row")
    if "clean_ld" not in f.columns:
        f = f.with_columns(pl.lit(None, dtype=pl.Float64).alias("clean_ld"))
    # Scale of "one task's worth" of logit difference; the largest single-head drop stands in when the
    # clean score is unknown.
    biggest = (-pl.min_horizontal(_col(f, "d_ld_all"), _col(f, "d_ld_query"))).max()
    biggest = biggest.over(keys) if keys else biggest  # a table without model/task columns is one group
    scale = pl.max_horizontal(pl.col("clean_ld").cast(pl.Float64).abs().fill_null(biggest),
                              pl.lit(CLEAN_FLOOR))
    f = f.with_columns(scale.alias("_scale"))
    drop = lambda c: (-_col(f, c) / pl.col("_scale"))  # positive = removing the head hurts
    f = f.with_columns(
        drop("d_ld_all").alias("drop_all"), drop("d_ld_query").alias("drop_query"),
        drop("d_ld_segment").alias("drop_segment"), drop("d_ld_summary").alias("drop_summary"),
        (-_col(f, "d_acc_all")).alias("acc_drop_all"), (-_col(f, "d_acc_query")).alias("acc_drop_query"),
        (_col(f, "dla") / pl.col("_scale")).alias("dla_rel"), (-_col(f, "atp_ld") / pl.col("_scale")).alias("atp_rel"),
        (pl.col("kind") == "ssm").cast(pl.Float64).alias("is_ssm"),
        _col(f, "depth").alias("depth"),
        (_col(f, "d_ld_all_hi") < 0).cast(pl.Float64).alias("sig_all"),
        (_col(f, "d_ld_query_hi") < 0).cast(pl.Float64).alias("sig_query"),
    )
    f = f.with_columns(
        (pl.col("drop_all") - pl.col("drop_query")).alias("drop_nonquery"),
        _share(f, "drop_all", keys).alias("share_all"), _share(f, "drop_query", keys).alias("share_query"),
    )
    positive = lambda c: pl.col(c).clip(0.0, 1.0)
    gather_effect = pl.max_horizontal(positive("drop_all"), positive("drop_segment"), positive("drop_summary"))
    # the aggregate head's selection as the truth rules judge it (metrics.selection): agg_select or agg_after
    selection = pl.max_horizontal(*(_col(f, name) for name in SELECTION_METRICS))
    f = f.with_columns(
        (_col(f, "gather_score") * gather_effect).alias("gather_x_effect"),
        (selection * positive("drop_query")).alias("agg_x_effect"),
        (_col(f, "agg_focus") * positive("drop_query")).alias("focus_x_effect"),
        *[_col(f, name).alias(name) for name in PATTERN_FEATURES],
    )
    return f.sort("_row").select([pl.col(c).cast(pl.Float64) for c in FEATURES])


def _share(f: pl.DataFrame, column: str, keys: list[str]) -> pl.Expr:
    """A drop as a fraction of the group's largest drop, clipped to [-1, 1] (0 when nothing drops)."""
    top = pl.col(column).max().over(keys) if keys else pl.col(column).max()
    return pl.when(top > 1e-9).then((pl.col(column) / top).clip(-1.0, 1.0)).otherwise(0.0)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


@dataclass
class HeadClassifier:
    """Standardise, then one logistic regression per role. Parameters are plain lists (JSON)."""

    features: list[str]
    mean: list[float]
    scale: list[float]
    coef: dict[str, list[float]]
    intercept: dict[str, float]
    version: int = VERSION
    meta: dict[str, Any] = field(default_factory=dict)

    def matrix(self, frame: pl.DataFrame) -> np.ndarray:
        """Standardised feature matrix ``[row, feature]``; unmeasured features sit at the training mean (0)."""
        feats = head_features(frame)
        missing = [f for f in self.features if f not in feats.columns]
        if missing:
            raise GascanError(f"classifier needs features {missing} that this gascan does not compute",
                              "retrain it with `gascan classifier train`")
        x = feats.select(self.features).to_numpy().astype(np.float64)  # [row, feature]
        z = (x - np.asarray(self.mean)) / np.asarray(self.scale)
        return np.where(np.isfinite(z), z, 0.0)

    def predict(self, frame: pl.DataFrame) -> dict[str, np.ndarray]:
        """``{"gather": [row], "aggregate": [row]}`` probabilities."""
        z = self.matrix(frame)
        out = {}
        for role in ROLES:
            logit = z @ np.asarray(self.coef[role]) + self.intercept[role]  # [row]
            out[role] = 1.0 / (1.0 + np.exp(-logit))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"format": "gascan-head-classifier", "version": self.version, "features": list(self.features),
                "scaler": {"mean": list(map(float, self.mean)), "scale": list(map(float, self.scale))},
                "roles": {r: {"coef": list(map(float, self.coef[r])), "intercept": float(self.intercept[r])}
                          for r in ROLES},
                "meta": self.meta}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "classifier") -> HeadClassifier:
        """Validate and build; a malformed artifact is a one-line error (no code is ever executed)."""
        def bad(why: str) -> GascanError:
            return GascanError(f"{source} is not a valid gascan classifier ({why})",
                               "retrain it with `gascan classifier train` or reinstall gascan")

        if not isinstance(data, Mapping) or data.get("format") != "gascan-head-classifier":
            raise bad("missing format tag")
        if data.get("version") != VERSION:
            raise bad(f"version {data.get('version')!r}, this gascan reads version {VERSION}")
        try:
            feats = [str(f) for f in data["features"]]
            mean = [float(v) for v in data["scaler"]["mean"]]
            scale = [float(v) for v in data["scaler"]["scale"]]
            coef = {r: [float(v) for v in data["roles"][r]["coef"]] for r in ROLES}
            intercept = {r: float(data["roles"][r]["intercept"]) for r in ROLES}
        except (KeyError, TypeError, ValueError) as err:
            raise bad(f"{err.__class__.__name__}: {err}") from None
        n = len(feats)
        if len(mean) != n or len(scale) != n or any(len(c) != n for c in coef.values()):
            raise bad("parameter lengths differ from the feature list")
        values = [*mean, *scale, *intercept.values(), *(v for c in coef.values() for v in c)]
        if not all(math.isfinite(v) for v in values) or any(s <= 0 for s in scale):
            raise bad("non-finite parameters or non-positive scales")
        return cls(feats, mean, scale, coef, intercept, VERSION, dict(data.get("meta") or {}))


def save_classifier(clf: HeadClassifier, path: str | Path) -> Path:
    from discovery.io import write_json

    return write_json(path, clf.to_json())


def load_classifier(path: str | Path | None = None) -> HeadClassifier:
    """The shipped artifact (default) or a JSON file written by :func:`save_classifier`."""
    if path is None:
        ref = resources.files("discovery") / "data" / DEFAULT_ARTIFACT
        if not ref.is_file():
            raise GascanError("the shipped head classifier is missing",
                              "train one with `gascan classifier train` or reinstall gascan")
        text, source = ref.read_text(encoding="utf-8"), str(ref)
    else:
        p = Path(path)
        if not p.is_file():
            raise GascanError(f"classifier file {p} does not exist", "pass the JSON written by `gascan classifier train`")
        text, source = p.read_text(encoding="utf-8"), str(p)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise GascanError(f"{source} is not JSON ({err.msg} at line {err.lineno})",
                          "retrain it with `gascan classifier train`") from None
    return HeadClassifier.from_json(data, source)


def score_heads(frame: pl.DataFrame, summary: Mapping[str, Any] | None = None,
                clf: HeadClassifier | None = None) -> pl.DataFrame:
    """``frame`` with ``p_gather`` and ``p_aggregate`` columns (the shipped classifier by default)."""
    clf = clf or load_classifier()
    f = attach_clean(frame, summary) if summary is not None else frame
    probs = clf.predict(f)
    return frame.with_columns(pl.Series("p_gather", probs["gather"]), pl.Series("p_aggregate", probs["aggregate"]))


# ---------------------------------------------------------------------------------------------
# labels
# ---------------------------------------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def read_labels(path: str | Path) -> list[dict[str, Any]]:
    """Label records from a JSON file: a list, or ``{"labels": [...]}``; each record is validated."""
    p = Path(path)
    if not p.is_file():
        raise GascanError(f"labels file {p} does not exist", "pass a JSON list of {model, layer, head, kind, role}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise GascanError(f"labels file {p} is not JSON ({err.msg} at line {err.lineno})", "fix the file") from None
    records = data.get("labels") if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise GascanError(f"labels file {p} holds no list of labels", 'write [{"model": ..., "layer": ..., ...}]')
    for i, rec in enumerate(records):
        problem = _check_label(rec)
        if problem:
            raise GascanError(f"label {i} in {p}: {problem}",
                              'each label is {"model" or "checkpoint", "layer", "head" (or "channels"), '
                              '"kind", "role": "gather"|"aggregate"}')
    return records


def _check_label(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return "not an object"
    if not rec.get("model") and not rec.get("checkpoint"):
        return "names neither a model nor a checkpoint"
    if rec.get("role") not in ROLES:
        return f"role {rec.get('role')!r} is not gather or aggregate"
    if not isinstance(rec.get("layer"), int):
        return "layer is not an integer"
    if rec.get("kind", "attn") not in ("attn", "ssm"):
        return f"kind {rec.get('kind')!r} is not attn or ssm"
    if "channels" in rec:
        if not isinstance(rec.get("d_inner"), int) or not all(isinstance(c, int) for c in rec["channels"]):
            return "channel labels need integer channels and d_inner"
    elif not isinstance(rec.get("head"), int):
        return "head is not an integer"
    return None


def published_labels() -> list[dict[str, Any]]:
    """The curated published G&A heads shipped with gascan (Bick et al. 2025)."""
    ref = resources.files("discovery") / "data" / PUBLISHED_LABELS
    data = json.loads(ref.read_text(encoding="utf-8"))
    return list(data["labels"])


def label_matches_model(rec: Mapping[str, Any], model: str, checkpoint: str | None = None) -> bool:
    """A label applies to a scanned model when its checkpoint hash is equal (if both have one), else when a
    name/alias is contained in the model's name (case and punctuation ignored: ``Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf`` matches
    ``Llama-3.1-8B-Instruct``)."""
    if rec.get("checkpoint") and checkpoint:
        return rec["checkpoint"] == checkpoint  # a hash, when both have one, decides alone
    names = [rec.get("model"), *(rec.get("aliases") or [])]
    target = _norm(str(model))
    return any(n and _norm(str(n)) and _norm(str(n)) in target for n in names)


def _label_heads(rec: Mapping[str, Any], heads_in_layer: int) -> list[int]:
    """Head indices a label names; channel labels map onto this scan's channel groups."""
    if "channels" in rec:
        width = max(1, int(rec["d_inner"]) // max(1, heads_in_layer))
        return sorted({int(c) // width for c in rec["channels"]})
    return [int(rec["head"])]


def label_rows(frame: pl.DataFrame, labels: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """``frame`` with ``role_label`` (gather / aggregate / none) for rows of labelled models; unlabelled
    models' rows are dropped (their heads are unknown, not negatives)."""
    if frame.height == 0:
        return frame.with_columns(pl.lit(None, dtype=pl.String).alias("role_label"))
    pieces = []
    groups = frame.partition_by(["model", "checkpoint"], as_dict=True, maintain_order=True)
    for (model, checkpoint), rows in groups.items():
        mine = [r for r in labels if label_matches_model(r, str(model), str(checkpoint))]
        if not mine:
            continue
        roles = ["none"] * rows.height
        index = {(r["layer"], r["head"], r["kind"], r["task"]): i for i, r in enumerate(
            rows.select("layer", "head", "kind", "task").iter_rows(named=True))}
        per_layer = rows.group_by("layer", "kind").agg(pl.len().alias("n"))
        counts = {(r["layer"], r["kind"]): r["n"] for r in per_layer.iter_rows(named=True)}
        tasks = rows["task"].unique().to_list()
        for rec in mine:
            kind = rec.get("kind", "attn")
            for head in _label_heads(rec, counts.get((rec["layer"], kind), 1)):
                for task in ([rec["task"]] if rec.get("task") else tasks):
                    i = index.get((rec["layer"], head, kind, task))
                    if i is not None:
                        # a head labelled with both roles keeps the first; aggregate wins over none
                        roles[i] = rec["role"] if roles[i] == "none" else roles[i]
        pieces.append(rows.with_columns(pl.Series("role_label", roles)))
    if not pieces:
        return frame.clear().with_columns(pl.lit(None, dtype=pl.String).alias("role_label"))
    return pl.concat(pieces, how="diagonal_relaxed")


# ---------------------------------------------------------------------------------------------
# training and evaluation
# ---------------------------------------------------------------------------------------------


def train_classifier(labelled: pl.DataFrame, *, c: float = 1.0, meta: Mapping[str, Any] | None = None
                     ) -> HeadClassifier:
    """Fit the scaler and one balanced logistic regression per role on rows with ``role_label`` (each role
    on :data:`FEATURES` less its :data:`ROLE_EXCLUDED`)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    if labelled.height == 0 or "role_label" not in labelled.columns:
        raise GascanError("no labelled heads to train on",
                          "pass head tables of models the labels name (match by model name or checkpoint)")
    x = head_features(labelled).to_numpy().astype(np.float64)  # [row, feature]
    seen = np.isfinite(x)
    counts = seen.sum(axis=0)
    mean = np.where(counts > 0, np.where(seen, x, 0.0).sum(axis=0) / np.maximum(counts, 1), 0.0)  # [feature]
    x = np.where(np.isfinite(x), x, mean)
    scaler = StandardScaler().fit(x)
    scale = np.where(scaler.scale_ > 1e-12, scaler.scale_, 1.0)
    z = (x - mean) / scale
    coef, intercept = {}, {}
    roles = labelled["role_label"].to_numpy()
    for role in ROLES:
        y = (roles == role).astype(int)
        if y.sum() == 0 or y.sum() == len(y):
            raise GascanError(f"the labels give no {role} heads (or only {role} heads) to learn from",
                              f"add labelled {role} heads and negatives")
        used = [i for i, name in enumerate(FEATURES) if name not in ROLE_EXCLUDED[role]]
        model = LogisticRegression(C=c, class_weight="balanced", max_iter=5000)
        model.fit(z[:, used], y)
        weights = np.zeros(len(FEATURES))
        weights[used] = model.coef_[0]
        coef[role] = weights.tolist()
        intercept[role] = float(model.intercept_[0])
    info = {"n_rows": int(labelled.height), "n_models": int(labelled.select("model", "checkpoint").n_unique()),
            "n_gather": int((roles == "gather").sum()), "n_aggregate": int((roles == "aggregate").sum()),
            "C": c, **dict(meta or {})}
    return HeadClassifier(list(FEATURES), mean.tolist(), scale.tolist(), coef, intercept, VERSION, info)


def spread_by_gather(pairs: Sequence[T], gather_of: Callable[[T], Hashable], score_of: Callable[[T], float]
                     ) -> list[T]:
    """Pairs best first, except that a gather head's n-th pair comes after every gather head's (n-1)-th.

    Aggregate heads often come as a redundant set (five SSM heads in the hybrid toy, seven attention
    heads in the transformer toy), so a plain sort fills the top of the list with one gather head and
    each member of the set: one hypothesis repeated, while the second-best gather head is pushed below
    them (the hybrid toy's true gather head, second by P(gather), came 7th). Spreading shows (and
    verifies) one pair per gather candidate first; within a round the order is by score.
    """
    ranked = sorted(pairs, key=lambda p: -score_of(p))  # stable: ties keep their input order
    seen: Counter[Hashable] = Counter()
    rounds = []  # [pair]: how many better pairs of the same gather head come before it
    for pair in ranked:
        rounds.append(seen[gather_of(pair)])
        seen[gather_of(pair)] += 1
    order = sorted(range(len(ranked)), key=lambda i: (rounds[i], i))
    return [ranked[i] for i in order]


def pair_prior(frame: pl.DataFrame, p_gather: np.ndarray, p_aggregate: np.ndarray, k: int = 3
               ) -> list[tuple[tuple[int, int, str], tuple[int, int, str], float]]:
    """The k first (gather, aggregate) pairs of one model/task by P(g)·P(a), gather layer before aggregate,
    spread over gather heads (:func:`spread_by_gather`, the order the scan's pair ranking uses)."""
    heads = list(zip(frame["layer"].to_list(), frame["head"].to_list(), frame["kind"].to_list()))
    g_order = np.argsort(-p_gather, kind="stable")[:20]
    a_order = np.argsort(-p_aggregate, kind="stable")[:20]
    pairs = [(heads[g], heads[a], float(p_gather[g] * p_aggregate[a]))
             for g in g_order for a in a_order if heads[g][0] < heads[a][0]]
    return spread_by_gather(pairs, lambda t: t[0], lambda t: t[2])[:k]


def leave_one_model_out(labelled: pl.DataFrame, *, threshold: float = 0.5, c: float = 1.0) -> pl.DataFrame:
    """Train on every labelled model but one, score the held-out one; one row per held-out model/task.

    Columns: precision/recall and false positives per role at ``threshold`` (on a model without G&A,
    every positive is false), the rank of the best true head of each role
    (1 = ranked first), and whether a true (gather, aggregate) pair is among the first 3 pairs of
    :func:`pair_prior`.
    """
    models = labelled.select("model", "checkpoint").unique(maintain_order=True).rows()
    rows = []
    for model, checkpoint in models:
        held = labelled.filter((pl.col("model") == model) & (pl.col("checkpoint") == checkpoint))
        rest = labelled.filter(~((pl.col("model") == model) & (pl.col("checkpoint") == checkpoint)))
        try:
            clf = train_classifier(rest, c=c)
        except GascanError as err:
            raise GascanError(f"cannot hold out {model}: {err.problem}",
                              "leave-one-model-out needs gather and aggregate labels in at least two models") from None
        for (task,), part in held.partition_by(["task"], as_dict=True, maintain_order=True).items():
            rows.append({"model": model, "checkpoint": checkpoint, "task": task,
                         **score_labelled(clf, part, threshold=threshold)})
    return pl.DataFrame(rows, infer_schema_length=None)


def score_labelled(clf: HeadClassifier, part: pl.DataFrame, *, threshold: float = 0.5) -> dict[str, Any]:
    """How ``clf`` ranks one labelled model/task table: precision, recall and false positives per role at
    ``threshold``, the rank of the best true head of each role (1 = first), and whether a true
    (gather, aggregate) pair is among the first 3 pairs of :func:`pair_prior` (None when the table has no pair)."""
    probs = clf.predict(part)
    truth = part["role_label"].to_numpy()
    row: dict[str, Any] = {"heads": part.height}
    for role in ROLES:
        pred = probs[role] >= threshold
        true = truth == role
        tp = int((pred & true).sum())
        row[f"{role}_precision"] = tp / int(pred.sum()) if pred.sum() else None
        row[f"{role}_recall"] = tp / int(true.sum()) if true.sum() else None
        row[f"{role}_false_positives"] = int((pred & ~true).sum())
        order = np.argsort(-probs[role])
        ranks = [int(np.nonzero(order == i)[0][0]) + 1 for i in np.nonzero(true)[0]]
        row[f"{role}_best_rank"] = min(ranks) if ranks else None
    truth_pairs = {(g, a) for g in _heads_with(part, "gather") for a in _heads_with(part, "aggregate") if g[0] < a[0]}
    top = pair_prior(part, probs["gather"], probs["aggregate"], k=3)
    row["pair_in_top3"] = any((g, a) in truth_pairs for g, a, _ in top) if truth_pairs else None
    return row


def _heads_with(frame: pl.DataFrame, role: str) -> list[tuple[int, int, str]]:
    part = frame.filter(pl.col("role_label") == role)
    return list(zip(part["layer"].to_list(), part["head"].to_list(), part["kind"].to_list()))


def load_tables(paths: Iterable[str | Path]) -> pl.DataFrame:
    """Head tables (``heads.parquet`` files or scan directories), each with its summary's clean scores."""
    frames = []
    for raw in paths:
        p = Path(raw)
        table = p / "heads.parquet" if p.is_dir() else p
        if not table.is_file():
            raise GascanError(f"no head table at {p}", "pass heads.parquet files or scan directories")
        try:
            frame = pl.read_parquet(table)
            summary_path = table.parent / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        except (OSError, ValueError, pl.exceptions.PolarsError) as err:  # garbage files: one line naming them
            raise GascanError(f"cannot read the head table {table} ({err.__class__.__name__})",
                              "pass heads.parquet files or scan directories written by gascan scan") from None
        frames.append(attach_clean(frame, summary))
    if not frames:
        raise GascanError("no head tables given", "pass one or more heads.parquet files or scan directories")
    return pl.concat(frames, how="diagonal_relaxed")


TRAINING_ROWS = "classifier_training.parquet"


def shipped_training_rows() -> pl.DataFrame:
    """The labelled rows the shipped classifier was trained on (for ``gascan classifier eval``)."""
    ref = resources.files("discovery") / "data" / TRAINING_ROWS
    if not ref.is_file():
        raise GascanError("the shipped training rows are missing",
                          "pass head tables and --labels to `gascan classifier eval`")
    with resources.as_file(ref) as path:
        return pl.read_parquet(path)
