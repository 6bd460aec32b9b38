"""A plain byte-level BPE tokenizer trained in code, for looking at tasks without a model.

``gascan tasks show`` uses it when no ``--model`` is given: GPT-2 style (byte-level
pre-tokenizer with GPT-2's split regex, no prefix space, byte-level decoder), trained with
``tokenizers`` on the task's own prompts and candidates, so it is real BPE and deterministic.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SPECIALS = ("<|endoftext|>", "<|pad|>")


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int = 600, min_frequency: int = 2) -> Any:
    """Train a GPT-2 style byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast``.

    The vocabulary has the 256 byte symbols, two specials (``<|endoftext|>`` as BOS/EOS,
    ``<|pad|>``) and merges up to ``vocab_size``. No BOS is added by default, as with GPT-2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(SPECIALS)),
        min_frequency=min_frequency,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIALS[0], eos_token=SPECIALS[0], pad_token=SPECIALS[1]
    )


def tokenizer_for_prompts(prompts: Iterable[Any], vocab_size: int = 600) -> Any:
    """A byte-level BPE trained on the prompts' texts and each text followed by each candidate.

    ``min_frequency=1``, so even a one-prompt file gets its candidates (" A") as single tokens.
    """
    corpus = []
    for p in prompts:
        corpus.append(p.text)
        corpus.extend(p.text[-40:] + c for c in p.candidates)
    return train_byte_level_bpe(corpus, vocab_size=vocab_size, min_frequency=1)
