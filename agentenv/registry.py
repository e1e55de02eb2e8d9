"""The registry: which sandboxes exist, their state, their checkpoints and their lineage.

SQLite in WAL mode under `$AGENTENV_HOME/registry.sqlite3`, so the CLI and a trainer in other processes
see the same sandboxes; readers never block the writer. State changes of one sandbox are serialised by
`agentenv.locks.sandbox_lock`; the registry itself only stores rows. One connection per thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.backend.base import Checkpoint

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id          TEXT PRIMARY KEY,
    state       TEXT NOT NULL,            -- creating | running | paused | broken | closed
    reason      TEXT,                     -- why it is broken (or other notes)
    image       TEXT NOT NULL,            -- the Docker tag it runs
    user        TEXT NOT NULL,            -- 'agent' or 'root' (resolved, never 'auto')
    container   TEXT,                     -- Docker container id
    volume      TEXT,                     -- Docker volume holding the work dir
    parent_id   TEXT,                     -- the sandbox it was forked from
    parent_checkpoint TEXT,               -- the checkpoint it was restored from
    config      TEXT NOT NULL,            -- SandboxConfig as JSON
    labels      TEXT NOT NULL,            -- user labels as JSON
    cpu_seconds_before REAL NOT NULL DEFAULT 0,  -- CPU time used before the last restore
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    id          TEXT PRIMARY KEY,
    sandbox_id  TEXT NOT NULL,
    path        TEXT NOT NULL,            -- the CRIU image directory on local disk
    bytes       INTEGER NOT NULL,
    marker      TEXT NOT NULL,            -- nonce written before the dump, checked after restore
    duration_s  REAL NOT NULL,
    created_at  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_by_sandbox ON checkpoints(sandbox_id);
"""


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    state: str
    reason: str | None
    image: str
    user: str
    container: str | None
    volume: str | None
    parent_id: str | None
    parent_checkpoint: str | None
    config: dict[str, Any]
    labels: dict[str, str]
    cpu_seconds_before: float
    created_at: float
    updated_at: float

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary (what `agentenv ls/create --json` print)."""
        return {"id": self.id, "state": self.state, "image": self.image, "user": self.user,
                "parent": self.parent_id, "created_at": self.created_at, "reason": self.reason,
                "labels": self.labels, "container": (self.container or "")[:12]}


def _sandbox(row: sqlite3.Row) -> SandboxRecord:
    d = dict(row)
    d["config"] = json.loads(d["config"])
    d["labels"] = json.loads(d["labels"])
    return SandboxRecord(**d)


def connect_wal(path: Path, timeout_s: float) -> sqlite3.Connection:
    """An autocommit SQLite connection in WAL mode (readers never block the writer) with Row rows that
    waits up to `timeout_s` for other processes' write locks. One per thread: connections are not shared."""
    conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
    return conn


class Registry:
    """Rows of sandboxes and checkpoints in one SQLite file (thread-safe: one connection per thread)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.path = home / "registry.sqlite3"
        self.lock_dir = home / "locks"
        self._local = threading.local()
        with self._conn() as c:
            c.executescript(SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect_wal(self.path, timeout_s=30.0)
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    # ---- sandboxes ----------------------------------------------------------------------------
    def insert_sandbox(self, *, id: str, state: str, image: str, user: str, config: dict[str, Any],
                       labels: dict[str, str], parent_id: str | None = None,
                       parent_checkpoint: str | None = None, container: str | None = None,
                       volume: str | None = None) -> None:
        now = time.time()
        self._conn().execute(
            "INSERT INTO sandboxes (id, state, image, user, container, volume, parent_id, parent_checkpoint,"
            " config, labels, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (id, state, image, user, container, volume, parent_id, parent_checkpoint,
             json.dumps(config), json.dumps(labels), now, now),
        )

    def update_sandbox(self, sandbox_id: str, **fields: Any) -> None:
        if not fields:
            return
        fields["updated_at"] = time.time()
        if isinstance(fields.get("labels"), dict):
            fields["labels"] = json.dumps(fields["labels"])
        cols = ", ".join(f"{k} = ?" for k in fields)
        self._conn().execute(f"UPDATE sandboxes SET {cols} WHERE id = ?", (*fields.values(), sandbox_id))

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._conn().execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _sandbox(row) if row else None

    def find_sandboxes(self, id_prefix: str) -> list[SandboxRecord]:
        rows = self._conn().execute(
            "SELECT * FROM sandboxes WHERE id LIKE ? ESCAPE '\\' ORDER BY created_at",
            (id_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",),
        ).fetchall()
        return [_sandbox(r) for r in rows]

    def list_sandboxes(self, include_closed: bool = False) -> list[SandboxRecord]:
        q = "SELECT * FROM sandboxes" + ("" if include_closed else " WHERE state != 'closed'")
        return [_sandbox(r) for r in self._conn().execute(q + " ORDER BY created_at").fetchall()]

    def delete_sandbox(self, sandbox_id: str) -> None:
        c = self._conn()
        c.execute("DELETE FROM checkpoints WHERE sandbox_id = ?", (sandbox_id,))
        c.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    # ---- checkpoints --------------------------------------------------------------------------
    def insert_checkpoint(self, sandbox_id: str, ck: Checkpoint) -> None:
        """Record `ck` as the newest checkpoint of `sandbox_id`."""
        self._conn().execute(
            "INSERT INTO checkpoints (id, sandbox_id, path, bytes, marker, duration_s, created_at)"
            " VALUES (?,?,?,?,?,?,?)",
            (ck.id, sandbox_id, ck.path, ck.bytes, ck.marker, ck.duration_s, time.time()),
        )

    def latest_checkpoint(self, sandbox_id: str) -> Checkpoint | None:
        row = self._conn().execute(
            "SELECT id, path, bytes, marker, duration_s FROM checkpoints WHERE sandbox_id = ?"
            " ORDER BY created_at DESC LIMIT 1", (sandbox_id,)
        ).fetchone()
        return Checkpoint(**dict(row)) if row else None

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._conn().execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))
