"""The deterministic toy-model trainer.

One call, :func:`train`, goes from a :class:`TrainConfig` to a Hugging Face model directory:
prompts from the task generators, a BPE tokenizer trained on the training split, a model from a
transformers config, AdamW on the answer token only, accuracy every ``eval_every`` steps on held-out
prompts over the training words (and, as a check, on the task's disjoint ``test`` words, which a
toy model cannot know), and intermediate checkpoints under ``DIR/checkpoints/step-NNNNNN``.

Same config and machine, same weights bit for bit: fixed seeds, a fixed data order, a fixed thread
count and deterministic algorithms (restored afterwards, so callers' settings are untouched).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from discovery.errors import GascanError
from discovery.toy.config import TrainConfig
from discovery.toy.data import (
    Encoded,
    Facts,
    category_facts,
    check_task_options,
    corpus_texts,
    encode,
    has_word_splits,
    task_prompts,
)
from discovery.toy.mamba1_scan import fast_mamba1
from discovery.toy.models import build_model
from discovery.toy.tokenizer import check_single_tokens, train_tokenizer

TEST_SEED_OFFSET = 1_000_003  # held-out prompts come from another generator seed
TEST_SPLIT_NOTE = ("held-out prompts over the training words: split=train, generator seed = seed + "
                   f"{TEST_SEED_OFFSET}, no prompt text shared with the training pool")
UNSEEN_NOTE = (f"split=test (words never seen in training), generator seed = seed + {2 * TEST_SEED_OFFSET}; "
               "a toy model has no way to know these words' "
               "categories, so this stays near chance: a check, not a target")
CHECKPOINT_DIR = "checkpoints"


@dataclass
class TrainResult:
    """What a run produced: where, how far, how well, how long."""

    out_dir: Path
    steps: int
    test_accuracy: float
    final_train_loss: float | None
    train_seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)


@contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Fix the thread count and ask for deterministic kernels; restore both on exit."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)


def answer_logits(model, input_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Next-token logits at each row's last prompt token: [batch, vocab].

    Right padding is harmless for causal models (no position sees a later one), so no mask is
    needed; only the answer position goes through the LM head.
    """
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state  # [b, len, d]
    rows = torch.arange(input_ids.shape[0])
    return model.lm_head(hidden[rows, last])  # [b, vocab]


def induction_loss(model, cfg: TrainConfig, plain_ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Next-token loss on the second copy of repeated random token sequences (tokens 2..n of the copy,
    which only a head that looks back at the first copy can predict); ``plain_ids``: the non-special ids."""
    n = cfg.induction_length
    half = plain_ids[torch.randint(len(plain_ids), (cfg.batch_size, n), generator=gen)]  # [batch, n]
    seq = torch.cat([half, half], dim=1)  # [batch, 2n]
    logits = model(input_ids=seq).logits[:, n:-1]  # [batch, n - 1, vocab]: predicting seq[:, n+1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, n + 1:].reshape(-1))


def knowledge_loss(model, cfg: TrainConfig, facts: Facts, pad_id: int, gen: torch.Generator) -> torch.Tensor:
    """Next-token loss on the category tokens of ``batch_size`` sequences of ``knowledge_facts`` facts."""
    ids, labels = facts.batch(cfg.batch_size, cfg.knowledge_facts, pad_id, gen)  # [batch, len] each
    logits = model(input_ids=ids).logits  # [batch, len, vocab]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


@torch.no_grad()
def evaluate(model, data: Encoded, batch_size: int = 256) -> float:
    """Accuracy: argmax of the next-token logits over the candidates' first tokens."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(data), batch_size):
        index = torch.arange(start, min(start + batch_size, len(data)))
        ids, last, cands, gold = data.batch(index)
        logits = answer_logits(model, ids, last)  # [b, vocab]
        picked = logits.gather(1, cands).argmax(-1)  # [b]
        correct += int((picked == gold).sum())
    model.train(was_training)
    return correct / len(data)


def subject_order(cfg: TrainConfig, prompts: list[Any]) -> list[str]:
    """The curriculum's order of question subjects: a shuffle fixed by the seed."""
    names = sorted({str(p.meta.get("subject")) for p in prompts})
    perm = torch.randperm(len(names), generator=torch.Generator().manual_seed(cfg.seed))
    return [names[i] for i in perm.tolist()]


def curriculum_ranks(cfg: TrainConfig, prompts: list[Any]) -> torch.Tensor:
    """[n] each prompt's subject rank in the curriculum order (all 0 without a curriculum)."""
    if not cfg.curriculum_steps:
        return torch.zeros(len(prompts), dtype=torch.long)
    if any(p.meta.get("subject") is None for p in prompts):
        raise GascanError("--curriculum-steps needs prompts that name their subject", "drop --curriculum-steps")
    rank = {name: i for i, name in enumerate(subject_order(cfg, prompts))}
    return torch.tensor([rank[str(p.meta["subject"])] for p in prompts], dtype=torch.long)


def heldout_prompts(cfg: TrainConfig, train_texts: set[str]) -> list[Any]:
    """``cfg.test_size`` fresh prompts over the training words, none identical to a training prompt.

    Category knowledge of a word can only come from training on it, so held-out accuracy is measured
    on new questions (new option sets, orders, phrasings) over the training words, not on unseen words.
    """
    prompts = task_prompts(cfg.task, "train", cfg.seed + TEST_SEED_OFFSET, 2 * cfg.test_size, cfg.task_options)
    fresh = [p for p in prompts if p.text not in train_texts][: cfg.test_size]
    if len(fresh) < cfg.test_size:
        raise GascanError(f"only {len(fresh)} of {cfg.test_size} test prompts differ from the training prompts",
                          "use a task setting with more distinct prompts, or a smaller --test-size")
    return fresh


def prepare_out_dir(out: Path, overwrite: bool) -> None:
    """Create ``out`` (or check it is reusable) and prove it is writable, before any training."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise GascanError(f"cannot write to output directory {str(out)!r} ({err.strerror or err})",
                          "choose a writable --out path") from None
    entries = [p for p in out.iterdir() if not p.name.startswith(".")]
    if not entries:
        return
    is_toy_run = (out / "training.json").exists() or (out / CHECKPOINT_DIR).is_dir()
    if not overwrite or not is_toy_run:
        raise GascanError(
            f"output directory {str(out)!r} is not empty",
            "pass --overwrite to replace a previous toy run there, or choose an empty --out"
            if is_toy_run else "choose an empty or new --out directory",
        )
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)


def _swap_in(tmp: Path, dest: Path) -> None:
    """Replace ``dest`` by the complete directory ``tmp`` with renames (readers never see half)."""
    trash = None
    if dest.exists():
        trash = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
        os.rename(dest, trash / dest.name)
    os.rename(tmp, dest)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def save_model_dir(model, tokenizer, meta: dict[str, Any], dest: Path, keep: Path | None = None) -> Path:
    """Write model (safetensors), tokenizer and ``training.json`` to ``dest`` atomically.

    ``keep`` is a subdirectory of the old ``dest`` (the checkpoint series) moved into the new one.
    """
    from transformers.utils import logging as hf_logging

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    bars_on = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.disable_progress_bar()  # a shard bar per checkpoint would break our own bar
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _write_json(tmp / "training.json", meta)
        if keep is not None and keep.exists():
            os.rename(keep, tmp / keep.name)
        _swap_in(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()
    return dest


# settings command_line writes first (arch, task, seed, steps), formats itself (lists, task options) or
# that have no command-line flag (grad_clip)
_NOT_SCALAR_FLAGS = frozenset({"arch", "task", "seed", "steps", "attn_layers", "save_at", "task_options", "grad_clip"})


def command_line(cfg: TrainConfig, out: Path | str) -> str:
    """The ``gascan toy train`` command that reproduces ``cfg`` (non-default options only)."""
    default = TrainConfig()
    parts = ["gascan", "toy", "train", "--arch", cfg.arch, "--task", cfg.task, "--seed", str(cfg.seed),
             "--out", str(out), "--steps", str(cfg.steps)]
    for name in TrainConfig.__dataclass_fields__:  # every scalar setting, so a new one needs no edit here
        if name in _NOT_SCALAR_FLAGS:
            continue
        value = getattr(cfg, name)
        if value != getattr(default, name):
            parts += [f"--{name.replace('_', '-')}", str(value)]
    if cfg.attn_layers is not None:
        parts += ["--attn-layers", ",".join(map(str, cfg.attn_layers))]
    if cfg.save_at:
        parts += ["--save-at", ",".join(map(str, sorted(cfg.save_at)))]
    for key, value in cfg.task_options.items():
        text = value.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t") if isinstance(value, str) \
            else json.dumps(value)
        parts += ["--task-option", shlex.quote(f"{key}={text}")]
    return " ".join(parts)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  test acc {task.fields[acc]}  unseen-word acc {task.fields[unseen]}"), TimeElapsedColumn(),
        console=Console(stderr=True), disable=not enabled, transient=False,
    )


def train(cfg: TrainConfig, out_dir: Path | str, *, progress: bool = True, overwrite: bool = False) -> TrainResult:
    """Train one toy model per ``cfg`` and save it (plus its checkpoint series) under ``out_dir``."""
    import tokenizers
    import transformers

    cfg.validate()
    resolved_options = check_task_options(cfg.task, cfg.task_options)
    out = Path(out_dir)
    prepare_out_dir(out, overwrite)
    started = time.time()
    load_start = os.getloadavg()[0]
    with deterministic(cfg.threads):
        train_prompts = task_prompts(cfg.task, "train", cfg.seed, cfg.train_size, cfg.task_options)
        test_prompts = heldout_prompts(cfg, {p.text for p in train_prompts})
        unseen_prompts = (task_prompts(cfg.task, "test", cfg.seed + 2 * TEST_SEED_OFFSET, cfg.test_size,
                                       cfg.task_options) if has_word_splits(cfg.task) else [])
        labels = sorted({c for p in train_prompts for c in p.candidates})
        required = [":", "\n"] + (labels if len(labels) <= 128 else [])
        tokenizer = train_tokenizer(corpus_texts(train_prompts), cfg.vocab_size, required)
        check_single_tokens(tokenizer, required)
        train_data = encode(train_prompts, tokenizer)
        test_data = encode(test_prompts, tokenizer)
        unseen_data = encode(unseen_prompts, tokenizer) if unseen_prompts else None
        for name, data in (("train", train_data), ("test", test_data)):
            firsts = data.candidates.sort(dim=1).values  # [n, k]
            if bool((firsts[:, 1:] == firsts[:, :-1]).any()):
                raise GascanError(f"two candidates of a {name} prompt share their first token",
                                  "use candidates that start differently (or a larger --vocab-size)")
        special = {"vocab_size": len(tokenizer), "bos": tokenizer.bos_token_id,
                   "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
        model = build_model(cfg, special)
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        order_gen = torch.Generator().manual_seed(cfg.seed)
        induction_gen = torch.Generator().manual_seed(cfg.seed + 17)
        knowledge_gen = torch.Generator().manual_seed(cfg.seed + 29)
        facts = category_facts(tokenizer, resolved_options) if cfg.knowledge_weight else None
        specials = set(tokenizer.all_special_ids)
        plain_ids = torch.tensor([i for i in range(len(tokenizer)) if i not in specials])
        gold_tokens = train_data.gold_tokens()  # [n_train]
        subject_rank = curriculum_ranks(cfg, train_prompts)  # [n_train]; the curriculum admits rank < k
        n_subjects = int(subject_rank.max()) + 1
        save_steps = cfg.checkpoint_steps()

        meta_base: dict[str, Any] = {
            "command": command_line(cfg, out),
            "arch": cfg.arch, "task": cfg.task, "seed": cfg.seed, "task_options": cfg.task_options,
            "task_options_resolved": {k: v for k, v in resolved_options.items() if k not in ("seed", "n", "split")},
            "model_class": type(model).__name__, "parameters": n_params, "vocab_size": len(tokenizer),
            "config": cfg.to_dict(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__, "python": platform.python_version()},
            "train_prompts": len(train_data), "test_prompts": len(test_data),
            "curriculum": {"steps_per_doubling": cfg.curriculum_steps,
                           "subject_order": subject_order(cfg, train_prompts) if cfg.curriculum_steps else None},
            "test_split": TEST_SPLIT_NOTE, "unseen_words_split": UNSEEN_NOTE if unseen_data else None,
            "example_prompt": test_prompts[0].text,
        }
        history: list[dict[str, Any]] = []
        checkpoints: list[Path] = []
        recent: list[float] = []
        acc = evaluate(model, test_data)
        unseen = evaluate(model, unseen_data) if unseen_data else None
        history.append({"step": 0, "loss": None, "test_accuracy": acc, "unseen_words_accuracy": unseen,
                        "subjects": cfg.subjects_at(0, n_subjects) if cfg.curriculum_steps else None,
                        "seconds": 0.0})
        admitted = cfg.subjects_at(0, n_subjects)
        pool = torch.nonzero(subject_rank < admitted)[:, 0]  # [n_pool] training rows in play
        order = pool[torch.randperm(len(pool), generator=order_gen)]
        cursor = 0
        step = 0
        stopped_by = "steps"
        t0 = time.perf_counter()
        with _progress(progress) as bar, fast_mamba1(model):  # Mamba-1 mixers: the training-speed scan
            task_id = bar.add_task(f"{cfg.arch}/{cfg.task} seed {cfg.seed}", total=cfg.steps,
                                   loss="   -  ", acc=f"{acc:.3f}", unseen=_fmt(unseen))
            while step < cfg.steps:
                want = cfg.subjects_at(step, n_subjects)
                if want != admitted or cursor + cfg.batch_size > len(order):
                    admitted = want
                    pool = torch.nonzero(subject_rank < admitted)[:, 0]
                    order = pool[torch.randperm(len(pool), generator=order_gen)]
                    cursor = 0
                index = order[cursor: cursor + cfg.batch_size]  # [batch]
                cursor += cfg.batch_size
                ids, last, _, _ = train_data.batch(index)
                logits = answer_logits(model, ids, last)  # [batch, vocab]
                answer_loss = F.cross_entropy(logits, gold_tokens[index])
                loss = answer_loss  # the loss reported (history, progress bar) is the answer loss alone
                if cfg.induction_weight and (not cfg.induction_steps or step < cfg.induction_steps):
                    loss = loss + cfg.induction_weight * induction_loss(model, cfg, plain_ids, induction_gen)
                if facts is not None:
                    loss = loss + cfg.knowledge_weight * knowledge_loss(model, cfg, facts, tokenizer.pad_token_id,
                                                                        knowledge_gen)
                if cfg.decay_steps:
                    for group in optimizer.param_groups:
                        group["lr"] = cfg.lr_at(step)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                step += 1
                recent = (recent + [float(answer_loss.detach())])[-cfg.eval_every:]
                elapsed = time.perf_counter() - t0
                over_budget = cfg.time_budget is not None and elapsed >= cfg.time_budget
                if step % cfg.eval_every == 0 or step in save_steps or step == cfg.steps or over_budget:
                    acc = evaluate(model, test_data)
                    unseen = evaluate(model, unseen_data) if unseen_data else None
                    mean_loss = sum(recent) / len(recent)
                    history.append({"step": step, "loss": mean_loss, "test_accuracy": acc,
                                    "unseen_words_accuracy": unseen,
                                    "subjects": admitted if cfg.curriculum_steps else None,
                                    "seconds": round(time.perf_counter() - t0, 2)})
                    bar.update(task_id, loss=f"{mean_loss:.3f}", acc=f"{acc:.3f}", unseen=_fmt(unseen))
                    if progress and not bar.console.is_terminal:  # a log file gets a line per evaluation
                        bar.console.print(f"step {step}/{cfg.steps}: loss {mean_loss:.3f}, test acc {acc:.3f}, "
                                          f"unseen-word acc {_fmt(unseen)}, {elapsed:.0f} s")
                    if step in save_steps and not over_budget:
                        dest = out / CHECKPOINT_DIR / f"step-{step:06d}"
                        meta = {**meta_base, "step": step, "test_accuracy": acc,
                                "unseen_words_accuracy": unseen,
                                "subjects": admitted if cfg.curriculum_steps else None, "train_loss": mean_loss,
                                "train_seconds": round(time.perf_counter() - t0, 2)}
                        checkpoints.append(save_model_dir(model, tokenizer, meta, dest))
                bar.update(task_id, completed=step)
                if over_budget:
                    stopped_by = "time_budget"
                    break
        train_seconds = time.perf_counter() - t0
        final_loss = sum(recent) / len(recent) if recent else None
        meta = {
            **meta_base, "step": step, "steps": step, "stopped_by": stopped_by, "test_accuracy": acc,
            "unseen_words_accuracy": unseen,
            "final_train_loss": final_loss, "train_seconds": round(train_seconds, 2),
            "wall_seconds": round(time.time() - started, 2),
            "load_average": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
            "threads": cfg.threads, "history": history,
            "checkpoints": [str(p.relative_to(out)) for p in checkpoints],
        }
        save_model_dir(model, tokenizer, meta, out, keep=out / CHECKPOINT_DIR)
    return TrainResult(out_dir=out, steps=step, test_accuracy=acc, final_train_loss=final_loss,
                       train_seconds=train_seconds, history=history,
                       checkpoints=[out / CHECKPOINT_DIR / p.name for p in checkpoints])
