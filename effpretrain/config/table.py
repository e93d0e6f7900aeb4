"""The config reference, generated from the field docstrings and types (docs/reference/config.md)."""

from __future__ import annotations

import ast
import functools
import inspect
import types
import typing
from typing import Annotated, Any, Literal, Union

import yaml

from effpretrain.config.checks import _leaves
from effpretrain.config.fill import _type_name
from effpretrain.config.schema import RunConfig
from effpretrain.config.types import Check, OneOf

# The README's config table, generated from the field docstrings and types.


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a config dataclass (the string right under each field), each
    joined into one line."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _allowed(tp: Any) -> str:
    """The values a field takes, in words, from its type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return ", ".join(f"`{c}`" for c in typing.get_args(tp))
    if origin is list:
        inner = _allowed(typing.get_args(tp)[0])
        return f"a list of {inner}" if inner else "a list"
    if origin is dict:
        return "a mapping"
    if origin in (Union, types.UnionType):
        return " or ".join("`null`" if a is type(None) else _allowed(a) for a in typing.get_args(tp))
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        for m in meta:
            if isinstance(m, Check):
                return f"{_type_name(base)} {m.text}"
            if isinstance(m, OneOf):
                return m.where + (": " + ", ".join(f"`{n}`" for n in m.names()) if m.listed else "")
        return _type_name(base)
    return _type_name(tp)


def _yaml_text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).removesuffix("\n...\n").strip()


def config_table() -> str:
    """Markdown table of every YAML key: default, allowed values and meaning (README.md holds a
    copy that tests/test_config.py compares with this)."""
    rows = ["| key | default | values | meaning |", "|---|---|---|---|"]
    for key, value, tp, owner, name in _leaves(RunConfig()):
        cells = [f"`{key}`", f"`{_yaml_text(value)}`", _allowed(tp), field_docs(owner).get(name, "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
