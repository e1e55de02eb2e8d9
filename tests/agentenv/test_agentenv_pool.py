"""SandboxPool on real sandboxes: LRU pausing under a memory budget, transparent resume on exec, warm
starts from a template, leases that keep busy sandboxes running, and use from threads and processes."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable

import pytest
from agentenv_testutil import ROOT, TOKEN_PROCESS

from agentenv import SandboxConfig
from agentenv.errors import ConfigError
from agentenv.pool import PoolBudgetExceeded, PoolSettings, SandboxPool

pytestmark = pytest.mark.docker


@pytest.fixture
def pool_factory(base_image):
    """Pools of small sandboxes in the session's private $AGENTENV_HOME; every pool made is closed
    (members and templates) after the test."""
    config = SandboxConfig.load(memory="128m", pids_limit=64, tmpfs={"/tmp": "size=32m,mode=1777"},
                                exec_timeout_s=60.0, lock_timeout_s=120.0)
    made: list[SandboxPool] = []

    def make(name: str, **overrides) -> SandboxPool:
        pool = SandboxPool(f"{name}-{uuid.uuid4().hex[:6]}", config=config, **overrides)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def test_pool_settings_reject_bad_values():
    s = PoolSettings.load()
    assert s.memory_budget > 0
    with pytest.raises(ConfigError, match="memory_budget"):
        PoolSettings.load(memory_budget="-3g")
    with pytest.raises(ConfigError, match="warm_starts"):
        PoolSettings.load(warm_starts="sometimes")
    with pytest.raises(ConfigError, match="idle_after_s"):
        PoolSettings.load(idle_after_s=-1)


def token_of(sb) -> str:
    """The token as held by the process: read from its memory-backed file (/tmp is a tmpfs)."""
    return sb.exec("cat /tmp/token").stdout.strip()


def test_lru_idle_member_is_paused_and_exec_resumes_it(pool_factory):
    pool = pool_factory("lru", memory_budget=1, idle_after_s=0.0)
    a = pool.create(template="with-token", setup=lambda s: s.exec(TOKEN_PROCESS))
    token = token_of(a)
    b = pool.create(template="with-token")
    assert token_of(b) == token, "a warm start is a fork of the template: same memory"
    # Creating b needed room: a, idle and least recently used, was paused to disk.
    assert a.status == "paused" and b.status == "running"
    # An exec on the paused member resumes it (and pauses b, now the LRU idle one).
    assert token_of(a) == token
    assert a.status == "running" and b.status == "paused"
    m = pool.metrics()
    assert m.pauses >= 2 and m.resumes >= 1 and m.warm_starts == 2 and m.cold_starts == 1
    assert m.running == 1 and m.paused == 1 and m.templates == 1
    assert math.isfinite(m.pause_p50_s) and m.pause_p90_s >= m.pause_p50_s
    assert math.isfinite(m.resume_p50_s) and m.disk_bytes > 0 and m.over_budget >= 1


def test_leased_member_is_never_paused_and_strict_budget_raises(pool_factory):
    pool = pool_factory("lease", memory_budget=1, idle_after_s=0.0, strict_budget=True, warm_starts=False)
    a = pool.create()
    with pool.using(a):
        with pytest.raises(PoolBudgetExceeded, match="budget"):
            pool.ensure_budget(0)
        assert a.status == "running"
    pool.ensure_budget(0)  # released: now it can go
    assert a.status == "paused"
    with pytest.raises(PoolBudgetExceeded):  # strict: resuming it would not fit either
        a.exec("echo back")
    assert a.status == "paused"


def test_members_closed_by_their_owners_while_the_budget_pauses_them_count_as_freed(
        pool_factory, monkeypatch, caplog):
    """The budget reads the running members, then pauses them one by one; an owner may close its member
    in between (before the pause looks at it, or while the pause runs). Either way its memory is gone:
    the budget counts it freed and drops it, and logs no failed pause."""
    pool = pool_factory("gone", memory_budget=1, idle_after_s=0.0, warm_starts=False)
    a = pool.create()
    with pool.using(a):  # in use: creating b (over the 1-byte budget) cannot pause it
        b = pool.create()
    assert (a.status, b.status) == ("running", "running")
    over_before = pool.metrics().over_budget
    read_running = pool._running

    def running_then_owners_close():
        running, used = read_running()
        for _member, sb, _rss in running:
            if sb.id == a.id:
                sb.close()  # closed before the pause looks at it
            elif sb.id == b.id:
                pause = sb.pause

                def close_then_pause(sb=sb, pause=pause):
                    sb.close()  # closed while the pause runs
                    return pause()

                sb.pause = close_then_pause
        return running, used

    monkeypatch.setattr(pool, "_running", running_then_owners_close)
    with caplog.at_level("WARNING", logger="agentenv"):
        assert pool.ensure_budget(0) == 0, "both closed members' memory counts as freed"
    assert not [r for r in caplog.records if "could not pause" in r.getMessage()], caplog.text
    assert (a.status, b.status) == ("closed", "closed")
    assert {m.sandbox_id for m in pool.state.members()}.isdisjoint({a.id, b.id}), "dropped from the pool"
    assert pool.metrics().over_budget == over_before, "the budget was kept"


def test_concurrent_threads_share_a_tight_pool(pool_factory):
    pool = pool_factory("threads", memory_budget="8m", idle_after_s=0.0)
    members = [pool.create() for _ in range(3)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(3):
                r = members[i].exec(f"echo {i}-{j} >> /workspace/log && cat /workspace/log | wc -l")
                assert r.exit_code == 0 and int(r.stdout) == j + 1, r
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert {m.status for m in members} <= {"running", "paused"}


def test_second_process_sees_and_resumes_members(pool_factory):
    pool = pool_factory("procs", memory_budget="1g", idle_after_s=0.0)
    a = pool.create()
    a.exec("echo from-parent > /workspace/note")
    assert pool.pause(a) and a.status == "paused"
    script = textwrap.dedent(
        f"""
        from agentenv.pool import SandboxPool
        pool = SandboxPool({pool.name!r}, memory_budget="1g", idle_after_s=0.0)
        print(pool.get({a.id!r}).exec("cat /workspace/note").stdout.strip())
        print(len(pool.members()))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["from-parent", "1"]
    assert a.status == "running", "the other process resumed it through the shared registry"


def test_a_lease_holder_killed_mid_exec_loses_nothing_and_its_lease_expires(pool_factory):
    """kill -9 of a process that holds a lease on a member (inside `using`, an exec running): the member
    is still there, running, with its files; its lease (a committed row of the pool's state file, which
    commits without fsync) still keeps the pool from pausing it, until `lease_timeout_s` ends it."""
    pool = pool_factory("killed", memory_budget="1g", idle_after_s=0.0, lease_timeout_s=3.0)
    a = pool.create()
    a.exec("echo kept > /workspace/note")
    script = textwrap.dedent(
        f"""
        from agentenv.pool import SandboxPool
        pool = SandboxPool({pool.name!r}, memory_budget="1g", idle_after_s=0.0, lease_timeout_s=3.0)
        with pool.using({a.id!r}) as sb:
            print("leased", flush=True)
            sb.exec("sleep 60")
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "leased"
        holder.kill()  # SIGKILL while it holds the lease and its exec runs
        assert holder.wait(timeout=30) == -9
    finally:
        if holder.poll() is None:
            holder.kill()
    killed_at = time.monotonic()
    assert a.status == "running" and a.exec("cat /workspace/note").stdout.strip() == "kept"
    if time.monotonic() - killed_at < 2.5:  # the dead holder's lease is still live: no pause yet
        assert not pool.pause(a)
    deadline = time.monotonic() + 30
    while not pool.pause(a):  # it ends with its timeout, then the pool pauses the member
        assert time.monotonic() < deadline, "the dead holder's lease never expired"
        time.sleep(0.2)
    assert a.status == "paused"
    assert a.exec("cat /workspace/note").stdout.strip() == "kept"  # resumed, nothing lost


def test_a_lazily_resumed_member_is_counted_at_its_full_size(pool_factory):
    """A resume with lazy pages returns with few pages in and no checkpoint left. The member's recorded
    size (what a budget slot must hold) stays what its pause wrote, not that first footprint: else one
    pause + resume shrinks the slot size and the residency admits more sandboxes than its budget holds."""
    pool = pool_factory("lazy", memory_budget="1g", idle_after_s=3600.0)
    a = pool.create()
    a.exec("python3 -c \"import os; b = bytearray(64 * 2**20)\n"
           "for i in range(0, len(b), 4096): b[i] = 1\nos.mkfifo('/tmp/go'); open('/tmp/go').read()\" "
           ">/dev/null 2>&1 & while [ ! -p /tmp/go ]; do sleep 0.05; done")
    assert pool.pause(a)
    checkpoint = a.sandbox.stats().checkpoint_bytes
    assert checkpoint >= 64 * 2**20
    slot_before = pool.residency.sandbox_bytes()
    assert a.exec("true").exit_code == 0  # a transparent resume
    assert pool.state.get(a.id).rss_bytes >= checkpoint
    pool.residency._size_at = -math.inf  # re-read the members' sizes now
    assert pool.residency.sandbox_bytes() >= max(slot_before, checkpoint)


def test_the_bench_memory_sampler_counts_a_pools_forks_restored_into_spare_shells(pool_factory):
    """bench/train.py's host-side memory sampler finds a pool's sandboxes by the registry's labels: a fork
    restored into a spare shell runs in a container made before the pool named it, which Docker's labels
    do not name (the sampler once read those and missed every such fork)."""
    sys.path.append(str(ROOT / "bench"))
    from train import SandboxMemorySampler

    from agentenv.backend.docker_client import api
    from agentenv.pool.pool import LABEL_POOL
    from agentenv.runtime import runtime

    name = f"sampled{uuid.uuid4().hex[:6]}"
    pool = pool_factory(name, memory_budget="1g", idle_after_s=3600.0)
    a = pool.create()
    a.exec("python3 -c \"import os, time; b = os.urandom(24 * 2**20); time.sleep(3600)\" >/dev/null 2>&1 &")
    forks = pool.fork(a, 1)
    deadline = time.monotonic() + 60  # the fork's process makes a spare again in the background
    while not [r for r in runtime().registry.list_sandboxes() if r.state == "spare"]:
        assert time.monotonic() < deadline, "no spare shell was made after the fork"
        time.sleep(0.2)
    forks += pool.fork(a, 1)
    containers = {sb.sandbox.container_id for sb in (a, *forks)}
    unlabelled = [c for c in containers if LABEL_POOL not in api().inspect_container(c)["Config"]["Labels"]]
    assert unlabelled, "no fork ran in a spare shell: the test checks nothing"
    parts = SandboxMemorySampler(name)._sample()
    assert {c[:12] for c in containers} <= {p["container"] for p in parts}, parts  # with the pool's template
    assert sum(p["rss"] for p in parts) >= 24 * 2**20, parts  # forks may share the source's pages (KSM)


def spare_rows_of(member) -> Callable[[], list]:
    """A reader of the registry's spare shells of ``member``'s kind (image, user and config)."""
    from agentenv import spares
    from agentenv.runtime import runtime

    registry = runtime().registry
    rec = registry.get_sandbox(member.id)
    kind = spares.template_key(rec.image, rec.user, rec.config)
    return lambda: [r for r in registry.list_sandboxes()
                    if r.state == spares.SPARE and r.labels.get(spares.TEMPLATE_LABEL) == kind]


def containers_of_this_home() -> set[str]:
    from agentenv.backend.docker_client import api
    from agentenv.runtime import runtime

    return {c["Id"] for c in api().containers(
        all=True, filters={"label": f"org.k3rl.agentenv.home={runtime().home}"})}


def test_a_closed_pool_leaves_no_spare_shells_behind(pool_factory):
    """A warm start forks the pool's template, and the fork makes a spare shell in the background for the
    next one. Closing the pool right away (a run's end) waits for that shell and removes it with the
    template: no started container outlives the pool."""
    pool = pool_factory("spares", memory_budget="1g", idle_after_s=3600.0)
    a = pool.create()
    spare_rows, container = spare_rows_of(a), a.sandbox.container_id
    pool.close()
    time.sleep(0.5)  # a shell still being made would have its row by now
    assert spare_rows() == []
    assert container not in containers_of_this_home(), "the member's container is still there"


def test_a_closed_pool_removes_the_spare_shells_of_its_members_forks(pool_factory):
    """Without warm starts a pool has no template, yet forking a running member (a tree's branch) makes
    a spare shell in the background for the next fork of its kind. Closing the pool removes it: a tree
    run once left one started container behind at its end."""
    pool = pool_factory("branch-spares", memory_budget="1g", idle_after_s=3600.0, warm_starts=False)
    a = pool.create()
    spare_rows = spare_rows_of(a)
    pool.fork(a, 1)
    deadline = time.monotonic() + 60
    while not spare_rows():
        assert time.monotonic() < deadline, "no spare shell was made after the fork: the test checks nothing"
        time.sleep(0.2)
    made = {r.container for r in spare_rows()}
    pool.close()
    assert spare_rows() == []
    assert not made & containers_of_this_home(), "the spare shell's container outlived the pool"
