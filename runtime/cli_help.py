"""Help text and "did you mean" for the `meshrl` command, built from the pydantic config models.

`meshrl rl --help` lists the root's options (dotted name, type, default, the first line of the
field's docstring) and its sections; `meshrl rl --help trainer.loss` lists one section. Nothing
here imports torch: help and config mistakes are answered in well under a second.
`suggest(cls, loc)` finds the closest known key for an unknown one (difflib), searching the
section the key was given in first, then every dotted key of the config.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DOCS = "docs/configs.md"
COMMAND_LINE = "[@ more.toml ...] [--dotted.key value ...]"
HEAD_WIDTH = 38


def models_in(annotation) -> list[type[BaseModel]]:
    """Pydantic model classes inside an annotation (unions, Annotated, Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def type_name(annotation) -> str:
    """A short type for help lines: int, float, "a|b", section, list[int], ... ("none" for None)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in typing.get_args(annotation)]
        return "section" if all(n == "section" for n in names) else "|".join(dict.fromkeys(names))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is type(None):
        return "none"
    if origin is not None:
        return f"{origin.__name__}[{','.join(type_name(a) for a in typing.get_args(annotation))}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True) if field.default is PydanticUndefined else field.default
    if isinstance(value, BaseModel):
        return ""
    return "unset" if value is None else json.dumps(list(value) if isinstance(value, tuple) else value)


def first_line(doc: str | None, limit: int = 100) -> str:
    """The first sentence of a docstring, at most `limit` characters (help shows one line per field)."""
    text = " ".join((doc or "").split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    text = match.group(1) if match else text
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def is_section(field: FieldInfo) -> bool:
    """A field holding a section (a model or a union of models, possibly optional) rather than a value."""
    return bool(models_in(field.annotation)) and type_name(field.annotation) in ("section", "section|none")


def _option_line(dotted: str, field: FieldInfo) -> str:
    """`  --dotted.key TYPE   [default] first line of the docstring` (long heads put the doc below)."""
    head = f"  --{dotted.replace('_', '-')} {type_name(field.annotation)}"
    default = default_text(field)
    doc = f"[{default}] " if default else ""
    doc += first_line(field.description)
    return f"{head.ljust(HEAD_WIDTH)} {doc}" if len(head) < HEAD_WIDTH else f"{head}\n{' ' * HEAD_WIDTH} {doc}"


def _option_lines(prefix: str, model: type[BaseModel]) -> list[str]:
    return [_option_line(prefix + name, field) for name, field in model.model_fields.items() if not is_section(field)]


def field_at(cls: type[BaseModel], dotted: str) -> FieldInfo | None:
    """The field at a dotted path through sections (first kind of a union that has it), or None."""
    *parents, last = dotted.split(".")
    models = [cls]
    for part in parents:
        models = [m for model in models if part in model.model_fields
                  for m in models_in(model.model_fields[part].annotation)]
    return next((model.model_fields[last] for model in models if last in model.model_fields), None)


def _section_lines(prefix: str, model: type[BaseModel]) -> list[str]:
    rows = [(prefix + name, first_line(field.description)) for name, field in model.model_fields.items()
            if is_section(field)]
    width = max((len(r[0]) for r in rows), default=0) + 2
    return [f"  {name.ljust(width)}{doc}" for name, doc in rows]


def resolve(cls: type[BaseModel], dotted: str) -> list[tuple[str, type[BaseModel]]]:
    """(title, model) of the section at `dotted` ("trainer.loss"; a union such as "env" gives one
    entry per kind, "env.wordle" one kind). ValueError with a suggestion for an unknown path."""
    found: list[tuple[str, type[BaseModel]]] = [("", cls)]
    for part in dotted.replace("-", "_").split("."):
        nxt = []
        for title, model in found:
            field = model.model_fields.get(part)
            if field is not None and is_section(field):
                members = models_in(field.annotation)
                path = f"{title}.{part}" if title else part
                nxt += [(path if len(members) == 1 else f"{path} (name = {_tag(m)!r})", m) for m in members]
            else:  # a union's kind by its tag: "env.wordle"
                nxt += [(title, model) for model in [model] if _tag(model) == part.replace("_", "-")]
        if not nxt:
            hint = suggest(cls, dotted.replace("-", "_").split("."))
            raise ValueError(f"no section {dotted!r} in {cls.__name__}{hint}")
        found = nxt
    return found


def _tag(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("name")
    return field.default if field is not None and isinstance(field.default, str) else None


def command_help(command: str, cls: type[BaseModel], summary: str, section: str | None = None,
                 main: tuple[str, ...] | None = None) -> str:
    """The text of `meshrl COMMAND --help [SECTION]`; `main`: dotted keys of sections listed with the
    root's own options (those the config does not have are skipped)."""
    lines = [f"usage: meshrl {command} @ config.toml {COMMAND_LINE}", f"       meshrl {command} --help [SECTION]", ""]
    if section is None:
        common = [_option_line(key, f) for key in main or () if (f := field_at(cls, key)) is not None]
        lines += [summary, "", "options [default]:", *_option_lines("", cls)]
        lines += ["", "main options of the sections:", *common] if common else []
        lines += ["",
                  f"sections (`meshrl {command} --help SECTION` lists one, e.g. `--help trainer.optim`):",
                  *_section_lines("", cls)]
    else:
        for title, model in resolve(cls, section):
            lines += [f"[{title}] {first_line(model.__doc__)}", "", "options [default]:",
                      *_option_lines(title.split(" ")[0] + ".", model)]
            subsections = _section_lines(title.split(" ")[0] + ".", model)
            lines += (["", "sections:", *subsections] if subsections else []) + [""]
    lines += ["", f"Every field, with its constraints: {DOCS}. Values parse as TOML (3e-6, true, [1, 2], '\"x\"')."]
    return "\n".join(lines).rstrip() + "\n"


def all_keys(cls: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every dotted key of a config (sections included), kinds of unions merged."""
    for name, field in cls.model_fields.items():
        yield prefix + name
        for model in models_in(field.annotation):
            if prefix.count(".") < 4:
                yield from all_keys(model, f"{prefix}{name}.")


def suggest(cls: type[BaseModel], loc: list[str]) -> str:
    """"; did you mean 'x.y'?" for the unknown key at `loc` (a list of names), or "" if nothing is close."""
    *parents, last = loc
    shown: list[str] = []  # the location without the tags of unions ("env.reverse-text.x" -> "env.x")
    models: list[type[BaseModel]] = [cls]
    for part in parents:
        inner = [m for model in models if part in model.model_fields
                 for m in models_in(model.model_fields[part].annotation)]
        if inner:
            shown.append(part)
        models = inner or [model for model in models if _tag(model) == part]
    siblings = {name for model in models for name in model.model_fields}
    close = difflib.get_close_matches(last, sorted(siblings), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {'.'.join([*shown, close[0]])!r}?"
    loc = [*shown, last]
    keys = sorted(set(all_keys(cls)))
    by_last = {}
    for key in keys:
        by_last.setdefault(key.rsplit(".", 1)[-1], key)
    close = difflib.get_close_matches(last, sorted(by_last), n=1, cutoff=0.8)
    if close:
        return f"; did you mean {by_last[close[0]]!r}?"
    close = difflib.get_close_matches(".".join(loc), keys, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""
