"""What a toy training run is: one validated, JSON-serialisable :class:`TrainConfig`.

Kept free of torch imports so the command line can validate input (and fail with one line)
before paying for the heavy imports.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from discovery.errors import GascanError

ARCHES: tuple[str, ...] = ("transformer", "mamba1", "mamba2", "hybrid")
TASKS: tuple[str, ...] = ("mc", "kv")
SSM_INITS: tuple[str, ...] = ("bamba", "mamba2")
LEGACY_SSM_INIT = "bamba"  # what hybrids recorded without an ssm_init were trained with


@dataclass
class TrainConfig:
    """Everything that determines a toy model's weights (plus run limits that may cut it short).

    The recipe defaults are the ones that worked on this project's CPU (DESIGN.md): init std 0.1,
    AdamW lr 2e-3, batch 64; with the library defaults (init 0.02, lr 3e-3) training stayed at chance.
    """

    arch: str = "transformer"
    task: str = "mc"
    seed: int = 0
    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    decay_steps: int = 0  # the last decay_steps steps lower the lr linearly to 0 (0: constant lr)
    grad_clip: float = 1.0
    init_std: float = 0.1
    layers: int = 4
    heads: int = 4  # attention heads per attention layer
    width: int = 128
    mlp_ratio: int = 2  # intermediate size = mlp_ratio * width (transformer and hybrid); 0 = no MLP
    ssm_heads: int = 8  # Mamba-2 heads per SSM layer (head dim = 2 * width / ssm_heads)
    ssm_state: int = 32  # state size per SSM head (Mamba-2) or per channel (Mamba-1)
    # Width of the Mamba-2 causal convolution (Mamba's default 4). Stacked width-4 convolutions reach
    # 3 tokens back per layer, enough to move an option's label to its last token without any SSM
    # head; a narrower one leaves longer-range moves to the SSM heads.
    conv_kernel: int = 4
    attn_layers: list[int] | None = None  # hybrid only; default: the middle layer
    # How a hybrid's Mamba-2 mixers start. "mamba2": as in the Mamba-2 toy (time steps log-uniform in
    # [0.001, 0.1], Kaiming-uniform convolution and output projection); "bamba": Bamba's own init, whose
    # time-step bias of 1 (dt = 1.31) makes every SSM head forget within a token or two at the start.
    # Runs recorded before this setting existed used "bamba" (:meth:`from_dict` reads them so).
    ssm_init: str = "mamba2"
    task_options: dict[str, Any] = field(default_factory=dict)
    # Curriculum over question subjects (mc): train on questions about 1 subject first and double the
    # number of subjects every ``curriculum_steps`` steps until all are in. With all 16 subjects from
    # the start, 4-layer models stayed at chance for 2500+ steps here (train loss ln 4); with 1-2
    # subjects they learn within ~200 steps and then carry the circuit over. 0 = no curriculum.
    curriculum_steps: int = 0
    # Auxiliary next-token loss on repeated random token sequences (the second copy is predictable only
    # by looking back at the first: the classic route to induction/copy heads), added with this weight
    # to every step's answer loss; a batch of ``batch_size`` sequences of 2 x ``induction_length`` tokens.
    induction_weight: float = 0.0
    induction_length: int = 16
    induction_steps: int = 0  # the induction loss is added in the first N steps only (0: every step)
    # Auxiliary "knowledge" loss (mc category questions): next-token loss on the category of each training
    # word in fact sequences such as " apple is fruit. car is vehicle. ..." (``knowledge_facts`` facts a
    # sequence, ``batch_size`` sequences a step), added with this weight. It teaches what a word is
    # directly, the way pretraining would, so the answer loss only has to grow the retrieval circuit.
    # Training-split words only: the unseen-word check stays at chance.
    knowledge_weight: float = 0.0
    knowledge_facts: int = 8
    vocab_size: int = 600
    train_size: int = 20000  # prompts in the training pool (cycled in a seeded order)
    test_size: int = 256  # held-out prompts (test split: disjoint words) for accuracy during training
    eval_every: int = 100
    save_every: int | None = None
    save_at: list[int] = field(default_factory=list)
    time_budget: float | None = None  # seconds of training; stops early (not deterministic in steps)
    threads: int = 1  # torch intra-op threads; fixed so float reductions repeat bit for bit (1: fastest on a shared CPU)

    def validate(self) -> TrainConfig:
        """Check the values a user can get wrong; raise a one-line :class:`GascanError`."""
        if self.arch not in ARCHES:
            raise GascanError(f"unknown toy architecture {self.arch!r}", f"use one of: {', '.join(ARCHES)}")
        if self.task not in TASKS:
            raise GascanError(f"unknown toy task {self.task!r}", f"use one of: {', '.join(TASKS)}")
        for name in ("steps", "batch_size", "layers", "heads", "width", "ssm_heads", "ssm_state", "conv_kernel",
                     "vocab_size", "train_size", "test_size", "eval_every", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise GascanError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}",
                                  "pass a whole number >= 1")
        if not isinstance(self.mlp_ratio, int) or self.mlp_ratio < 0:
            raise GascanError(f"--mlp-ratio must be a whole number >= 0, got {self.mlp_ratio!r}",
                              "pass 0 for an attention-only model, or 1, 2, ...")
        if self.width % self.heads:
            raise GascanError(f"--width {self.width} is not divisible by --heads {self.heads}",
                              "choose a width that is a multiple of the head count")
        if (2 * self.width) % self.ssm_heads:
            raise GascanError(f"2 x --width ({2 * self.width}) is not divisible by --ssm-heads {self.ssm_heads}",
                              "choose an SSM head count that divides twice the width")
        if self.vocab_size < 300:
            raise GascanError(f"--vocab-size {self.vocab_size} is too small for a byte-level BPE",
                              "use at least 300 (256 bytes + merges + special tokens)")
        if self.ssm_init not in SSM_INITS:
            raise GascanError(f"unknown --ssm-init {self.ssm_init!r}", f"use one of: {', '.join(SSM_INITS)}")
        if self.attn_layers is not None:
            if self.arch != "hybrid":
                raise GascanError(f"--attn-layers only applies to --arch hybrid, not {self.arch!r}",
                                  "drop --attn-layers or use --arch hybrid")
            bad = [i for i in self.attn_layers if not 0 <= i < self.layers]
            if bad or not self.attn_layers:
                raise GascanError(
                    f"--attn-layers {','.join(map(str, self.attn_layers))} is out of range for {self.layers} layers",
                    f"give layer indices between 0 and {self.layers - 1}, comma separated",
                )
            if len(set(self.attn_layers)) != len(self.attn_layers):
                raise GascanError("--attn-layers lists a layer twice", "list each layer once")
        if self.save_every is not None and self.save_every < 1:
            raise GascanError(f"--save-every must be >= 1, got {self.save_every}", "pass a positive step count")
        if any(s < 1 for s in self.save_at):
            raise GascanError("--save-at steps must be >= 1", "list positive step numbers")
        if self.time_budget is not None and self.time_budget <= 0:
            raise GascanError(f"--time-budget must be positive, got {self.time_budget}", "pass seconds > 0")
        if not self.lr > 0 or not self.init_std > 0:
            raise GascanError("--lr and --init-std must be positive", "pass values > 0")
        if {"split", "seed", "n"} & set(self.task_options):
            raise GascanError("--task-option may not set split, seed or n (the trainer sets them)",
                              "use --seed, --train-size and --test-size instead")
        if not isinstance(self.decay_steps, int) or not 0 <= self.decay_steps <= self.steps:
            raise GascanError(f"--decay-steps must be between 0 and --steps ({self.steps}), got {self.decay_steps!r}",
                              "pass 0 (constant lr) or at most the number of steps")
        if not self.induction_weight >= 0 or not isinstance(self.induction_length, int) or self.induction_length < 2:
            raise GascanError("--induction-weight must be >= 0 and --induction-length a whole number >= 2",
                              "pass e.g. --induction-weight 1 --induction-length 16")
        if not isinstance(self.induction_steps, int) or self.induction_steps < 0:
            raise GascanError(f"--induction-steps must be >= 0, got {self.induction_steps!r}",
                              "pass 0 (induction loss on every step) or a step count")
        if not self.knowledge_weight >= 0 or not isinstance(self.knowledge_facts, int) or self.knowledge_facts < 1:
            raise GascanError("--knowledge-weight must be >= 0 and --knowledge-facts a whole number >= 1",
                              "pass e.g. --knowledge-weight 1 --knowledge-facts 8")
        if self.knowledge_weight and (self.task != "mc" or self.task_options.get("question", "category") != "category"):
            raise GascanError("--knowledge-weight needs category questions (task mc, question=category)",
                              "drop --knowledge-weight")
        if not isinstance(self.curriculum_steps, int) or self.curriculum_steps < 0:
            raise GascanError(f"--curriculum-steps must be >= 0, got {self.curriculum_steps!r}",
                              "pass 0 (no curriculum) or a step count such as 200")
        if self.curriculum_steps and self.task != "mc":
            raise GascanError(f"--curriculum-steps needs questions with subjects (task mc), not {self.task!r}",
                              "drop --curriculum-steps")
        return self

    def hybrid_attn_layers(self) -> list[int]:
        """The attention layers of a hybrid: as given, or the middle layer."""
        return sorted(self.attn_layers) if self.attn_layers is not None else [self.layers // 2]

    def checkpoint_steps(self) -> set[int]:
        """Steps after which an intermediate checkpoint is written."""
        steps = {s for s in self.save_at if s < self.steps}
        if self.save_every:
            steps |= set(range(self.save_every, self.steps, self.save_every))
        return steps

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based ``step``: constant, then linear to 0 over the last ``decay_steps``."""
        start = self.steps - self.decay_steps
        if not self.decay_steps or step < start:
            return self.lr
        return self.lr * (self.steps - step) / self.decay_steps

    def subjects_at(self, step: int, n_subjects: int) -> int:
        """How many subjects the curriculum admits at ``step`` (0-based): 1, 2, 4, ... then all."""
        if not self.curriculum_steps:
            return n_subjects
        return min(n_subjects, 2 ** (step // self.curriculum_steps))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """A recorded config; a setting it lacks takes the value it had when the run was trained: the
        current default, except a hybrid's ``ssm_init``, which was always Bamba's before it was a setting."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if known.get("arch") == "hybrid":
            known.setdefault("ssm_init", LEGACY_SSM_INIT)
        return cls(**known)
