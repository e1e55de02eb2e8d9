"""The settings files' JSON Schemas (`agentenv.settings.settings_schema`, `agentenv settings NAME --schema`)
accept the repository's own files and refuse what the loader refuses; the loader's errors name the key and
the file, and it converts no more than it did before pydantic checked the values."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from agentenv_testutil import ROOT

from agentenv.cli import main
from agentenv.config import SandboxConfig
from agentenv.errors import ConfigError
from agentenv.pool import PoolSettings
from agentenv.settings import FILES, build, settings_class, settings_schema

CONF = {name: ROOT / "conf" / "agentenv" / f"{name}.yaml" for name in FILES} | {
    "sandbox": ROOT / "conf" / "sandbox" / "default.yaml"}
POOL = yaml.safe_load(CONF["pool"].read_text())
# (a change to conf/agentenv/pool.yaml, the error the loader gives for it after "pool config PATH: ")
BAD_POOL = [
    ({"idle_after": 3}, "unknown key(s) ['idle_after']; the keys are ['memory_budget', "),
    ({"warm_starts": "yes"}, "warm_starts must be true or false, got 'yes'"),
    ({"metrics_window": True}, "metrics_window must be an integer, got True"),
    ({"metrics_window": 2.5}, "metrics_window must be an integer, got 2.5"),
    ({"idle_after_s": -1}, "idle_after_s must be >= 0, got -1"),
    ({"lease_timeout_s": 0}, "lease_timeout_s must be > 0, got 0"),
    ({"memory_budget": "lots"}, "memory_budget: expected a size like '512m' or '1g', got 'lots'"),
    ({"memory_budget": 0}, "memory_budget: must be positive, got 0"),
    ({"pause_method": "stop"}, "pause_method must be one of criu, freeze, got 'stop'"),
]


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = settings_schema(settings_class(name))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_schema_accepts_the_repositorys_file(name):
    data = yaml.safe_load(CONF[name].read_text())
    assert [e.message for e in _validator(name).iter_errors(data)] == []
    fields = set(settings_class(name).__dataclass_fields__)
    assert set(settings_schema(settings_class(name))["properties"]) == fields


@pytest.mark.parametrize("change, error", BAD_POOL)
def test_the_schema_and_the_loader_refuse_the_same_pool_files(tmp_path, change, error):
    data = {**POOL, **change}
    assert not _validator("pool").is_valid(data), change
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as caught:
        PoolSettings.load(path)
    assert str(caught.value).startswith(f"pool config {path}: {error}")


def test_a_missing_key_is_refused_by_both(tmp_path):
    data = {k: v for k, v in POOL.items() if k != "cpu_window_s"}
    assert not _validator("pool").is_valid(data)
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"^pool config {path}: missing key\(s\) \['cpu_window_s'\]; "):
        PoolSettings.load(path)


def test_only_the_loaders_own_conversions_are_made(tmp_path):
    """Numbers written as strings and integral floats load as before; nothing else is coerced."""
    s = PoolSettings.load(metrics_window="12", idle_after_s="2.5", cost_min_samples=3.0, memory_budget="1g")
    assert (s.metrics_window, s.idle_after_s, s.cost_min_samples, s.memory_budget) == (12, 2.5, 3, 2**30)
    assert type(s.idle_after_s) is float and type(s.cost_min_samples) is int
    for key, value in (("warm_starts", 1), ("warm_starts", "true"), ("idle_after_s", True),
                       ("idle_after_s", "nan"), ("metrics_window", "12.5")):
        with pytest.raises(ConfigError, match=rf": {key} must be "):
            PoolSettings.load(**{key: value})


def test_a_value_inside_a_list_or_mapping_is_named_by_its_path():
    with pytest.raises(ConfigError, match=r"sandbox config .*: cap_add\[1\] must be a string, got \[1\]$"):
        SandboxConfig.load(cap_add=["CHOWN", [1]])
    with pytest.raises(ConfigError, match=r"sandbox config .*: tmpfs\./x must be a string, got \{\}$"):
        SandboxConfig.load(tmpfs={"/x": {}})
    data = {**SandboxConfig.load().to_dict(), "cpus": "0"}
    with pytest.raises(ConfigError, match=r"^\$ENV: cpus must be > 0, got '0'$"):
        build(SandboxConfig, data, "sandbox", origins={"cpus": "$ENV"})
    with pytest.raises(ConfigError, match=r"^sandbox\.cpus must be > 0, got '0'$"):
        build(SandboxConfig, data, "sandbox", key_prefix="sandbox.")


def test_the_cli_prints_a_schema_and_checks_a_file(tmp_path, capsys):
    assert main(["settings", "pool", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == settings_schema(PoolSettings) and schema["additionalProperties"] is False
    assert main(["settings", "pool", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_budget"] == PoolSettings.load().memory_budget
    bad = tmp_path / "pool.yaml"
    bad.write_text(yaml.safe_dump({**POOL, "idle_after_s": -1}))
    assert main(["settings", "pool", "--file", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err == f"agentenv: error: pool config {bad}: idle_after_s must be >= 0, got -1\n"
    assert main(["settings", "nope"]) == 1
    assert f"the files are {sorted(FILES)}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["settings", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in FILES), out


def test_every_file_loads_from_its_path():
    for name, path in CONF.items():
        assert isinstance(settings_class(name).load(Path(path)), settings_class(name))
