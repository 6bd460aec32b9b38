"""A small byte-level BPE tokenizer trained on a task corpus, saved as a normal HF tokenizer.

Byte level, so any text encodes (test-split words never seen in training split into known
pieces); a few hundred merges, so the model is small; a ``<|bos|>`` prepended by the tokenizer
itself, so every consumer that calls ``tokenizer(text)`` sees the same ids the model was trained on.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from discovery.errors import GascanError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, required: Sequence[str] = ()):
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts``.

    ``required`` strings (answer labels such as ``" A"``, ``":"``, ``"\\n"``) must each encode to
    exactly one token. When the corpus alone does not merge them (answers such as ``" 65"`` are each
    too rare), training is repeated with every required string added to the corpus often enough to
    be merged; if even that fails, :class:`GascanError`. Returns a ``PreTrainedTokenizerFast`` with
    bos/eos/pad set.
    """
    texts = list(texts)
    fast = _train(texts, vocab_size)
    if not _all_single(fast, required):
        boost = max(1000, len(texts) // 10)
        fast = _train(texts + [r for r in required for _ in range(boost)], vocab_size)
    check_single_tokens(fast, required)
    return fast


def _all_single(tokenizer, strings: Sequence[str]) -> bool:
    return all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 1 for t in strings)


def _train(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1024,
        padding_side="right", clean_up_tokenization_spaces=False,
    )


def check_single_tokens(tokenizer, strings: Sequence[str]) -> list[int]:
    """Return the one token id of each string; raise if any string takes more than one token."""
    ids = []
    for text in strings:
        enc = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            pieces = tokenizer.convert_ids_to_tokens(enc)
            raise GascanError(
                f"{text!r} is not a single token in the trained tokenizer (pieces: {pieces})",
                "train on a larger corpus (--train-size) or a larger --vocab-size so the label is merged",
            )
        ids.append(enc[0])
    return ids
