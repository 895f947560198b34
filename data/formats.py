"""A row -> a `Document`: token ids and which of them the loss trains on.

Formats (``resolve_format`` picks one from the columns when asked for "auto", in this order):

- ``messages``: a list of ``{"role": ..., "content": ...}`` (other keys are passed on to the
  template). Rendered with the chat template (the tokenizer's, from the model folder's
  tokenizer_config.json / chat_template.jinja, or one given as ``chat_template``) through
  transformers' ``apply_chat_template``.
- ``prompt_completion``: columns ``prompt`` and ``completion``. Two strings are tokenized as
  they are, prompt then completion then eos (no template). Two lists of messages are one chat:
  the prompt's messages are context, the completion's are trained (as TRL's conversational
  prompt-completion rows).
- ``text``: a string, tokenized as it is, then eos; every token is trained.

Which tokens are trained (``loss_on``) in a chat:

- ``assistant`` (default): every assistant message's tokens, from the first token after the
  template's generation prompt (e.g. after "<|im_start|>assistant\\n") to the end of the message
  as the template writes it, its end-of-turn token included, so the model learns to stop;
- ``last_turn``: the last assistant message only; ``all``: every token.

The assistant spans come from rendering prefixes of the chat: message i's text is what the
full chat renders to up to messages[:i+1], past the render of messages[:i] with the generation
prompt. A template that does not render a chat's beginning as a prefix of the whole (some
rewrite earlier turns) is refused with a message naming ``chat_template``, which can override it.
The text is then tokenized once (a fast tokenizer's offsets map characters to tokens); a token
is trained when it starts inside an assistant span.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sources import RowError

__all__ = ["COLUMNS", "FORMATS", "LOSS_ON", "Document", "Formatter", "chat_prompt", "check_messages",
           "read_template", "resolve_format"]

FORMATS = ("messages", "prompt_completion", "text")
COLUMNS: dict[str, tuple[str, ...]] = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"),
                                       "text": ("text",)}
LOSS_ON = ("assistant", "last_turn", "all")


@dataclass
class Document:
    """One training document: token ids and, per token, whether it is a loss target."""

    ids: list[int]
    trained: list[bool]

    def as_example(self) -> tuple[list[int], list[int], list[bool]]:
        """(prompt, completion, completion mask) for runtime/train/packing.py's `pack_sft`: the first
        token is the prompt (it is never a target), the rest the completion with its mask."""
        return self.ids[:1], self.ids[1:], self.trained[1:]

    @property
    def num_trained(self) -> int:
        return sum(self.trained[1:])


def resolve_format(fmt: str, columns: list[str], where: str) -> str:
    """The format for rows with ``columns``: ``fmt`` itself if its columns are there, or for "auto"
    the first of FORMATS whose columns are; ValueError naming the columns the data has."""
    if fmt != "auto":
        missing = [c for c in COLUMNS[fmt] if c not in columns]
        if missing:
            raise ValueError(f"{where}: format {fmt!r} needs column(s) {', '.join(missing)}, but the data has "
                             f"columns {columns}")
        return fmt
    for name in FORMATS:
        if all(c in columns for c in COLUMNS[name]):
            return name
    raise ValueError(f"{where}: no known format's columns (messages; prompt + completion; text); the data has "
                     f"columns {columns}")


def read_template(value: str | None) -> str | None:
    """A ``chat_template`` setting: a path to a .jinja file (read), or the Jinja template itself."""
    if value is not None and value.endswith(".jinja"):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"chat_template: file not found: {value}")
        return path.read_text()
    return value


def check_messages(value: Any, what: str = "messages") -> list[dict[str, Any]]:
    """``value`` as a chat (a non-empty list of {role, content} objects), else RowError."""
    if not isinstance(value, list) or not value:
        raise RowError(f"{what} must be a non-empty list of {{role, content}} objects, got {_short(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"{what}[{i}] must be an object with string 'role' and 'content', got {_short(m)}")
    return value


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None) -> str:
    """The text of a chat followed by the template's generation prompt (what a model answers after)."""
    return _render(tokenizer, messages, template, add_generation_prompt=True)


class Formatter:
    """Turns rows of one format into Documents (module docstring)."""

    def __init__(self, tokenizer: Any, fmt: str, loss_on: str = "assistant", chat_template: str | None = None):
        assert fmt in FORMATS and loss_on in LOSS_ON, (fmt, loss_on)
        self.tokenizer, self.fmt, self.loss_on, self.template = tokenizer, fmt, loss_on, chat_template
        self.needs_template = fmt == "messages"
        if self.needs_template:
            check_template(tokenizer, chat_template)

    def __call__(self, row: dict[str, Any]) -> Document:
        """The row's Document; RowError for a malformed row."""
        if self.fmt == "text":
            return self._plain("", _string(row, "text"))
        if self.fmt == "messages":
            return self._chat(check_messages(row.get("messages")), 0)
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            return self._plain(prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            check_template(self.tokenizer, self.template)
            prompt, completion = check_messages(prompt, "prompt"), check_messages(completion, "completion")
            return self._chat(prompt + completion, len(prompt))
        raise RowError(f"prompt and completion must both be strings or both lists of messages, got "
                       f"{type(prompt).__name__} and {type(completion).__name__}")

    def _plain(self, prompt: str, completion: str) -> Document:
        tok = self.tokenizer
        if tok.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token: plain-text documents end with it")
        p = tok.encode(prompt, add_special_tokens=False) if prompt else []
        c = tok.encode(completion, add_special_tokens=False) + [tok.eos_token_id]
        train_prompt = self.fmt == "text" or self.loss_on == "all"
        return Document(p + c, [train_prompt] * len(p) + [True] * len(c))

    def _chat(self, messages: list[dict[str, Any]], first_trained: int) -> Document:
        """A chat whose assistant messages from index ``first_trained`` on are trained (per loss_on)."""
        text = _render(self.tokenizer, messages, self.template)
        spans = [] if self.loss_on == "all" else self._assistant_spans(messages, text, first_trained)
        if self.loss_on == "last_turn":
            spans = spans[-1:]
        if self.loss_on != "all" and not spans:
            raise RowError(f"no assistant message to train on (loss_on = {self.loss_on!r})")
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if self.loss_on == "all":
            return Document(list(ids), [True] * len(ids))
        trained = [any(a <= start < b for a, b in spans) for start, _ in offsets]
        return Document(list(ids), trained)

    def _assistant_spans(self, messages: list[dict[str, Any]], text: str, first: int) -> list[tuple[int, int]]:
        spans = []
        for i in range(first, len(messages)):
            if messages[i]["role"] != "assistant":
                continue
            before = _render(self.tokenizer, messages[:i], self.template, add_generation_prompt=True) if i else ""
            upto = _render(self.tokenizer, messages[: i + 1], self.template)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise RowError(f"the chat template does not render the chat's first {i + 1} messages as a prefix of "
                               "the whole chat, so assistant tokens cannot be located; set chat_template to a "
                               "template that does (docs/data.md)")
            spans.append((len(before), len(upto)))
        return spans


def check_template(tokenizer: Any, template: str | None) -> None:
    """ValueError unless there is a chat template (given, or the tokenizer's) and a fast tokenizer."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chats need a chat template: the model folder's tokenizer has none "
                         "(tokenizer_config.json / chat_template.jinja); set chat_template")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("chats need a fast tokenizer (tokenizer.json) to map template text to tokens")


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None,
            add_generation_prompt: bool = False) -> str:
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=template)
    except TemplateError as e:  # a syntax error, or the template's raise_exception naming what it refused
        raise RowError(f"the chat template failed on this chat: {e}") from None


def _string(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise RowError(f"{key!r} must be a string, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
