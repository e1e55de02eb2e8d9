"""The trainer's command line before Hydra runs it: the user's config folders, and mistakes as one line.

**The user's configs.** Hydra reads k3rl's own ``conf/`` (the checkout's, or the copy an installed wheel
ships) and then, in this order, the folder of ``--config-dir DIR`` (Hydra's own flag) and ``./conf`` of
the working directory when it exists: a user's ``conf/env/my_task.yaml`` there is an ``env`` option like
the built-in ones (``env=my_task``), whichever way k3rl was installed. k3rl's own files are found first,
so a user's file with the name of a built-in option would be silently ignored: such a file (when its
content differs) is refused, with the advice to rename it.

**Mistakes.** Hydra reports a key that does not exist (``trainer.iteration=3``), an option that does not
exist (``env=find_wrod``) or an override it cannot parse as several lines and exits 1, and offers the
group schemas (``env_schema``) as options. Here the overrides are composed once with Hydra's compose API
before Hydra's own run, and each such mistake becomes one `ConfigError` line naming the key, where it
came from and the nearest valid names; `rl.train` prints it as ``k3rl-train: config error: ...`` and
exits 2, as for a bad value in a YAML file (`rl.config.load`).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agentenv.errors import ConfigError
from agentenv.paths import conf_dir
from rl.config.load import file_label, register_schemas
from rl.config.names import did_you_mean, schema_keys

SEARCHPATH = "hydra.searchpath"
_NOT_FOUND = re.compile(r"In '(?P<where>[^']+)': Could not (?:find|load) '(?P<path>[^']+)'")
_ALREADY = re.compile(r"An item is already at '(?P<key>[^']+)'")


def flag_dir(config_dir: str | None) -> Path | None:
    """The folder of Hydra's ``--config-dir`` (it must exist), or None."""
    if config_dir is None:
        return None
    path = Path(config_dir).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"--config-dir: no folder {config_dir!r} (a folder of config groups: env/, ...)")
    return path


def local_conf(cwd: Path | None = None) -> Path | None:
    """``./conf`` of the working directory when it exists and is not k3rl's own conf/, else None."""
    local = ((cwd or Path.cwd()) / "conf").resolve()
    return local if local.is_dir() and local != conf_dir().resolve() else None


def _parse(overrides: list[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:  # OverrideParseException
        bad = next((o for o in overrides if not _parses(o)), " ".join(overrides))
        first = str(exc).splitlines()[0]
        raise ConfigError(f"command line: cannot read the override {bad!r}: {first} (write key=value, "
                          "e.g. trainer.iterations=3)") from None


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_overrides([override])
    except HydraException:
        return False
    return True


def _searchpath(parsed: list[Override]) -> list[str]:
    """The entries of a ``hydra.searchpath=[...]`` override (none: [])."""
    for override in parsed:
        if override.key_or_group == SEARCHPATH and not override.is_delete():
            value = override.value()
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return []


def _folder(entry: str) -> Path | None:
    return Path(entry.removeprefix("file://")) if entry.startswith("file://") or "://" not in entry else None


def check_shadowing(dirs: list[Path]) -> None:
    """Refuse a user's group file that has a built-in option's name and other content: k3rl's own is the
    one Hydra reads (see the module docstring)."""
    own = conf_dir()
    for root in dirs:
        for path in sorted(root.glob("*/**/*.yaml")):
            rel = path.relative_to(root)
            builtin = own / rel
            if builtin.is_file() and builtin.read_bytes() != path.read_bytes():
                group, option = rel.parent.as_posix(), rel.stem
                raise ConfigError(
                    f"{group}={option}: {file_label(path)} has the name of k3rl's own {group} option "
                    f"({file_label(builtin)}), which is read first, so yours would be ignored; rename yours "
                    f"(e.g. my_{option}.yaml) and start it with `defaults: [{option}, _self_]` to build on "
                    "k3rl's")


def group_options(group: str, roots: list[Path]) -> list[str]:
    """The options of config group ``group``: its YAML files in ``roots``, and what ConfigStore holds
    for it but the group's schema (``<group>_schema``: for a file's ``defaults``, not an option)."""
    names = {p.stem for root in roots for p in (root / group).glob("*.yaml")}
    stored = ConfigStore.instance().repo
    node = stored
    for part in group.split("/"):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    names |= {n.removesuffix(".yaml") for n in node if isinstance(n, str) and n.endswith(".yaml")}
    return sorted(n for n in names if n != f"{group.split('/')[-1]}_schema")


def _groups(roots: list[Path]) -> set[str]:
    names = {p.name for root in roots for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")}
    return names | {g for g, v in ConfigStore.instance().repo.items() if isinstance(v, dict)}


def check_choices(parsed: list[Override], raw: list[str], roots: list[Path]) -> None:
    """Every ``group=option`` of the command line names an option that exists (schemas are no options)."""
    groups = _groups(roots) - {"hydra"}
    for override, text in zip(parsed, raw, strict=True):
        group = override.key_or_group
        if group not in groups or override.is_delete() or override.is_sweep_override():
            continue
        option = override.value()
        if not isinstance(option, str):
            continue
        options = group_options(group, roots)
        if option in options:
            continue
        what = (f"{option} is the schema of the {group} group (for `defaults:` of your own {group} files), "
                "not an option" if option == f"{group}_schema" else f"no {group} option {option!r}")
        where, near = " and ".join(file_label(r) for r in roots), did_you_mean("", option, options)
        raise ConfigError(f"{group}: {what} (command-line override {text}){near} "
                          f"(options: {', '.join(options)}; files {group}/<option>.yaml in {where})")


def _composition_error(exc: Exception, raw: list[str], config_name: str, overrides: list[str],
                       roots: list[Path]) -> ConfigError:
    """One line for an error of Hydra's composition (``raw``: the command line's overrides)."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, MissingConfigException) and (found := _NOT_FOUND.search(str(exc))):
        group, _, option = found["path"].rpartition("/")
        where = found["where"]
        file = next((r / f"{where}.yaml" for r in roots if (r / f"{where}.yaml").is_file()), None)
        origin = f"the defaults of {file_label(file)}" if file else f"the defaults of {where}.yaml"
        options = group_options(group, roots)
        near, listed = did_you_mean("", option, options), ", ".join(options)
        return ConfigError(f"{group}: no {group} option {option!r} ({origin}){near} (options: {listed})")
    cause = exc.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(exc, ConfigCompositionException) and key and isinstance(cause, OmegaConfBaseException):
        text = next((o for o in raw if o.lstrip("+~").split("=", 1)[0] == key), key)
        parent, _, name = key.rpartition(".")
        declared = schema_keys(parent)
        if declared is not None:
            return ConfigError(f"{key}: unknown key (command-line override {text})"
                               f"{did_you_mean(parent, name, declared)}")
        present = _keys_at(parent, config_name, [o for o in overrides if o != text])
        return ConfigError(f"{key}: no such key to set (command-line override {text})"
                           f"{did_you_mean(parent, name, present)}; a new key is added with +{text}")
    if (present := _ALREADY.search(first)) is not None:
        key = present["key"]
        text = next((o for o in raw if o.startswith("+") and o.lstrip("+").split("=", 1)[0] == key), key)
        return ConfigError(f"{key}: already set, + adds only new keys (command-line override {text}); "
                           f"write {text.lstrip('+')}")
    return ConfigError(f"command line: {first}")


def _keys_at(parent: str, config_name: str, overrides: list[str]) -> list[str]:
    """The keys the composed config holds under ``parent`` (without the override that failed)."""
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = compose(config_name, overrides=overrides)
    except Exception:  # another mistake: no names to offer
        return []
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return [str(k) for k in node] if OmegaConf.is_dict(node) else []


def _with_searchpath(items: list[str], entries: list[str], overrides: list[str] | None = None) -> list[str]:
    """``items`` (argv or overrides) with one ``hydra.searchpath=[...]`` override holding ``entries``: in
    place of the one there, else beside the first of ``overrides`` (argparse wants them together)."""
    override = f"{SEARCHPATH}=[{','.join(repr(e) for e in entries)}]"
    for i, item in enumerate(items):
        if item.startswith(f"{SEARCHPATH}="):
            return [*items[:i], override, *items[i + 1:]]
    first = next((i for i, item in enumerate(items) if overrides and item == overrides[0]), 0)
    return [*items[:first], override, *items[first:]]


def prepare(argv: list[str], config_name: str = "config") -> list[str]:
    """``argv`` as Hydra should see it: ``./conf`` added to its search path (see the module docstring).
    Raises a one-line `ConfigError` for a mistake Hydra would report at length."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return argv
    raw = list(args.overrides)
    parsed = _parse(raw)
    given = _searchpath(parsed)
    flag, local = flag_dir(args.config_dir), local_conf()
    entries = given + [f"file://{local}"] if local and f"file://{local}" not in given else given
    if entries != given:
        argv = _with_searchpath(argv, entries, raw)
    overrides = _with_searchpath(raw, entries) if entries != given else raw
    folders = [f for e in given if (f := _folder(e)) is not None and f.is_dir()]
    roots = list(dict.fromkeys(r.resolve() for r in [conf_dir(), *([flag] if flag else []), *folders,
                                                      *([local] if local else [])]))
    check_shadowing(roots[1:])
    if args.multirun or any(o.is_sweep_override() for o in parsed):
        return argv  # sweeps are Hydra's to expand
    check_choices(parsed, raw, roots)
    searched = _with_searchpath(overrides, [f"file://{flag}", *entries]) if flag else overrides
    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            compose(config_name, overrides=searched, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _composition_error(exc, raw, config_name, searched, roots) from None
    except yaml.MarkedYAMLError as exc:  # a config file that is no YAML
        mark = exc.problem_mark
        where = f"{file_label(Path(mark.name))}, line {mark.line + 1}" if mark else "a config file"
        context = f" ({exc.context})" if exc.context else ""
        raise ConfigError(f"{where}: not valid YAML: {exc.problem}{context}") from None
    return argv


__all__ = ["group_options", "local_conf", "prepare"]
