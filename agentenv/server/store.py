"""What E2B's API knows about a sandbox and AgentENV's registry does not: template name, envd access
token, metadata, environment variables, time to live and `autoPause`.

A table of its own in `$AGENTENV_HOME/e2b.sqlite3` (WAL, one connection per thread, like the
registry), keyed by the registry's sandbox id; the registry stays the truth about state.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.registry import connect_wal

SCHEMA = """
CREATE TABLE IF NOT EXISTS e2b_sandboxes (
    sandbox_id  TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    envd_token  TEXT NOT NULL,        -- the data plane's X-Access-Token for this sandbox
    metadata    TEXT NOT NULL,        -- JSON object of str -> str
    env_vars    TEXT NOT NULL,        -- JSON object: environment of every process started through envd
    started_at  REAL NOT NULL,
    end_at      REAL NOT NULL,        -- when its time to live runs out (while running)
    auto_pause  INTEGER NOT NULL      -- 1: pause at end_at, 0: kill
);
CREATE TABLE IF NOT EXISTS e2b_snapshots (
    snapshot_id TEXT PRIMARY KEY,     -- a paused sandbox (a fork of the source) that new sandboxes fork from
    source_id   TEXT NOT NULL,        -- the sandbox it was taken of
    name        TEXT,                 -- optional name, unique (create accepts it as templateID)
    template_id TEXT NOT NULL,        -- the source's template
    created_at  REAL NOT NULL
);
"""


@dataclass(frozen=True)
class E2BRecord:
    sandbox_id: str
    template_id: str
    envd_token: str
    metadata: dict[str, str]
    env_vars: dict[str, str]
    started_at: float
    end_at: float
    auto_pause: bool


class E2BStore:
    """Rows of E2B facts per sandbox (thread-safe: one SQLite connection per thread)."""

    def __init__(self, home: Path) -> None:
        self.path = home / "e2b.sqlite3"
        self._local = threading.local()
        self._conn().executescript(SCHEMA)

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect_wal(self.path, timeout_s=30.0)
        return conn

    def insert(self, sandbox_id: str, template_id: str, metadata: dict[str, str], env_vars: dict[str, str],
               timeout_s: float, auto_pause: bool) -> E2BRecord:
        now = time.time()
        rec = E2BRecord(sandbox_id, template_id, secrets.token_hex(16), dict(metadata), dict(env_vars), now,
                        now + timeout_s, auto_pause)
        self._conn().execute(
            "INSERT INTO e2b_sandboxes VALUES (?,?,?,?,?,?,?,?)",
            (rec.sandbox_id, rec.template_id, rec.envd_token, json.dumps(rec.metadata),
             json.dumps(rec.env_vars), rec.started_at, rec.end_at, int(rec.auto_pause)))
        return rec

    def get(self, sandbox_id: str) -> E2BRecord | None:
        row = self._conn().execute("SELECT * FROM e2b_sandboxes WHERE sandbox_id = ?",
                                   (sandbox_id,)).fetchone()
        if row is None:
            return None
        d = dict(row)
        d["metadata"], d["env_vars"] = json.loads(d["metadata"]), json.loads(d["env_vars"])
        d["auto_pause"] = bool(d["auto_pause"])
        return E2BRecord(**d)

    def ids(self) -> list[str]:
        return [r[0] for r in self._conn().execute("SELECT sandbox_id FROM e2b_sandboxes").fetchall()]

    def expired(self, now: float) -> list[str]:
        rows = self._conn().execute("SELECT sandbox_id FROM e2b_sandboxes WHERE end_at <= ?", (now,))
        return [r[0] for r in rows.fetchall()]

    def set_end(self, sandbox_id: str, end_at: float) -> None:
        self._conn().execute("UPDATE e2b_sandboxes SET end_at = ? WHERE sandbox_id = ?", (end_at, sandbox_id))

    def delete(self, sandbox_id: str) -> None:
        self._conn().execute("DELETE FROM e2b_sandboxes WHERE sandbox_id = ?", (sandbox_id,))

    # ---- snapshots ------------------------------------------------------------------------------
    def insert_snapshot(self, snapshot_id: str, source_id: str, name: str | None, template_id: str) -> None:
        self._conn().execute("INSERT INTO e2b_snapshots VALUES (?,?,?,?,?)",
                             (snapshot_id, source_id, name, template_id, time.time()))

    def snapshot(self, id_or_name: str) -> dict | None:
        row = self._conn().execute("SELECT * FROM e2b_snapshots WHERE snapshot_id = ? OR name = ?",
                                   (id_or_name, id_or_name)).fetchone()
        return dict(row) if row else None

    def snapshots(self, source_id: str | None = None, name: str | None = None) -> list[dict]:
        rows = self._conn().execute(
            "SELECT * FROM e2b_snapshots WHERE (? IS NULL OR source_id = ?) AND (? IS NULL OR name = ?) "
            "ORDER BY created_at, snapshot_id", (source_id, source_id, name, name)).fetchall()
        return [dict(r) for r in rows]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._conn().execute("DELETE FROM e2b_snapshots WHERE snapshot_id = ?", (snapshot_id,))
