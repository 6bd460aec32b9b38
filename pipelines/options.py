"""The options of a scan and of model loading, declared once.

``gascan scan`` builds its arguments' defaults from these dataclasses, a batch spec's ``[scan]`` and
``[load]`` tables take exactly their fields, and both hand the same objects to the one pipeline
(:mod:`pipelines.pipeline`), so a scan and a batch cannot drift apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from discovery.errors import GascanError
from discovery.evidence.budget import all_position_sweep_fe

ABLATION_MODES = ("auto", "exact", "query", "atp", "screened", "none")
TABLE_VERSION = 1  # the head table's layout; part of every batch shard key
# read only by the stages after the sweep (evidence tests, pairs): changing them keeps a finished sweep, in a
# resumed scan, in `gascan report --rerun evidence --budget`, and in a batch (they key its finish shards only)
AFTER_SWEEP_SETTINGS = ("budget",)


@dataclass
class ScanOptions:
    """What a scan computes; recorded in summary.json and part of the batch layer's shard keys."""

    tasks: list[str] = field(default_factory=lambda: ["mc"])
    task_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    ablation: str = "auto"  # exact: all-position + query sweeps; query; atp: screen only; screened: the
    # default screen, then the all-position sweep on its top-k (discovery.measure.recall.DEFAULT_SCREEN); none;
    # auto: screened for large models, exact otherwise (resolve_ablation)
    prompts: int = 64
    seed: int = 0
    max_memory_mb: float | None = None  # execution setting: memory budget of batched ablation rows
    bootstrap: int = 1000
    chunk_prompts: int = 16
    refine_channels: bool = True  # Mamba-1: split the channel groups that matter down to channels
    budget: str = "auto"  # evidence + pairs per task: auto, none, N forward-equivalents or Ns seconds

    def __post_init__(self) -> None:
        if self.ablation not in ABLATION_MODES:
            raise GascanError(f"unknown ablation mode {self.ablation!r}", f"use one of: {', '.join(ABLATION_MODES)}")
        from pipelines.validate import budget, prompts

        prompts(self.prompts)  # 2 .. MAX_PROMPTS
        budget(self.budget)  # auto, none, N or Ns
        self.budget = str(self.budget)

    def options_for(self, task: str) -> dict[str, Any]:
        """The task generator's options: seed and prompt count, then the task's own options."""
        opts = {"seed": self.seed, "n": self.prompts}
        opts.update(self.task_options.get(task, {}))
        return opts

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The fields a batch spec's ``[scan]`` table may set (tasks and their options live elsewhere)."""
        return tuple(f.name for f in fields(cls) if f.name not in ("tasks", "task_options"))


SCREEN_ABOVE_FE = 100.0  # auto screens a model whose exact all-position sweep costs more


def resolve_ablation(mode: str, head_layers: list[int], n_layers: int, *, sharded: bool) -> str:
    """The sweep ``auto`` stands for: ``screened`` when the exact all-position sweep of every head would
    cost more than :data:`SCREEN_ABOVE_FE` forward-equivalents (so more than ~200 heads: SmolLM2-135M's 270
    heads, 140 fe; an 8B model's 1024), ``exact`` otherwise (the bundled toys, Gemma3-270M's 72 heads, 38 fe) and in a layer-range shard, which cannot screen the whole model.
    Any other mode is returned as given. On SmolLM2 (kv named, 16 prompts) the screened scan gave the exact
    scan's verdict for 205 instead of 348 forward-equivalents (docs/scale.md)."""
    if mode != "auto":
        return mode
    large = all_position_sweep_fe(head_layers, n_layers) > SCREEN_ABOVE_FE
    return "screened" if large and not sharded else "exact"


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint is loaded (see :func:`discovery.model.loading.load_model`)."""

    dtype: str = "float32"
    device: str = "cpu"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    mamba1_group_width: int | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def load(self, spec: str | None, attn_implementation: str = "sdpa"):
        """Load ``spec`` with these options."""
        from discovery.model.loading import load_model

        return load_model(spec, dtype=self.dtype, device=self.device, allow_pickle=self.allow_pickle,
                          trust_remote_code=self.trust_remote_code, mamba1_group_width=self.mamba1_group_width,
                          attn_implementation=attn_implementation)
