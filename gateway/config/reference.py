"""The settings reference (docs/settings.md), generated from the models themselves: every key as a
dotted path, its type, its default and one line of meaning, so that no setting goes unnamed and
the page cannot drift from the code. `kvgate config reference` prints it."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.config.settings import Settings, _is_list, _model_in

REFERENCE_COMMAND = "kvgate config reference > docs/settings.md"

_HEADER = f"""# Settings reference

Part of kvgate's documentation; the [README](../README.md) is the start, and
[configuration.md](configuration.md) says how the file is read and which page explains each block.

Every key of the config file, generated from the configuration schema (`gateway/config/`) by
`kvgate config reference`: do not edit this page by hand (`{REFERENCE_COMMAND}`
writes it; a test fails when it is stale). A key is a dotted path; `[]` stands for each item of a
list (`pools[].engines.replicas`). Any key can be set from the environment instead: `KVGATE_`,
then the path in capitals with `__` between its parts (`KVGATE_SCHEDULER__MAX_QUEUE=200`; a list
as JSON or comma-separated). "unset" is YAML's `null`: the setting is off or takes the default the
meaning names."""

_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)
_NAMES = {str: "string", int: "int", float: "float", bool: "bool", type(None): "null"}


def settings_reference() -> str:
    """The whole page, Markdown, ending in one newline."""
    out = [_HEADER]
    for key, info in setting_keys():
        if "." not in key.removesuffix("[]"):  # a top-level block: its own section
            out += ["", f"## `{key.removesuffix('[]')}`", "", _cell(_meaning(info)), ""]
            out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        else:
            cells = (f"`{key}`", _type(info), _default(info), _meaning(info))
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def setting_keys(model: type[BaseModel] = Settings, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every setting, depth first, as (dotted key, its field): a block, then the keys inside it."""
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        yield key, info
        sub = _model_in(info.annotation)
        if sub is not None:
            yield from setting_keys(sub, key + ("[]" if _is_list(info.annotation) else ""))


def _meaning(info: FieldInfo) -> str:
    return " ".join((info.description or "").split())


def _type(info: FieldInfo) -> str:
    text = _type_name(info.annotation)
    bounds = []
    for meta in info.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                bounds.append(f"{sign} {getattr(meta, attr):g}")
        if isinstance(meta, annotated_types.MinLen) and meta.min_length:
            bounds.append(f"at least {meta.min_length} long")
        if isinstance(meta, annotated_types.MaxLen):
            bounds.append(f"at most {meta.max_length} long")
    return ", ".join([text, *bounds])


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(f"`{v}`" for v in args)
    if origin in (typing.Union, types.UnionType):
        shown = [a for a in args if a is not type(None)]  # None shows as "unset" in the default
        return " | ".join(_type_name(a) for a in shown)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    if annotation is Any:
        return "any"
    return _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]  # the models' factories take no data
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return ""  # a block: its keys follow, each with its default
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [item.model_dump(exclude_defaults=True) for item in value]
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 20)
    return "`" + text.removesuffix("\n").removesuffix("\n...") + "`"


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table: a `|` would end the cell."""
    return text.replace("|", "\\|")
