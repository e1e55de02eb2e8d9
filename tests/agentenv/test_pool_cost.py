"""`PauseCostModel`: over budget, pause only as many waiting sandboxes as the budget needs; under it, pause
all when the wait exceeds the pool's pause + resume p50s (wall) and their CPU fits the host's spare cores
over the wait (priors of conf/agentenv/pool.yaml until measured `cost_min_samples` times). No docker:
the decision reads the pool's event log, which the tests fill."""

from __future__ import annotations

import sqlite3
import time
import uuid

import pytest

from agentenv.pool import PAUSE_POLICIES, PauseCostModel, SandboxPool, cpu
from agentenv.pool.cost import budget_count
from agentenv.pool.cpu import HOST, CpuReading, OpCpu, cgroup_cpu_seconds, runtime_cgroups
from agentenv.pool.state import PoolState

MIB = 2**20


@pytest.fixture
def pool(agentenv_home):
    """A pool with no members: its event log is what the cost model reads."""
    p = SandboxPool(f"cost-{uuid.uuid4().hex[:6]}", memory_budget="1m", cost_min_samples=3,
                    pause_prior_s=0.25, resume_prior_s=0.3, pause_cpu_prior_s=0.2, resume_cpu_prior_s=0.3)
    yield p
    p.close()


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_priors_until_measured_then_the_pools_live_p50s(pool):
    model = PauseCostModel(pool, spare_cores=lambda: 2.0)
    assert model.cost_s() == pytest.approx(0.55) and model.cpu_s() == pytest.approx(0.5)
    for d in (0.1, 0.2, 2.0):  # the pool's measured pauses (what `SandboxPool._timed` records)
        pool.state.record("pause", d, cpu_s=d / 2)
    for d in (0.4, 0.5):
        pool.state.record("resume", d, cpu_s=d)
    assert model.cost_s() == pytest.approx(0.2 + 0.3)  # live pause p50; resumes still on their prior
    assert model.cpu_s() == pytest.approx(0.1 + 0.3)
    pool.state.record("resume", 0.6, cpu_s=0.6)
    assert model.cost_s() == pytest.approx(0.2 + 0.5) and model.cpu_s() == pytest.approx(0.1 + 0.5)
    keep, pause = model.decide(0.69, running_bytes=0), model.decide(0.71, running_bytes=0)
    assert (keep.count, keep.reason) == (0, "keep") and (pause.count, pause.reason) == (1, "cost")
    assert pause.expected_wait_s == 0.71 and pause.cost_s == pytest.approx(0.7)


def test_under_budget_the_pauses_cpu_must_fit_the_spare_cores_over_the_wait(pool):
    """64 sandboxes waiting 5 s at 0.5 CPU-s each need 32 CPU-s: kept on a host with 2 idle cores (10
    CPU-s over the wait), paused on one with 8; a wait shorter than the wall cost never asks the CPU."""
    asked = []

    def spare(cores: float):
        return lambda: asked.append(cores) or cores

    busy = PauseCostModel(pool, spare_cores=spare(2.0)).decide(5.0, running_bytes=0, n=64)
    assert (busy.count, busy.reason, busy.spare_cores) == (0, "cpu", 2.0)
    idle = PauseCostModel(pool, spare_cores=spare(8.0)).decide(5.0, running_bytes=0, n=64)
    assert (idle.count, idle.reason) == (64, "cost") and idle.cpu_s == pytest.approx(0.5)
    assert PauseCostModel(pool, spare_cores=spare(0.0)).decide(5.0, running_bytes=0, n=1).reason == "cpu"
    asked.clear()
    short = PauseCostModel(pool, spare_cores=spare(8.0)).decide(0.5, running_bytes=0, n=64)
    assert (short.count, short.reason, asked) == (0, "keep", [])


def test_over_budget_pauses_only_what_the_budget_needs_largest_first(pool):
    budget = pool.settings.memory_budget  # 1 MiB
    model = PauseCostModel(pool, spare_cores=lambda: 0.0)  # no spare CPU: the budget pauses anyway
    sizes = [MIB, 3 * MIB, 2 * MIB, MIB]
    over = budget + 4 * MIB
    decision = model.decide(0.0, running_bytes=over, n=4, sizes=sizes)
    assert (decision.count, decision.reason) == (2, "budget")  # 3 + 2 MiB free the 4 MiB over
    assert budget_count(sizes, budget + 1, budget) == 1
    assert budget_count(sizes, budget, budget) == 0
    assert budget_count(sizes, budget + 100 * MIB, budget) == 4  # not enough: all of them
    assert budget_count([MIB, 0], budget + 2 * MIB, budget) == 2  # an unknown size: all of them
    assert model.decide(0.0, running_bytes=over, n=3).count == 3  # no sizes given: all
    assert model.decide(0.0).pause is False  # no running member: 0 bytes, under budget


def test_fixed_policies(pool):
    over = pool.settings.memory_budget + 1
    assert PauseCostModel(pool, "never").decide(100.0, running_bytes=over, n=4).count == 0
    assert PauseCostModel(pool, "always").decide(0.0, running_bytes=0, n=4).count == 4
    assert PAUSE_POLICIES == ("cost", "never", "always")
    with pytest.raises(ValueError, match="pause policy must be one of cost, never, always"):
        PauseCostModel(pool, "sometimes")


class _Counter:
    """A CPU counter the test moves by hand: `RuntimeCpu`'s shape."""

    def __init__(self, source: str) -> None:
        self.reading = CpuReading(100.0, source)

    def add(self, seconds: float, source: str | None = None) -> None:
        self.reading = CpuReading(self.reading.seconds + seconds, source or self.reading.source)

    def __call__(self) -> CpuReading:
        return self.reading


def test_op_cpu_splits_the_hosts_busy_time_among_operations_in_flight():
    counter = _Counter(HOST)
    meter = OpCpu(counter)
    first, second = meter.start(), meter.start()
    counter.add(0.6)
    _burn(0.05)  # the host's counter already holds the caller's own time: not added again
    one = meter.stop(first)
    counter.add(0.2)
    two = meter.stop(second)
    assert one == pytest.approx(0.3) and two == pytest.approx(0.5)
    assert meter.stop(first) == 0.0  # stopped once
    assert meter.source == HOST


def test_op_cpu_from_the_runtimes_cgroup_adds_the_callers_own_time_and_skips_a_change_of_source():
    counter = _Counter("/sys/fs/cgroup/cpuacct/k3rl-runtime")
    meter = OpCpu(counter)
    token = meter.start()
    counter.add(0.4)
    t = time.thread_time()
    _burn(0.1)
    own = time.thread_time() - t
    charged = meter.stop(token)
    assert 0.4 + own <= charged < 0.4 + own + 0.05  # the runtime's share plus this thread's CPU
    token = meter.start()
    counter.add(0.1)
    assert 0.35 <= meter.stop(token, restored_cpu_s=0.25) < 0.4  # a restore: the restored sandbox's CPU
    token = meter.start()
    counter.add(50.0, HOST)  # the daemon went back to the root cgroup: readings cannot be subtracted
    assert meter.stop(token) < 0.05
    token = meter.start()
    counter.add(0.2)
    assert meter.stop(token, restored_cpu_s=0.25) == pytest.approx(0.2)  # the host's count holds it already


def test_cgroup_cpu_counters_of_both_cgroup_versions(tmp_path):
    v1, v2, none = tmp_path / "v1", tmp_path / "v2", tmp_path / "none"
    for folder in (v1, v2, none):
        folder.mkdir()
    (v1 / "cpuacct.usage").write_text("1500000000\n")
    (v2 / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert cgroup_cpu_seconds(v1) == pytest.approx(1.5)
    assert cgroup_cpu_seconds(v2) == pytest.approx(2.5)
    with pytest.raises(FileNotFoundError):  # a cgroup that went away
        cgroup_cpu_seconds(none)
    (none / "cpu.stat").write_text("nr_periods 0\n")
    with pytest.raises(OSError, match="no CPU usage counter"):
        cgroup_cpu_seconds(none)


def test_runtime_cgroups_outermost_and_none_when_a_daemon_is_in_the_root(monkeypatch, tmp_path):
    root = tmp_path / "cgroup"
    where = {1: root / "cpuacct" / "k3rl-runtime", 2: root / "cpuacct" / "k3rl-runtime" / "shim",
             3: root / "cpuacct" / "other", 4: root / "cpuacct"}
    monkeypatch.setattr(cpu, "cgroup_dirs", lambda pid: {"cpuacct": where[pid]})
    assert runtime_cgroups([1, 2, 3], root) == [where[1], where[3]]
    assert runtime_cgroups([1, 4], root) == []  # the root's CPU is the host's: no runtime counter
    assert runtime_cgroups([], root) == []


def test_timed_pool_events_record_their_cpu(pool):
    pool._timed("pause", lambda: _burn(0.2))
    cpu_p50 = pool.state.percentiles("pause", 10, "cpu_s")[0]
    assert cpu_p50 >= 0.15  # (`SpareCores` against real limits: test_pool_cpu_limits.py)


def test_event_logs_from_before_the_cpu_column_get_it(tmp_path):
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, "
                 "duration_s REAL NOT NULL, t REAL NOT NULL)")
    conn.execute("INSERT INTO events (kind, duration_s, t) VALUES ('pause', 0.5, 0)")
    conn.commit()
    conn.close()
    state = PoolState(path)
    state.record("pause", 0.7, cpu_s=0.4)
    assert state.percentiles("pause", 10, "cpu_s") == (0.2, 0.4)
    with pytest.raises(ValueError, match="no event column"):
        state.percentiles("pause", 10, "kind")
