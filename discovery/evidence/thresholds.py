"""The evidence stage's constants and thresholds: which scopes are ablated, which roles and verdicts
exist, and when a pattern, an effect or a group counts."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from discovery.errors import GascanError

ROLES = ("gather", "aggregate", "other_important", "decoy", "none")
VERDICTS = ("clean", "distributed", "none")
# scope name -> (method, position classes): the position-resolved single-head ablations
SCOPE_ABLATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "all": ("zero", ("all",)),
    "query": ("zero", ("query",)),
    "segment": ("zero", ("segment",)),
    "summary": ("zero", ("summary",)),
    "mean_all": ("mean", ("all",)),
}
MINIMAL_SCOPES = ("all", "query", "segment")
SHORT = {"logit_diff": "ld", "acc": "acc", "gold_logprob": "lp"}


@dataclass
class EvidenceThresholds:
    """When a pattern counts, when an effect counts, and when a group beats its controls.

    Effect thresholds are fractions of the model's own clean logit difference (``clean_ld``); an effect
    "counts" only when its bootstrap interval also excludes 0. Group thresholds compare a group with
    random controls of the same size drawn from the same layers.
    """

    selectivity: float = 0.6  # aggregate-like pattern: query mass on the gold segment / on all segments
    agg_select: float = 0.6  # ... or the gold segment gets the most query mass on this share of prompts
    # (or this much query mass sits on the two tokens right after it: agg_after, an SSM reading late)
    gather_score: float = 0.5  # gather-like pattern: summary-token mass on its own segment's other tokens
    effect: float = 0.1  # important: drop >= effect * clean_ld (interval excluding 0)
    noise: float = 0.05  # no effect: |effect| < noise * clean_ld, or the interval includes 0, at every scope
    located: float = 0.5  # an effect "lives" at a position class when ablating there gives this share of all
    group: float = 0.2  # a group matters: joint drop >= group * clean_ld ...
    control_quantile: float = 0.95  # ... beyond this quantile of its controls' drops, interval excluding 0
    n_controls: int = 30  # random control draws per group (all distinct draws when fewer exist)
    top_k: int = 5  # size of the top-k-by-effect group
    max_gather_groups: int | None = 8  # cost cap: test the layers whose gatherers' summed segment drop is largest
    read: float = 0.3  # a later head reads a gatherer: its direct logit effect falls by this share ...
    read_select: float = 0.1  # ... or its selectivity / agg_select falls by this much (absolute)
    keep: float = 0.9  # the minimal model keeps this share of the clean score (above chance for accuracy)
    depth_metric: str = "acc"  # score the minimal model keeps: acc (chance-corrected) or logit_diff
    min_margin: float = 0.05  # the task is "done" when clean accuracy beats chance by this much

    def __post_init__(self) -> None:
        if self.depth_metric not in ("acc", "logit_diff"):
            raise GascanError(f"unknown depth metric {self.depth_metric!r}", "use acc or logit_diff")
        for name in ("selectivity", "agg_select", "gather_score", "located", "control_quantile", "keep", "read"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise GascanError(f"evidence threshold {name}={value} is outside 0..1", "pass a fraction")
        if self.n_controls < 1 or self.top_k < 1 or (self.max_gather_groups is not None and self.max_gather_groups < 0):
            raise GascanError("n_controls and top_k must be at least 1, max_gather_groups at least 0",
                              "pass positive counts")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
