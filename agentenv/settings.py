"""One declarative loader for AgentENV's settings files and configs: a frozen dataclass is built from a YAML
mapping by its field types, and each field's constraints are declared next to it with `setting(...)`.

    @dataclass(frozen=True)
    class PoolSettings:
        memory_budget: Size
        idle_after_s: float = setting(min=0)
        pause_method: Literal["criu", "freeze"]

A strict pydantic model derived from the dataclass checks the values, and gives each file its JSON Schema
(`settings_schema`; `agentenv settings NAME --schema`). Types: int, float, bool, str, Path, Literal[...],
`Size` (an int of bytes, parsed by `parse_size`), tuple[str, ...], dict[str, str] and `X | None`. A number
may be given as a string ("8"), an int as an integral float, a string as a number, a list for a tuple;
nothing else is coerced (no "yes" for true, no true for 1). Every error is a ConfigError naming where the
value came from and the key: "pool config conf/agentenv/pool.yaml: idle_after_s must be >= 0, got -1".
pydantic loads on the first build, not with this module (the CLI starts without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
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
SIZE_PATTERN = r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)([iI]?[bB]?)\s*$"  # also the JSON Schema's pattern
_SIZE = re.compile(SIZE_PATTERN)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
Check = tuple[Callable[[Any], bool], str]  # (predicate on the converted value, "must be ..." when it fails)
# the settings files `agentenv settings NAME` knows: NAME -> the module and the class that loads it
FILES = {"sandbox": "agentenv.config:SandboxConfig", "backend": "agentenv.backend.settings:BackendSettings",
         "pool": "agentenv.pool.settings:PoolSettings", "server": "agentenv.server.settings:ServerSettings",
         "remote": "agentenv.remote:RemoteSettings"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le")}
_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path",
             tuple: "a list", dict: "a mapping"}
_NOT_FIELDS = ("extra_forbidden", "invalid_key")  # pydantic's errors for a key that is no field


class _SizeProblem(ValueError):
    """A value `parse_size` refuses; its message follows the key after a colon ("memory: must be ...")."""


class _CheckFailed(ValueError):
    """A value its field's `check` refuses (the message shows a given Path as a plain path)."""


def _size_bytes(value: Any) -> int:
    if isinstance(value, bool):
        raise _SizeProblem("expected a size like '512m'")
    if isinstance(value, int):
        if value <= 0:
            raise _SizeProblem("must be positive")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise _SizeProblem("expected a size like '512m' or '1g'")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise _SizeProblem("must be positive")
    return n


def parse_size(value: str | int, what: str = "size") -> int:
    """'512m' / '1g' / '64MiB' / 1048576 -> bytes (binary units, as Docker reads them)."""
    try:
        return _size_bytes(value)
    except _SizeProblem as e:
        raise ConfigError(f"{what}: {e}, got {value!r}") from None


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
    from pydantic import ValidationError

    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    try:
        checked = _model(cls).model_validate(dict(data))
    except ValidationError as e:
        raise _error(cls, data, e.errors(), where, origins or {}, key_prefix) from None
    try:
        return cls(**{name: getattr(checked, name) for name in checked.model_fields_set})
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def settings_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema of a YAML file that `build(cls, ...)` accepts (its values in their plain form:
    numbers as numbers, sizes as an int or a string like '512m')."""
    return _model(cls).model_json_schema()


def settings_class(name: str) -> type:
    """The class that loads the settings file `name` (a key of `FILES`)."""
    if name not in FILES:
        raise ConfigError(f"no settings file {name!r}; the files are {sorted(FILES)}")
    module, _, attr = FILES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


# ---- the pydantic model of a settings dataclass ---------------------------------------------------------
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


@functools.cache
def _model(cls: type) -> Any:
    """A strict pydantic model with `cls`'s fields, types, constraints and defaults, refusing other keys."""
    from pydantic import AfterValidator, ConfigDict, Field, create_model

    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = _pydantic_type(_hints(cls)[f.name], f"{cls.__name__}.{f.name}")
        check = f.metadata.get("check")
        if check is not None:
            kind = Annotated[kind, AfterValidator(functools.partial(_check, *check))]
        default = ({"default": f.default} if f.default is not dataclasses.MISSING else {} if
                   f.default_factory is dataclasses.MISSING else {"default_factory": f.default_factory})
        fields[f.name] = (kind, Field(ge=f.metadata.get("min"), gt=f.metadata.get("above"),
                                      le=f.metadata.get("max"), **default,
                                      description=f"must be {check[1]}" if check else None))
    config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())
    return create_model(cls.__name__, __config__=config, __doc__=cls.__doc__, **fields)


def _pydantic_type(kind: Any, field: str) -> Any:
    """The pydantic type of a field type (see the module docstring): strict, after the conversions the
    loader allows (`_to_int` ...)."""
    from pydantic import BeforeValidator, Field

    origin, args = get_origin(kind), get_args(kind)
    if origin is Annotated:
        if _SIZE_MARK in args[1:]:
            given = Annotated[int, Field(gt=0)] | Annotated[str, Field(pattern=SIZE_PATTERN)]
            return Annotated[int, BeforeValidator(_size_bytes, json_schema_input_type=given)]
        return _pydantic_type(args[0], field)
    if origin is Literal:
        return Annotated[kind, BeforeValidator(functools.partial(_literal, kind))]
    if origin in (types.UnionType, Union):
        return _pydantic_type(next(a for a in args if a is not type(None)), field) | None
    if kind in _CONVERT:
        return Annotated[kind, BeforeValidator(_CONVERT[kind])]
    if kind is bool:
        return bool
    if origin is tuple:
        return Annotated[tuple[_pydantic_type(args[0], field), ...], BeforeValidator(_to_tuple)]
    if origin is dict:
        return Annotated[dict[str, _pydantic_type(args[1], field)], BeforeValidator(_to_dict)]
    raise TypeError(f"agentenv.settings cannot load fields of type {kind!r} ({field})")


def _literal(kind: Any, value: Any) -> Any:
    """pydantic takes True for a Literal's 1 and 1 for its True; the loader does not."""
    choices = get_args(kind)
    if value in choices and isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
        raise ValueError(f"must be {_expected(kind, [])}")
    return value


def _to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value.strip())
    return value


def _to_float(value: Any) -> Any:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value.strip())
    if isinstance(value, float) and math.isnan(value):
        raise ValueError("must be a number")
    return value


def _to_str(value: Any) -> Any:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def _to_path(value: Any) -> Any:
    given = isinstance(value, Path) or (isinstance(value, str) and value != "")
    return Path(value).expanduser() if given else value


def _to_tuple(value: Any) -> Any:
    return () if value is None else tuple(value) if isinstance(value, list | tuple) else value


def _to_dict(value: Any) -> Any:
    if value is None:
        return {}
    return {str(k): "" if v is None else v for k, v in value.items()} if isinstance(value, Mapping) else value


_CONVERT: dict[type, Callable[[Any], Any]] = {int: _to_int, float: _to_float, str: _to_str, Path: _to_path}


def _check(predicate: Callable[[Any], bool], what: str, value: Any) -> Any:
    if not predicate(value):
        raise _CheckFailed(f"must be {what}")
    return value


# ---- pydantic's errors in the loader's words --------------------------------------------------------
def _error(cls: type, data: Mapping[str, Any], errors: list[Any], where: str, origins: Mapping[str, str],
           key_prefix: str | None) -> ConfigError:
    """One ConfigError for pydantic's `errors`: the unknown and missing keys, else the first bad value in
    the order of `data`, named by its key path ("tmpfs./x", "cap_add[0]") and where it came from."""
    unknown = sorted((e["loc"][0] for e in errors if e["type"] in _NOT_FIELDS), key=str)
    missing = sorted(e["loc"][0] for e in errors if e["type"] == "missing")
    if unknown or missing:
        problems = ([f"unknown key(s) {unknown}"] if unknown else []) + (
            [f"missing key(s) {missing}"] if missing else [])
        keys = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        return ConfigError(f"{where}: {', '.join(problems)}; the keys are {keys}")
    order = list(data)
    first = min(errors, key=lambda e: order.index(e["loc"][0]))
    name, *path = first["loc"]
    lead = f"{key_prefix}{name}" if key_prefix is not None else f"{origins.get(name) or where}: {name}"
    lead += "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    raised = first.get("ctx", {}).get("error")
    if first["type"] in _BOUNDS:
        sign, bound = _BOUNDS[first["type"]]
        problem = f"must be {sign} {first['ctx'][bound]:g}"
    elif isinstance(raised, ValueError):  # a converter's or a check's own words
        problem = str(raised)
    else:
        problem = f"must be {_expected(_hints(cls)[name], path)}"
    given = _given(data, first["loc"], first["input"])
    shown = str(given) if isinstance(given, Path) and isinstance(raised, _CheckFailed) else repr(given)
    return ConfigError(f"{lead}{': ' if isinstance(raised, _SizeProblem) else ' '}{problem}, got {shown}")


def _expected(kind: Any, path: list[Any]) -> str:
    """What the value at `path` inside a field of type `kind` must be ("an integer", "one of a, b")."""
    for depth in range(len(path) + 1):
        while get_origin(kind) in (Annotated, types.UnionType, Union):
            kind = next(a for a in get_args(kind) if a is not type(None))
        if depth < len(path):
            kind = get_args(kind)[0 if get_origin(kind) is tuple else 1]
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(str(c) for c in get_args(kind))
    return _EXPECTED[get_origin(kind) or kind]


def _given(data: Mapping[str, Any], loc: tuple[Any, ...], default: Any) -> Any:
    """The value at `loc` as it was given (before any conversion), else `default`."""
    value: Any = data
    for part in loc:
        if isinstance(value, Mapping):
            value = {str(k): v for k, v in value.items()}.get(str(part), default)
        elif isinstance(value, list | tuple) and isinstance(part, int) and part < len(value):
            value = value[part]
        else:
            return default
    return value
