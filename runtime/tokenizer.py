"""A character-level tokenizer built in code, for tiny models, tests and CPU demos.

No files or hub access are needed: the vocabulary is three special tokens followed by the
printable ASCII characters, one token each. Saved with ``save_pretrained`` next to a model,
the folder loads with ``AutoTokenizer.from_pretrained`` like any other checkpoint.

Vocabulary: ``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2, then `CHARACTERS` in order.
Encoding gives exactly one id per character and adds no bos/eos; characters outside the
vocabulary are dropped (there is no unknown token).
"""

import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = ["CHARACTERS", "SPECIAL_TOKENS", "build_char_tokenizer", "save_tokenizer", "load_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
# string.printable minus vertical tab, form feed and carriage return; "\t", "\n" and " " stay.
CHARACTERS = "".join(c for c in string.printable if c not in "\x0b\x0c\r")


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """The char-level tokenizer with ``pad_token``, ``eos_token`` and ``bos_token`` set.

    `vocab_size`: pad the vocabulary with ``<extra_i>`` tokens (never produced by encoding) up to
    this size, so that a model of a real shape keeps its real vocabulary (benchmarks)."""
    tokens = SPECIAL_TOKENS + tuple(CHARACTERS)
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size must be >= {len(tokens)}, got {vocab_size}")
        tokens += tuple(f"<extra_{i}>" for i in range(vocab_size - len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    # BPE with no merges maps each character to its own token, and with no normaliser and
    # no pre-tokeniser nothing (spaces, newlines) is merged, split off or rewritten.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()  # join tokens with no separator
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """Write the tokenizer files into the folder ``path`` (created if missing)."""
    tokenizer.save_pretrained(str(path))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer folder with ``AutoTokenizer``, offline."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer at {folder}: expected {folder / 'tokenizer.json'} (see save_tokenizer)")
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
