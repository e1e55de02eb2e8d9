"""The pool's shared bookkeeping: members, their last use and leases, templates, and timed events.

SQLite (WAL) at `$AGENTENV_HOME/pools/<name>.sqlite3`, so every thread and process using the pool of
that name sees the same members. Two small protocols make pausing safe against concurrent use:

* `lease(id)`: an exec (or any use) holds a lease on its sandbox; a lease refuses while the sandbox is
  being paused (`claim_for_pause` holds it) and expires after `lease_timeout_s` (a crashed holder).
* `claim_for_pause(id)`: succeeds only when no live lease exists, and blocks new leases until
  `end_pause`. Both are single `BEGIN IMMEDIATE` transactions, hence atomic across processes.
"""

from __future__ import annotations

import sqlite3
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.registry import connect_wal

SCHEMA = """
CREATE TABLE IF NOT EXISTS members (
    sandbox_id   TEXT PRIMARY KEY,
    last_used    REAL NOT NULL,
    leases       INTEGER NOT NULL DEFAULT 0,
    lease_until  REAL NOT NULL DEFAULT 0,
    pausing_since REAL NOT NULL DEFAULT 0,   -- 0: not being paused
    rss_bytes    INTEGER NOT NULL DEFAULT 0,  -- last measured RSS (estimate of what a resume needs)
    rss_at       REAL NOT NULL DEFAULT 0,     -- when rss_bytes was measured
    template     TEXT,                        -- the template it was forked from (NULL: cold start)
    paused       INTEGER NOT NULL DEFAULT 0,  -- as the pool last left it (1: paused by the pool)
    held_pause   INTEGER NOT NULL DEFAULT 0,  -- 1: paused through its handle: a use must resume it first
    state_since  REAL NOT NULL DEFAULT 0      -- when it entered that state (sandbox-seconds accounting)
);
CREATE TABLE IF NOT EXISTS clock (
    state        TEXT PRIMARY KEY,            -- running | paused
    seconds      REAL NOT NULL                -- sandbox-seconds spent in it by members no longer in it
);
CREATE TABLE IF NOT EXISTS templates (
    key          TEXT PRIMARY KEY,
    sandbox_id   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    kind         TEXT NOT NULL,   -- pause | resume | warm_start | cold_start | fork | over_budget
    duration_s   REAL NOT NULL,
    t            REAL NOT NULL,
    cpu_s        REAL NOT NULL DEFAULT 0  -- CPU seconds charged to it (pool.cpu.OpCpu)
);
CREATE INDEX IF NOT EXISTS events_by_kind ON events(kind, id);
"""


@dataclass(frozen=True)
class Member:
    sandbox_id: str
    last_used: float
    leases: int
    lease_until: float
    pausing_since: float
    rss_bytes: int
    rss_at: float
    template: str | None
    paused: int
    state_since: float
    held_pause: int = 0

    def leased(self, now: float) -> bool:
        return self.leases > 0 and self.lease_until > now


class PoolState:
    """Rows of one pool; one SQLite connection per thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._conn().executescript(SCHEMA)
        columns = {r[1] for r in self._conn().execute("PRAGMA table_info(members)")}
        added = ("rss_at REAL", "paused INTEGER", "state_since REAL", "held_pause INTEGER")
        for column in added:  # pool files from before these columns
            if column.split()[0] not in columns:
                self._conn().execute(f"ALTER TABLE members ADD COLUMN {column} NOT NULL DEFAULT 0")
        if "cpu_s" not in {r[1] for r in self._conn().execute("PRAGMA table_info(events)")}:
            self._conn().execute("ALTER TABLE events ADD COLUMN cpu_s REAL NOT NULL DEFAULT 0")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect_wal(self.path, timeout_s=60.0)
            # a commit is not fsynced (WAL stays consistent; a power loss may drop the last leases and
            # counters, which a lease's timeout and the next measurement make good): a step takes a lease
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    def _tx(self):
        return _Transaction(self._conn())

    # ---- members -----------------------------------------------------------------------------
    def add(self, sandbox_id: str, rss_bytes: int = 0, template: str | None = None) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT OR REPLACE INTO members (sandbox_id, last_used, rss_bytes, template, state_since) "
                "VALUES (?,?,?,?,?)",
                (sandbox_id, time.time(), rss_bytes, template, time.time()),
            )

    def drop(self, sandbox_id: str) -> None:
        with self._tx() as c:
            self._close_interval(c, sandbox_id, time.time())
            c.execute("DELETE FROM members WHERE sandbox_id=?", (sandbox_id,))

    # ---- sandbox-seconds ---------------------------------------------------------------------
    @staticmethod
    def _close_interval(c: sqlite3.Connection, sandbox_id: str, now: float) -> sqlite3.Row | None:
        """Add the member's time in its current state to that state's clock (inside a transaction)."""
        r = c.execute("SELECT paused, state_since FROM members WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        if r is not None and r["state_since"]:
            c.execute(
                "INSERT INTO clock (state, seconds) VALUES (?, ?) "
                "ON CONFLICT(state) DO UPDATE SET seconds = seconds + excluded.seconds",
                ("paused" if r["paused"] else "running", max(0.0, now - r["state_since"])),
            )
        return r

    def mark(self, sandbox_id: str, paused: bool) -> None:
        """The pool paused (or resumed) a member: its time so far goes to the state it leaves. A pause by
        its holder (`hold_pause`) is recorded after this one."""
        now = time.time()
        with self._tx() as c:
            r = self._close_interval(c, sandbox_id, now)
            if r is not None:
                c.execute(
                    "UPDATE members SET paused=?, state_since=?, held_pause=0 WHERE sandbox_id=?",
                    (int(paused), now, sandbox_id),
                )

    def hold_pause(self, sandbox_id: str) -> None:
        """Record that the member's holder paused it through its handle: a use through a handle is refused
        until it is resumed (`mark` clears it)."""
        with self._tx() as c:
            c.execute("UPDATE members SET held_pause=1 WHERE sandbox_id=?", (sandbox_id,))

    def sandbox_seconds(self) -> tuple[float, float]:
        """(running, paused) sandbox-seconds of all members ever, up to now: the sum over members of
        the time each spent running and paused (pauses and resumes made through the pool)."""
        now = time.time()
        clock = {r["state"]: r["seconds"] for r in self._conn().execute("SELECT * FROM clock")}
        running, paused = clock.get("running", 0.0), clock.get("paused", 0.0)
        for r in self._conn().execute("SELECT paused, state_since FROM members WHERE state_since > 0"):
            if r["paused"]:
                paused += now - r["state_since"]
            else:
                running += now - r["state_since"]
        return running, paused

    def members(self) -> list[Member]:
        rows = self._conn().execute("SELECT * FROM members ORDER BY last_used").fetchall()
        return [Member(**dict(r)) for r in rows]

    def get(self, sandbox_id: str) -> Member | None:
        r = self._conn().execute("SELECT * FROM members WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return Member(**dict(r)) if r else None

    def set_rss(self, sandbox_id: str, rss_bytes: int) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE members SET rss_bytes=?, rss_at=? WHERE sandbox_id=?",
                (rss_bytes, time.time(), sandbox_id),
            )

    # ---- leases and pause claims -------------------------------------------------------------
    def lease(self, sandbox_id: str, timeout_s: float, stale_pause_s: float) -> bool:
        """Take a lease unless the sandbox is being paused (False: retry shortly)."""
        now = time.time()
        with self._tx() as c:
            r = c.execute("SELECT pausing_since FROM members WHERE sandbox_id=?", (sandbox_id,)).fetchone()
            if r is None:
                return True  # not (or no longer) a member: nothing to coordinate with
            if r["pausing_since"] and now - r["pausing_since"] < stale_pause_s:
                return False
            c.execute(
                "UPDATE members SET leases = CASE WHEN lease_until > ? THEN leases + 1 ELSE 1 END, "
                "lease_until = ?, last_used = ?, pausing_since = 0 WHERE sandbox_id=?",
                (now, now + timeout_s, now, sandbox_id),
            )
        return True

    def release(self, sandbox_id: str) -> None:
        with self._tx() as c:
            c.execute(
                "UPDATE members SET leases = MAX(leases - 1, 0), last_used = ? WHERE sandbox_id=?",
                (time.time(), sandbox_id),
            )

    def claim_for_pause(self, sandbox_id: str) -> bool:
        now = time.time()
        with self._tx() as c:
            r = c.execute("SELECT * FROM members WHERE sandbox_id=?", (sandbox_id,)).fetchone()
            if r is None or Member(**dict(r)).leased(now) or r["pausing_since"]:
                return False
            c.execute("UPDATE members SET pausing_since=?, leases=0 WHERE sandbox_id=?", (now, sandbox_id))
        return True

    def end_pause(self, sandbox_id: str) -> None:
        with self._tx() as c:
            c.execute("UPDATE members SET pausing_since=0 WHERE sandbox_id=?", (sandbox_id,))

    # ---- templates ---------------------------------------------------------------------------
    def template(self, key: str) -> str | None:
        r = self._conn().execute("SELECT sandbox_id FROM templates WHERE key=?", (key,)).fetchone()
        return r["sandbox_id"] if r else None

    def set_template(self, key: str, sandbox_id: str | None) -> None:
        with self._tx() as c:
            if sandbox_id is None:
                c.execute("DELETE FROM templates WHERE key=?", (key,))
            else:
                c.execute(
                    "INSERT OR REPLACE INTO templates (key, sandbox_id) VALUES (?,?)", (key, sandbox_id)
                )

    def templates(self) -> dict[str, str]:
        return {r["key"]: r["sandbox_id"] for r in self._conn().execute("SELECT * FROM templates")}

    # ---- events and metrics ------------------------------------------------------------------
    def record(self, kind: str, duration_s: float, cpu_s: float = 0.0) -> None:
        """One timed event: its wall seconds and the host CPU seconds charged to it."""
        with self._tx() as c:
            c.execute(
                "INSERT INTO events (kind, duration_s, t, cpu_s) VALUES (?,?,?,?)",
                (kind, duration_s, time.time(), cpu_s),
            )

    def count(self, kind: str) -> int:
        return self._conn().execute("SELECT COUNT(*) FROM events WHERE kind=?", (kind,)).fetchone()[0]

    def percentiles(self, kind: str, window: int, column: str = "duration_s") -> tuple[float, float]:
        """(p50, p90) of the last `window` durations (``column="cpu_s"``: CPU seconds) of this kind; NaN
        when there are none."""
        if column not in ("duration_s", "cpu_s"):
            raise ValueError(f"no event column {column!r}")
        rows = (
            self._conn()
            .execute(f"SELECT {column} FROM events WHERE kind=? ORDER BY id DESC LIMIT ?", (kind, window))
            .fetchall()
        )
        values = sorted(r[0] for r in rows)
        if not values:
            return float("nan"), float("nan")
        p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
        return statistics.median(values), p90


class _Transaction:
    """`with` block = one `BEGIN IMMEDIATE` transaction (write lock taken at the start)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
