"""Evidence standards: a head is a gather or aggregate head only when its pattern *and* its causal effect
at the right positions agree (DESIGN.md, "What a trained toy model taught us").

Small models trained here reach 99% accuracy with heads that put 82% of the query's attention on the
correct option and whose removal, alone or with every other selective head, changes nothing. A ranking
by pattern would name them; this module asks the causal questions the roles imply, every ablation going
through the one :class:`~discovery.ablation.AblationEngine`:

- :func:`position_effects`: each head's zero-ablation effect at all positions, at the query only, at the
  segment positions only and at the summary tokens only, plus mean ablation at all positions, with
  bootstrap intervals over prompts. An aggregate head's effect must live at the query; a gather head's
  at the segments (and a later head must read it, :func:`read_test`).
- :func:`depth_profile`, :func:`minimal_depth`, :func:`minimal_model_effects`: the paper's minimal model,
  automated. The task score of the model cut after each layer (read out through the final norm and the
  unembedding), the shallowest depth that keeps a chosen share of the clean score, and the head
  ablations repeated inside that truncated model, where redundancy from later layers is gone.
- :func:`group_ablations`: heads that share a role by pattern (every selective head; the gatherers of a
  layer) and the top-k heads by effect, ablated together, each against random controls of the same size
  from the same layers; members are credited by sparing them one at a time. Redundant circuits show up;
  decoys are exposed.
- :func:`read_test`: knock out a gather candidate at the segment positions and watch each later
  aggregate head: its selectivity / ``agg_select`` and its direct logit effect at the query.
- :func:`verdicts`: a role per head (``gather``, ``aggregate``, ``other_important``, ``decoy``, ``none``)
  with the evidence behind it, and one verdict per model: ``clean``, ``distributed`` or ``none``.
- :func:`evidence_report`: all of the above for one task of a scan; ``EvidenceReport.write`` writes
  ``evidence.parquet`` (per head), ``evidence_groups.parquet`` and ``evidence_depth.parquet``.

Effects are in units of the model's own clean logit difference (gold minus the mean of the other
candidates at the query): ablated minus clean, negative = the head helps. "Drop" below is minus that.

The stage is split by test: :mod:`~discovery.evidence.thresholds` (constants, :class:`EvidenceThresholds`),
:mod:`~discovery.evidence.positions`, :mod:`~discovery.evidence.minimal`, :mod:`~discovery.evidence.groups`,
:mod:`~discovery.evidence.reads`, :mod:`~discovery.evidence.roles` (verdicts and evidence lines) and
:mod:`~discovery.evidence.stage` (the scan's entry points); this package re-exports their public names.
"""
from __future__ import annotations

from discovery.evidence.groups import Group, control_draws, group_ablations, role_groups
from discovery.evidence.minimal import depth_profile, minimal_depth, minimal_model_effects
from discovery.evidence.positions import position_effects
from discovery.evidence.reads import read_test
from discovery.evidence.roles import EVIDENCE_PATTERN_METRICS, lives_at, verdicts
from discovery.evidence.stage import EvidenceReport, evidence_report, scan_evidence
from discovery.evidence.thresholds import (
    MINIMAL_SCOPES,
    ROLES,
    SCOPE_ABLATIONS,
    SHORT,
    VERDICTS,
    EvidenceThresholds,
)

__all__ = [
    "EVIDENCE_PATTERN_METRICS", "MINIMAL_SCOPES", "ROLES", "SCOPE_ABLATIONS", "SHORT", "VERDICTS",
    "EvidenceReport", "EvidenceThresholds", "Group", "control_draws", "depth_profile", "evidence_report",
    "group_ablations", "lives_at", "minimal_depth", "minimal_model_effects", "position_effects", "read_test",
    "role_groups", "scan_evidence", "verdicts",
]
