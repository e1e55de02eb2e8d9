"""From Hydra's composed config to a checked `RunConfig`, with errors that name the key and the file.

The composed config is merged into the schema stored in Hydra's ConfigStore (``k3rl_schema``, see
`register_schemas`): a wrong type, an unknown key or a missing value stops there; then the ranges and
the cross-key rules of ``rl/config/checks.py`` run. Every error is one `ConfigError` line such as
``algo.optim.lr: must be > 0, got -1.0 (conf/algo/grpo.yaml)``, raised before Ray or any sandbox starts.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from agentenv.errors import ConfigError
from agentenv.paths import conf_dir
from model.config import ConfigError as ModelConfigError
from model.config import K3Config
from rl.config.checks import check_run
from rl.config.names import did_you_mean, schema_keys
from rl.config.schema import GROUP_SCHEMAS, RunConfig

SCHEMA_NAME = "k3rl_schema"


def register_schemas() -> None:
    """Store the run schema (``k3rl_schema``) and one per group (``<group>_schema``) in ConfigStore.

    A user's own group file can start with ``defaults: [algo_schema, _self_]`` to be typed by Hydra
    itself at composition; `load` always merges the whole config into ``k3rl_schema``.
    """
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=RunConfig)
    for group, schema in GROUP_SCHEMAS.items():
        if group != "tokenizer":
            store.store(group=group, name=f"{group}_schema", node=schema)


def _schema() -> DictConfig:
    repo = ConfigStore.instance().repo
    if f"{SCHEMA_NAME}.yaml" not in repo:
        register_schemas()
    return OmegaConf.create(ConfigStore.instance().load(f"{SCHEMA_NAME}.yaml").node)


class Origin:
    """Where a key's value came from: a command-line override or the YAML file of its group, found in
    k3rl's conf/ or in one of the user's config folders (``roots``, Hydra's search path, in its order)."""

    def __init__(self, choices: dict[str, Any], overrides: list[str], root: Path | None = None,
                 roots: list[Path] | None = None) -> None:
        self.choices = {k: v for k, v in choices.items() if not k.startswith("hydra")}
        self.overrides = list(overrides)
        self.conf_dir = root or conf_dir()
        self.roots = list(roots) if roots else [self.conf_dir]

    def of(self, key: str) -> str:
        """``command-line override algo.optim.lr=-1`` or ``conf/algo/grpo.yaml`` for ``algo.optim.lr``."""
        key = key.split("[", 1)[0]
        for item in self.overrides:
            name = item.split("=", 1)[0].lstrip("+~")
            if name in self.choices:  # `algo=ppo` picks a file; the value comes from that file
                continue
            if name == key or key.startswith(name + "."):
                return f"command-line override {item}"
        for name, option in self.choices.items():  # a global group (preset=short) sets keys of others
            if name not in GROUP_SCHEMAS and option and (path := self.find(name, str(option))) is not None:
                try:
                    if _sets(yaml.safe_load(path.read_text()) or {}, key):
                        return self.label(path)
                except (OSError, yaml.YAMLError):
                    pass
        group, _, rest = key.partition(".")
        if group in self.choices and self.choices[group]:
            return self._file(group, str(self.choices[group]), rest)
        return "conf/config.yaml"

    def _file(self, group: str, option: str, rest: str) -> str:
        """The file of ``group/option`` that sets ``rest``, following the group's own defaults."""
        seen: list[str] = []
        first: Path | None = None
        while option not in seen:
            seen.append(option)
            path = self.find(group, option)
            if path is None:
                break
            first = first or path
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError):
                break
            if not rest or _sets(data, rest):
                return self.label(path)
            parents = [d for d in data.get("defaults", []) if isinstance(d, str) and d != "_self_"]
            if not parents:
                break
            option = parents[0]
        return self.label(first) if first else f"the {group} option {seen[0]}"

    def find(self, group: str, option: str) -> Path | None:
        """The YAML file of ``group/option`` that Hydra reads: the first of the search path's folders."""
        for root in self.roots:
            path = root / group / f"{option}.yaml"
            if path.is_file():
                return path
        return None

    def label(self, path: Path) -> str:
        """``conf/env/x.yaml`` for k3rl's own files; a user's file relative to the working directory
        when it lies below it, else its absolute path."""
        return file_label(path, self.conf_dir)


def file_label(path: Path, own: Path | None = None) -> str:
    """How an error names a config file: ``conf/<group>/<name>.yaml`` inside k3rl's conf/ (``own``), a
    user's file as ``./<path>`` when it lies below the working directory, else its absolute path."""
    path = path.resolve()
    for base, prefix in ((own or conf_dir(), "conf"), (Path.cwd(), ".")):
        try:
            rel = path.relative_to(base.resolve())
        except ValueError:
            continue
        return prefix if rel == Path(".") else f"{prefix}/{rel}"
    return str(path)


def _sets(data: dict[str, Any], dotted: str) -> bool:
    """Whether a group file's ``data`` sets the (nested) key ``dotted``, e.g. ``optim.lr``."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _origin(cfg: DictConfig) -> Origin:
    """Hydra's choices and overrides: from ``cfg.hydra`` (compose API) or the running Hydra app."""
    if "hydra" in cfg:
        hydra_cfg = cfg.hydra
    else:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return Origin({}, [])
        hydra_cfg = HydraConfig.get()
    choices = OmegaConf.to_container(hydra_cfg.runtime.choices) or {}
    sources = OmegaConf.to_container(hydra_cfg.runtime.config_sources) or []
    roots = [Path(s["path"]) for s in sources if s.get("schema") == "file" and s.get("path")]
    return Origin(choices, list(hydra_cfg.overrides.task), roots=roots)


_WRONG_TYPE = re.compile(r"Value '(?P<value>.*)' of type '\w+' could not be converted to (?P<type>\w+)")


def _omegaconf_message(exc: OmegaConfBaseException) -> tuple[str, str]:
    """(key, one-line reason) of an OmegaConf merge error."""
    key = str(getattr(exc, "full_key", "") or "")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ConfigKeyError) or "not in" in first:
        parent, _, name = key.rpartition(".")
        return key, f"unknown key {name!r} (no such setting in {parent or 'the run config'})"
    if isinstance(exc, MissingMandatoryValue):
        return key, "missing: every option of this group must set it"
    wrong = _WRONG_TYPE.match(first)
    if wrong:
        return key, f"expected {wrong['type'].lower()}, got {wrong['value']!r}"
    return key, first


def _suggestion(exc: Exception, key: str) -> str:
    """``; did you mean ...?`` for an unknown key, from the keys its schema declares there."""
    if not (isinstance(exc, ConfigKeyError) or "not in" in str(exc).split("\n", 1)[0]):
        return ""
    parent, _, name = key.rpartition(".")
    return did_you_mean(parent, name, schema_keys(parent) or [])


def _keyed(group: str, message: str, names: set[str]) -> str:
    """A group's own error (``hidden_size must be ...``) as ``model.hidden_size: must be ...``."""
    head = re.match(r"(?P<name>[a-z_][a-z0-9_.]*)(?P<sep>:? )(?P<rest>.*)", message, re.DOTALL)
    keyed = head and (head["sep"] == ": " or head["rest"].startswith(("must", "is ", "has ")))
    if keyed and head["name"].split(".")[0] in names:
        return f"{group}.{head['name']}: {head['rest']}"
    return f"{group}: {message}"


def with_origin(cfg: DictConfig, exc: ConfigError) -> ConfigError:
    """``exc`` (``key: problem``, raised by a check after `load`) with where the key's value came from,
    then its ``hint`` attribute if it has one (the nearest names)."""
    message = str(exc)
    origin = _origin(cfg).of(message.split(":", 1)[0])
    return ConfigError(f"{message} ({origin}){getattr(exc, 'hint', '')}")


def load(cfg: DictConfig) -> RunConfig:
    """The composed config as a checked, typed `RunConfig` (raises a one-line `ConfigError`)."""
    origin = _origin(cfg)
    data = {
        key: OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        for key, value in cfg.items()
        if key != "hydra"
    }
    try:
        merged = OmegaConf.merge(_schema(), data)
        run = OmegaConf.to_object(merged)
    except (ModelConfigError, OmegaConfBaseException) as exc:
        cause = exc if isinstance(exc, ModelConfigError) else exc.__cause__ or exc.__context__
        if isinstance(cause, ModelConfigError):  # K3Config checks itself on construction
            message = _keyed("model", str(cause), {f.name for f in dataclasses.fields(K3Config)})
        else:
            key, reason = _omegaconf_message(exc)
            message = f"{key}: {reason}"
        key = message.split(":", 1)[0]
        raise ConfigError(f"{message} ({origin.of(key)}){_suggestion(exc, key)}") from None
    try:
        check_run(run)
    except ConfigError as exc:
        message = str(exc)
        if message.startswith("sandbox: "):  # AgentENV's message, keyed by the sandbox field
            message = _keyed("sandbox", message.removeprefix("sandbox: "), set(run.sandbox))
        raise ConfigError(f"{message} ({origin.of(message.split(':', 1)[0])})") from None
    return run


register_schemas()  # at import, so that group files of `python -m rl.train` can name them in defaults
