"""The server's API key: from $AGENTENV_API_KEY, else generated once with mode 0600 and reused; keys
readable by others or too short are refused with a message that says what to do."""

from __future__ import annotations

import stat

import pytest

from agentenv.errors import ConfigError
from agentenv.paths import API_KEY_ENV
from agentenv.server.auth import key_path, load_api_key, same_secret


def test_generated_key_is_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    key, source = load_api_key(tmp_path)
    assert source == str(key_path(tmp_path)) and key.startswith("e2b_") and len(key) == 44
    assert stat.S_IMODE(key_path(tmp_path).stat().st_mode) == 0o600
    assert load_api_key(tmp_path) == (key, source)
    assert same_secret(key, key) and not same_secret(None, key) and not same_secret(key[:-1] + "x", key)

    key_path(tmp_path).chmod(0o644)
    with pytest.raises(ConfigError, match="readable by other users"):
        load_api_key(tmp_path)
    key_path(tmp_path).chmod(0o600)
    key_path(tmp_path).write_text("short\n")
    with pytest.raises(ConfigError, match="no usable key"):
        load_api_key(tmp_path)


def test_environment_key_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "e2b_" + "ab" * 10)
    assert load_api_key(tmp_path) == ("e2b_" + "ab" * 10, f"${API_KEY_ENV}")
    assert not key_path(tmp_path).exists()
    monkeypatch.setenv(API_KEY_ENV, "tiny")
    with pytest.raises(ConfigError, match="at least 16"):
        load_api_key(tmp_path)
