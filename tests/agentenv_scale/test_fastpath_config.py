"""Fast-path and pool settings: bad values give clear errors; the backend is chosen by config."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.errors import ConfigError
from agentenv.fastpath import FastPathSettings, FastPathUnavailable, probe
from agentenv.fastpath.backend import FastPathBackend, select_backend
from agentenv.fastpath.errors import FastPathConfigError
from agentenv.pool import PoolSettings


def test_fastpath_settings_load_and_reject_bad_values(tmp_path: Path):
    s = FastPathSettings.load()
    assert s.store_dir.is_absolute() and s.disk_cap > 0 and s.fork_parallelism >= 1
    with pytest.raises(FastPathConfigError, match="unknown key"):
        FastPathSettings.from_dict({**s.__dict__, "store": "/x"})
    with pytest.raises(FastPathConfigError, match="disk_cap"):
        s.replace(disk_cap="lots")
    with pytest.raises(FastPathConfigError, match="absolute"):
        s.replace(store_dir="relative/dir")
    with pytest.raises(FastPathConfigError, match="link_pages"):
        s.replace(link_pages="yes")
    bad = tmp_path / "bad.yaml"
    bad.write_text("store_dir: [unclosed")
    with pytest.raises(FastPathConfigError, match="not valid YAML"):
        FastPathSettings.load(bad)


def test_pool_settings_reject_bad_values():
    s = PoolSettings.load()
    assert s.memory_budget > 0
    with pytest.raises(ConfigError, match="memory_budget"):
        PoolSettings.load(memory_budget="-3g")
    with pytest.raises(ConfigError, match="warm_starts"):
        PoolSettings.load(warm_starts="sometimes")
    with pytest.raises(ConfigError, match="idle_after_s"):
        PoolSettings.load(idle_after_s=-1)


def test_backend_is_chosen_by_config(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("AGENTENV_BACKEND", "docker-criu")
    assert select_backend(tmp_path).name == "docker-criu"
    monkeypatch.setenv("AGENTENV_BACKEND", "fastpath")
    try:
        probe(FastPathSettings.load())
        expected = FastPathBackend.name
    except FastPathUnavailable:
        expected = "docker-criu"  # e.g. not root: the fast path falls back to Docker's path
    assert select_backend(tmp_path).name == expected
    monkeypatch.setenv("AGENTENV_BACKEND", "podman")
    with pytest.raises(ConfigError, match="AGENTENV_BACKEND"):
        select_backend(tmp_path)


@pytest.mark.parametrize("load, env_var, what, error", [
    (FastPathSettings.load, "AGENTENV_FASTPATH_CONFIG", "fast-path config", FastPathConfigError),
    (PoolSettings.load, "AGENTENV_POOL_CONFIG", "pool config", ConfigError),
])
def test_settings_files_share_one_yaml_reader(load, env_var, what, error, tmp_path, monkeypatch):
    """One YAML reader (agentenv.config.read_yaml_mapping) for every settings file: same messages."""
    monkeypatch.setenv(env_var, str(tmp_path / "missing.yaml"))
    with pytest.raises(error, match=f"{what} .*missing.yaml does not exist"):
        load()
    bad = tmp_path / "bad.yaml"
    for text, expected in (("a: [unclosed\n", "is not valid YAML"), ("- a list\n", "must be a mapping"),
                           ("", "missing key")):
        bad.write_text(text)
        with pytest.raises(error, match=expected):
            load(bad)
