"""One declarative loader for AgentENV's settings files and configs: a frozen dataclass is built from a YAML
mapping by its field types, and each field's constraints are declared next to it with `setting(...)`.

    @dataclass(frozen=True)
    class PoolSettings:
        memory_budget: Size
        idle_after_s: float = setting(min=0)
        pause_method: Literal["criu", "freeze"]

Types: int, float, bool, str, Path, Literal[...], `Size` (an int of bytes, parsed by `parse_size`),
tuple[str, ...] and dict[str, str]. Every error is a ConfigError naming where the value came from and the
key: "pool config conf/agentenv/pool.yaml: idle_after_s must be >= 0, got -1".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from agentenv.errors import ConfigError
from agentenv.paths import conf_dir, overridable_path

T = TypeVar("T")
_SIZE_MARK = "agentenv.settings.size"
Size = Annotated[int, _SIZE_MARK]  # a size in bytes: 512m, 1g, 64MiB or an int
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
Check = tuple[Callable[[Any], bool], str]  # (predicate on the converted value, "must be ..." when it fails)


def parse_size(value: str | int, what: str = "size") -> int:
    """'512m' / '1g' / '64MiB' / 1048576 -> bytes (binary units, as Docker reads them)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like '512m', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{what}: must be positive, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{what}: expected a size like '512m' or '1g', got {value!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return n


def setting(*, min: float | None = None, above: float | None = None, max: float | None = None,
            check: Check | None = None, default: Any = dataclasses.MISSING) -> Any:
    """A field with constraints: `min` (>=), `above` (>), `max` (<=), `check` (predicate, what it means)."""
    metadata = {"min": min, "above": above, "max": max, "check": check}
    return dataclasses.field(default=default, metadata=metadata)


def read_yaml_mapping(path: Path, what: str, hint: str = "") -> dict[str, Any]:
    """The mapping in a YAML file, or a ConfigError naming `what` and the file (for every agentenv config)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist" + (f" ({hint})" if hint else "")) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of keys to values")
    return data


def settings_path(env_var: str, file_name: str) -> Path:
    """An agentenv settings file: `$env_var` when set, else conf/agentenv/<file_name>."""
    return overridable_path(env_var, conf_dir() / "agentenv" / file_name)


def load_settings(cls: type[T], what: str, path: str | Path | None,
                  overrides: Mapping[str, Any] | None = None, *, env_var: str, file_name: str = "",
                  origins: Mapping[str, str] | None = None) -> T:
    """`cls` from the YAML file at `path` (default: `$env_var`, else conf/agentenv/<file_name>) with
    `overrides` on top (None values ignored). `what` names the file in errors ("pool config");
    `origins`: where an override came from, for its errors."""
    path = Path(path) if path is not None else settings_path(env_var, file_name)
    data = read_yaml_mapping(path, what, f"set {env_var} to another file")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    data.update(given)
    where = f"{what} {path}"
    named = {k: (origins or {}).get(k) or f"{where} (override)" for k in given}
    return build(cls, data, where, origins=named)


def build(cls: type[T], data: Mapping[str, Any], where: str, origins: Mapping[str, str] | None = None,
          *, key_prefix: str | None = None) -> T:
    """`cls` from `data`: exactly its fields (those with a default may be left out), each value converted
    by its type and checked against its constraints; ConfigError naming `where` (or the key's origin)
    and the key. Checks across fields are the class's own (`__post_init__`), prefixed the same way.
    With `key_prefix` (e.g. ``"sandbox."`` for a Hydra group) a value's error names the key by its full
    path instead (``sandbox.memory: ...``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    unknown = sorted(set(data) - set(fields))
    missing = sorted(set(required) - set(data))
    if unknown or missing:
        problems = ([f"unknown key(s) {unknown}"] if unknown else []) + (
            [f"missing key(s) {missing}"] if missing else [])
        raise ConfigError(f"{where}: {', '.join(problems)}; the keys are {list(fields)}")
    hints = _hints(cls)
    values = {}
    for name, raw in data.items():
        at = (origins or {}).get(name) or where
        lead = f"{key_prefix}{name}" if key_prefix is not None else f"{at}: {name}"
        value = _convert(raw, hints[name], lead)
        _check(value, raw, fields[name].metadata, lead)
        values[name] = value
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _convert(value: Any, kind: Any, lead: str) -> Any:
    """`value` as the field type `kind` (see the module docstring), else ConfigError; `lead` names the
    value in the message ("pool config conf/agentenv/pool.yaml: idle_after_s")."""
    def wrong(expected: str) -> ConfigError:
        return ConfigError(f"{lead} must be {expected}, got {value!r}")

    origin = get_origin(kind)
    if origin is Annotated:
        base, *marks = get_args(kind)
        if _SIZE_MARK in marks:
            return parse_size(value, lead)
        return _convert(value, base, lead)
    if origin is Literal:
        choices = get_args(kind)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
            raise wrong("one of " + ", ".join(str(c) for c in choices))
        return value
    if origin in (types.UnionType, Union):
        options = [a for a in get_args(kind) if a is not type(None)]
        return None if value is None else _convert(value, options[0], lead)
    if kind is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if kind is int:
        if isinstance(value, bool):
            raise wrong("an integer")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise wrong("an integer") from None
        if not isinstance(value, int):
            raise wrong("an integer")
        return value
    if kind is float:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise wrong("a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise wrong("a number")
        return float(value)
    if kind is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise wrong("a string")
        return str(value)
    if kind is Path:
        if not isinstance(value, str | Path) or not str(value):
            raise wrong("a path")
        return Path(value).expanduser()
    if origin is tuple:
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise wrong("a list")
        return tuple(_convert(v, get_args(kind)[0], f"{lead}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise wrong("a mapping")
        return {str(k): "" if v is None else _convert(v, get_args(kind)[1], f"{lead}.{k}")
                for k, v in value.items()}
    raise TypeError(f"agentenv.settings cannot load fields of type {kind!r} ({lead})")


def _check(value: Any, raw: Any, meta: Mapping[str, Any], lead: str) -> None:
    """The constraints declared with `setting(...)` on the converted `value` (`raw`: as given)."""
    rules = (("min", ">=", lambda v, b: v >= b), ("above", ">", lambda v, b: v > b),
             ("max", "<=", lambda v, b: v <= b))
    for name, sign, ok in rules:
        bound = meta.get(name)
        if bound is not None and not ok(value, bound):
            raise ConfigError(f"{lead} must be {sign} {bound:g}, got {raw!r}")
    check = meta.get("check")
    if check is not None and not check[0](value):
        shown = str(raw) if isinstance(raw, Path) else repr(raw)
        raise ConfigError(f"{lead} must be {check[1]}, got {shown}")
