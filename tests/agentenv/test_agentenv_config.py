"""SandboxConfig: defaults come from conf/sandbox/default.yaml and every key can be overridden."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from agentenv_testutil import ROOT

from agentenv import SandboxConfig
from agentenv.config import parse_size
from agentenv.errors import ConfigError, PathOutsideWorkspace
from agentenv.sandbox import workspace_path

DEFAULT_YAML = ROOT / "conf" / "sandbox" / "default.yaml"

# A valid non-default value for every key.
OVERRIDES = {
    "image": "k3rl/other:1", "user": "agent", "memory": "1g", "cpus": 2.5, "pids_limit": 99,
    "network": "bridge", "cap_drop": ["NET_RAW"], "cap_add": ["CHOWN"], "no_new_privileges": False,
    "read_only": False, "tmpfs": {"/scratch": "size=1m"}, "workspace": "/work", "exec_timeout_s": 7.0,
    "output_limit_bytes": 4096, "file_limit_bytes": 8192, "lock_timeout_s": 3.0, "fork_parallelism": 2,
    "labels": {"team": "rl"},
}


def test_defaults_are_read_from_the_yaml_file():
    data = yaml.safe_load(DEFAULT_YAML.read_text())
    cfg = SandboxConfig.load()
    assert cfg.network == data["network"] == "none"
    assert list(cfg.cap_drop) == data["cap_drop"] == ["ALL"]
    assert cfg.read_only is data["read_only"] is True
    assert cfg.no_new_privileges is True and cfg.user == "auto"
    assert cfg.output_limit_bytes == data["output_limit_bytes"] == 1024 * 1024
    assert cfg.memory == data["memory"] and cfg.pids_limit == data["pids_limit"]


def test_every_key_has_a_default_and_can_be_overridden():
    names = {f.name for f in dataclasses.fields(SandboxConfig)}
    assert names == set(OVERRIDES), "OVERRIDES must cover every config key"
    assert names <= set(yaml.safe_load(DEFAULT_YAML.read_text())), "every key has a default in the YAML"
    cfg = SandboxConfig.load(**OVERRIDES)
    got = cfg.to_dict()
    for key, value in OVERRIDES.items():
        assert got[key] == value, key
    assert SandboxConfig.load().replace(memory="2g").memory_bytes == 2 * 1024**3


def test_cli_style_assignments_parse_yaml_values():
    cfg = SandboxConfig.load().with_assignments(["read_only=false", "cap_add=[NET_RAW]", "pids_limit=32"])
    assert cfg.read_only is False and cfg.cap_add == ("NET_RAW",) and cfg.pids_limit == 32


def test_another_yaml_file_can_replace_the_defaults(tmp_path, monkeypatch):
    data = yaml.safe_load(DEFAULT_YAML.read_text())
    data["memory"] = "77m"
    path = tmp_path / "sandbox.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("AGENTENV_CONFIG", str(path))
    assert SandboxConfig.load().memory == "77m"


@pytest.mark.parametrize("bad, message", [
    ({"memory": "lots"}, "memory"),
    ({"memory": "1k"}, "minimum"),
    ({"user": "admin"}, "user must be one of"),
    ({"cpus": 0}, "cpus"),
    ({"pids_limit": 1}, "pids_limit"),
    ({"workspace": "/"}, "workspace"),
    ({"tmpfs": {"tmp": ""}}, "absolute"),
])
def test_bad_values_are_refused_with_the_key_named(bad, message):
    with pytest.raises(ConfigError, match=message):
        SandboxConfig.load(**bad)


def test_unknown_keys_are_refused():
    with pytest.raises(ConfigError, match="sandbox config: unknown key"):
        SandboxConfig.load().with_assignments(["memroy=1g"])
    with pytest.raises(ConfigError, match="key=value"):
        SandboxConfig.load().with_assignments(["memory"])


def test_sizes_use_binary_units():
    assert parse_size("512m") == 512 * 2**20
    assert parse_size("1GiB") == 2**30
    assert parse_size(4096) == 4096
    with pytest.raises(ConfigError):
        parse_size("-1m")


@pytest.mark.parametrize("path, expected", [
    ("a.txt", "/workspace/a.txt"),
    ("dir/../b.txt", "/workspace/b.txt"),
    ("/workspace/sub/c", "/workspace/sub/c"),
])
def test_workspace_paths_are_normalised(path, expected):
    assert workspace_path(path, "/workspace") == expected


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "/workspace/../etc", "/workspace", "",
                                  "a/../../x", "/workspacex/y"])
def test_paths_escaping_the_workspace_are_refused(path):
    with pytest.raises(PathOutsideWorkspace):
        workspace_path(path, "/workspace")


def test_a_missing_or_malformed_config_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        SandboxConfig.load()
    bad = tmp_path / "bad.yaml"
    bad.write_text("memory: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        SandboxConfig.load(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        SandboxConfig.load(bad)
