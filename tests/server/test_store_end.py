"""The E2B store's end of life: the reaper's conditional update never overrides an end that a connect set
after the reaper read the row as expired (a resumed sandbox then keeps its time to live)."""

from __future__ import annotations

import time

from agentenv.server.store import E2BStore


def test_a_conditional_end_leaves_a_later_end_alone(tmp_path):
    store = E2BStore(tmp_path)
    store.insert("sb1", "base", {}, {}, timeout_s=0, auto_pause=False)
    now = time.time() + 1
    assert "sb1" in store.expired(now)
    store.set_end("sb1", now + 600)  # a connect between the reaper's read and its update
    store.set_end("sb1", 9e12, only_if_ended_by=now)
    assert store.get("sb1").end_at == now + 600 and "sb1" not in store.expired(now)
    store.set_end("sb1", now - 5)
    store.set_end("sb1", 9e12, only_if_ended_by=now)  # still expired: the update applies
    assert store.get("sb1").end_at == 9e12
