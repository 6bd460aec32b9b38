"""A small byte-level BPE tokenizer trained on a task corpus, saved as a normal HF tokenizer.

Byte level, so any text encodes (test-split words never seen in training split into known
pieces); a few hundred merges, so the model is small; a ``<|bos|>`` prepended by the tokenizer
itself, so every consumer that calls ``tokenizer(text)`` sees the same ids the model was trained on.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import GascanError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, required: Sequence[str] = ()):
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts``.

    ``required`` strings (answer labels such as ``" A"``, ``":"``, ``"\\n"``) must each encode to
    exactly one token; a corpus in which they are too rare to be merged raises :class:`GascanError`.
    Returns a ``PreTrainedTokenizerFast`` with bos/eos/pad set.
    """
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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1024,
        padding_side="right", clean_up_tokenization_spaces=False,
    )
    check_single_tokens(fast, required)
    return fast


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
