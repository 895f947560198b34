"""Tokenizers built in code, for tiny models, tests and CPU demos, and loading a saved one.

No files or hub access are needed. Saved with ``save_pretrained`` next to a model, the folder
loads with ``AutoTokenizer.from_pretrained`` like any other checkpoint.

`build_char_tokenizer`: three special tokens followed by the printable ASCII characters, one
token each. Vocabulary: ``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2, then `CHARACTERS` in order.
Encoding gives exactly one id per character and adds no bos/eos; characters outside the
vocabulary are dropped (there is no unknown token).

`build_bpe_tokenizer`: a real byte-level BPE (the tokenizers library's trainer) learnt from a
small corpus, shaped like a chat model's: special tokens ``<|endoftext|>`` (eos), ``<|pad|>``,
``<|im_start|>``, ``<|im_end|>``, a ChatML chat template, and two stop ids (end of text and end
of turn), so the runtime is exercised on what real checkpoints look like, offline.

Several stop ids: a tokenizer's ``stop_tokens`` (a tokenizer_config.json entry) name tokens that
end a turn besides eos; `load_tokenizer` adds a model folder's generation_config.json
``eos_token_id`` list to them (envs/base.py's `stop_token_ids` reads them).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built or loaded (it takes seconds)
    from transformers import PreTrainedTokenizerFast

__all__ = ["BPE_SPECIAL_TOKENS", "CHARACTERS", "CHATML_TEMPLATE", "SPECIAL_TOKENS", "build_bpe_tokenizer",
           "build_char_tokenizer", "save_tokenizer", "load_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
# string.printable minus vertical tab, form feed and carriage return; "\t", "\n" and " " stay.
CHARACTERS = "".join(c for c in string.printable if c not in "\x0b\x0c\r")


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """The char-level tokenizer with ``pad_token``, ``eos_token`` and ``bos_token`` set.

    `vocab_size`: pad the vocabulary with ``<extra_i>`` tokens (never produced by encoding) up to
    this size, so that a model of a real shape keeps its real vocabulary (benchmarks)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

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


BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen's instruct models write chats (without tools or thinking)."""
_BPE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is two plus three? Two plus three is five.\n"
    "Reverse the word: hello. olleh. Please answer with one word. Yes, no, maybe, thank you.\n"
    "0123456789 + - * / = ( ) [ ] { } : ; , . ! ? ' \" the and of to in is you that it for on with as\n"
)


def build_bpe_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer learnt from ``corpus`` (default: a few built-in lines), with the
    special tokens, chat template and stop tokens described in the module docstring.

    Every byte has a token, so any text encodes and decodes back exactly. Training is
    deterministic: the same corpus gives the same vocabulary and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(list(corpus) if corpus is not None else _BPE_CORPUS.splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        chat_template=CHATML_TEMPLATE,
        stop_tokens=["<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """Write the tokenizer files into the folder ``path`` (created if missing)."""
    tokenizer.save_pretrained(str(path))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer folder with ``AutoTokenizer``, offline."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer at {folder}: expected {folder / 'tokenizer.json'} (see save_tokenizer)")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    generation = folder / "generation_config.json"
    if generation.is_file():  # a model folder: its generation config may list several eos ids
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        stop = list(tokenizer.init_kwargs.get("stop_tokens") or [])
        for token in tokenizer.convert_ids_to_tokens([i for i in ids if i != tokenizer.eos_token_id]):
            if token not in stop:
                stop.append(token)
        if stop:
            tokenizer.init_kwargs["stop_tokens"] = stop
    return tokenizer
