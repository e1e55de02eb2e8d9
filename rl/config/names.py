"""The names a config key could have meant: the keys a schema declares at a path, and the nearest of them.

Used by the config errors (`rl.config.load`, `rl.config.command_line`) to end a line about a mistyped key
or option with ``did you mean trainer.iterations?``.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable
from typing import Any

from rl.config.schema import RunConfig


def schema_at(dotted: str) -> type | None:
    """The schema dataclass of the node at ``dotted`` (``""``: the run), or None where the node is a
    free-form dict (``env.kwargs``, ``sandbox``) or not a node of the schema at all."""
    node: Any = RunConfig
    for part in [p for p in dotted.split(".") if p]:
        if not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = _dataclass_of(hints[part])
    return node if dataclasses.is_dataclass(node) else None


def _dataclass_of(hint: Any) -> Any:
    """``X`` for a hint ``X`` or ``X | None`` where X is a dataclass; else the hint itself."""
    for arg in typing.get_args(hint) or (hint,):
        if dataclasses.is_dataclass(arg):
            return arg
    return hint


def schema_keys(dotted: str) -> list[str] | None:
    """The keys the schema declares under ``dotted``; None where it declares none (a free-form dict). The
    ``sandbox`` group's are AgentENV's `SandboxConfig` fields and ``hosts`` (`rl.config.checks`)."""
    if dotted == "sandbox":
        from agentenv.config import SandboxConfig

        return [f.name for f in dataclasses.fields(SandboxConfig)] + ["hosts"]
    schema = schema_at(dotted)
    return None if schema is None else [f.name for f in dataclasses.fields(schema)]


def nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``candidates`` closest to ``name`` (a typo, a singular for a plural, a prefix)."""
    candidates = sorted(set(candidates))
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.6)
    prefixed = [c for c in candidates if c.startswith(name) or name.startswith(c)] if len(name) > 2 else []
    return list(dict.fromkeys([*close, *prefixed]))[:n]


def did_you_mean(parent: str, name: str, candidates: Iterable[str]) -> str:
    """``"; did you mean trainer.iterations?"`` (near names spelt in full), or ``""`` when none is near."""
    near = [f"{parent}.{c}" if parent else c for c in nearest(name, candidates)]
    return f"; did you mean {' or '.join(near)}?" if near else ""
