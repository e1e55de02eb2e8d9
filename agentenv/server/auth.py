"""The server's API key: `$AGENTENV_API_KEY` when set, else one generated at first start and kept with
mode 0600 in `$AGENTENV_HOME/server-api-key` (the E2B SDK sends it as `X-API-Key`).

Generated keys look like E2B's (`e2b_` + hex) because the SDK refuses other shapes unless
`E2B_VALIDATE_API_KEY=false`.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from agentenv.errors import ConfigError
from agentenv.paths import API_KEY_ENV

KEY_FILE = "server-api-key"


def key_path(home: Path) -> Path:
    return home / KEY_FILE


def load_api_key(home: Path) -> tuple[str, str]:
    """(key, where it came from): the environment variable, or the key file (created if missing)."""
    env = os.environ.get(API_KEY_ENV)
    if env is not None:
        if len(env.strip()) < 16:
            raise ConfigError(f"${API_KEY_ENV} must be at least 16 characters (or unset it to have one "
                              "generated)")
        return env.strip(), f"${API_KEY_ENV}"
    path = key_path(home)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"{path} is readable by other users; `chmod 600 {path}` or delete it to have "
                              "a new key generated") from None
        key = path.read_text().strip()
        if len(key) < 16:
            raise ConfigError(f"{path} holds no usable key; delete it to have a new one generated") from None
        return key, str(path)
    key = "e2b_" + secrets.token_hex(20)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, str(path)


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison (no timing hints about the key)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
