"""What E2B's API knows about a sandbox and AgentENV's registry does not: template name, envd access
token, metadata, environment variables, time to live and `autoPause`.

A table in `$AGENTENV_HOME/e2b.sqlite3`; every served sandbox also carries its row's facts in labels, so a
lost file is rebuilt from them (`row_from_labels`) rather than anything being removed.

Design: docs/design/sandboxes.md#agentenv-server-store.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import ConfigError
from agentenv.registry import SandboxRecord, connect_wal
from agentenv.sandbox import SERVED_LABEL

SERVER_ID_FILE = "server-id"
TEMPLATE_LABEL = SERVED_LABEL + ".template"
METADATA_LABEL = SERVED_LABEL + ".metadata"        # JSON object
ENV_LABEL = SERVED_LABEL + ".env-vars"             # JSON object
AUTO_PAUSE_LABEL = SERVED_LABEL + ".auto-pause"    # "1" | "0"
SNAPSHOT_OF_LABEL = SERVED_LABEL + ".snapshot-of"  # a snapshot's source sandbox
SNAPSHOT_NAME_LABEL = SERVED_LABEL + ".snapshot-name"

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


def server_id(home: Path) -> str:
    """This home's server id (`$AGENTENV_HOME/server-id`), made at the first call; a file that holds
    anything else is an error naming it (a new id would disown every sandbox served so far)."""
    path = home / SERVER_ID_FILE
    if not path.exists():  # written whole, then linked: a reader never sees it half made
        tmp = home / f".{SERVER_ID_FILE}.{os.getpid()}"
        tmp.write_text(secrets.token_hex(8) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: theirs holds
        finally:
            tmp.unlink(missing_ok=True)
    text = path.read_text().strip()
    if not re.fullmatch(r"[0-9a-f]{16,64}", text):
        raise ConfigError(f"{path} must hold this home's server id (hex digits), got {text[:40]!r}; restore "
                          f"it (the sandboxes it served are labelled {SERVED_LABEL}=<id>)")
    return text


class E2BStore:
    """Rows of E2B facts per sandbox (thread-safe: one SQLite connection per thread)."""

    def __init__(self, home: Path) -> None:
        self.path = home / "e2b.sqlite3"
        self.server_id = server_id(home)
        self._local = threading.local()
        self._conn().executescript(SCHEMA)

    # ---- ownership labels --------------------------------------------------------------------------
    def owns(self, rec: SandboxRecord) -> bool:
        """Did this home's server make this sandbox (its label names this server)?"""
        return rec.labels.get(SERVED_LABEL) == self.server_id

    def served_labels(self, template_id: str, metadata: dict[str, str], env_vars: dict[str, str],
                      auto_pause: bool) -> dict[str, str]:
        """The labels of a sandbox this server makes: its id and the facts of the sandbox's row."""
        return {SERVED_LABEL: self.server_id, TEMPLATE_LABEL: template_id,
                METADATA_LABEL: json.dumps(metadata, sort_keys=True),
                ENV_LABEL: json.dumps(env_vars, sort_keys=True), AUTO_PAUSE_LABEL: "1" if auto_pause else "0"}

    def snapshot_labels(self, source_id: str, name: str | None, template_id: str) -> dict[str, str]:
        """The labels of a snapshot's paused sandbox: this server's id and the snapshot's row."""
        return {SERVED_LABEL: self.server_id, TEMPLATE_LABEL: template_id, SNAPSHOT_OF_LABEL: source_id,
                **({SNAPSHOT_NAME_LABEL: name} if name else {})}

    def row_from_labels(self, rec: SandboxRecord, timeout_s: float) -> str | None:
        """Write the missing row of an owned sandbox from its labels: 'sandbox' or 'snapshot' (which
        table), None when its labels lack them. A new envd access token (connect and get_info return it;
        it opens the data plane, so it stays out of labels); the time to live restarts (`timeout_s`; a
        paused one never expires)."""
        labels = rec.labels
        template = labels.get(TEMPLATE_LABEL)
        if not self.owns(rec) or not template:
            return None
        if SNAPSHOT_OF_LABEL in labels:
            name = labels.get(SNAPSHOT_NAME_LABEL)
            taken = name is not None and self.snapshot(name) is not None
            self._conn().execute("INSERT OR IGNORE INTO e2b_snapshots VALUES (?,?,?,?,?)",
                                 (rec.id, labels[SNAPSHOT_OF_LABEL], None if taken else name, template,
                                  rec.created_at))
            return "snapshot"
        try:
            metadata, env_vars = json.loads(labels[METADATA_LABEL]), json.loads(labels[ENV_LABEL])
        except (KeyError, ValueError):
            return None
        end = time.time() + (0.0 if rec.state == "paused" else timeout_s)  # as a pause sets it
        self._conn().execute(
            "INSERT OR IGNORE INTO e2b_sandboxes VALUES (?,?,?,?,?,?,?,?)",
            (rec.id, template, secrets.token_hex(16), json.dumps(metadata), json.dumps(env_vars),
             rec.created_at, end, int(labels.get(AUTO_PAUSE_LABEL) == "1")))
        return "sandbox"

    def labels_of_row(self, sandbox_id: str) -> dict[str, str] | None:
        """The ownership labels a sandbox with a row here must carry (sandbox or snapshot), or None."""
        rec = self.get(sandbox_id)
        if rec is not None:
            return self.served_labels(rec.template_id, rec.metadata, rec.env_vars, rec.auto_pause)
        snap = self.snapshot(sandbox_id)
        if snap is not None and snap["snapshot_id"] == sandbox_id:
            return self.snapshot_labels(snap["source_id"], snap["name"], snap["template_id"])
        return None

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

    def set_end(self, sandbox_id: str, end_at: float, only_if_ended_by: float | None = None) -> None:
        """The row's end of life; with `only_if_ended_by`, only while its end is not later than that."""
        if only_if_ended_by is None:
            self._conn().execute("UPDATE e2b_sandboxes SET end_at = ? WHERE sandbox_id = ?",
                                 (end_at, sandbox_id))
        else:
            self._conn().execute("UPDATE e2b_sandboxes SET end_at = ? WHERE sandbox_id = ? AND end_at <= ?",
                                 (end_at, sandbox_id, only_if_ended_by))

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
