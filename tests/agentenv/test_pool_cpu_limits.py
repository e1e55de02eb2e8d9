"""`SpareCores` honours the limits on this process's CPU: its affinity (`taskset`) and the CPU quotas on
its cgroup path (v1 ``cpu.cfs_quota_us`` here, v2 ``cpu.max``, at its cgroup and every ancestor). The
limits are real: a process started under `taskset`, and one moved into a v1 cpu cgroup this test makes
(and removes), each report what `agentenv.pool.cpu` computes in them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from agentenv.pool import cpu

REPORT = """
import json, subprocess, sys
from agentenv.pool.cpu import SpareCores
spare = SpareCores(window_s=5.0, min_span_s=0.5)
burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if "--burn" in sys.argv else None
try:
    idle = spare()
finally:
    if burner:
        burner.kill()
        burner.wait()
print(json.dumps({"cpus": getattr(spare, "cpus", None), "quota": spare.quota, "cores": spare.cores,
                  "spare": idle}))
"""


def report(prefix: Sequence[str] = (), burn: bool = False, cgroup: Path | None = None) -> dict:
    """What `SpareCores` computes in a new process started under ``prefix`` (e.g. taskset), placed in
    ``cgroup`` (its cgroup.procs) before it runs Python; ``burn``: while a child keeps one CPU busy."""
    def enter() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    done = subprocess.run([*prefix, sys.executable, "-c", REPORT, *(["--burn"] if burn else [])],
                          capture_output=True, text=True, timeout=60, preexec_fn=enter if cgroup else None)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_process_under_taskset_counts_only_its_cpu():
    one = sorted(os.sched_getaffinity(0))[-1]
    seen = report(["taskset", "-c", str(one)])
    assert seen["cpus"] == [one] and seen["cores"] == 1.0 and seen["spare"] <= 1.0
    busy = report(["taskset", "-c", str(one)], burn=True)  # the burner inherits the affinity
    assert busy["cpus"] == [one] and busy["spare"] < 0.25, busy


V1_CPU = Path("/sys/fs/cgroup/cpu")


@contextlib.contextmanager
def v1_cgroup(quota_us: int, inner_quota_us: int) -> Iterator[Path]:
    """A v1 cpu cgroup with ``quota_us`` per 100 ms and a child with ``inner_quota_us`` (-1: none); yields
    the child; both are removed after (their processes have exited by then)."""
    if not (V1_CPU / "cpu.cfs_quota_us").exists() or not os.access(V1_CPU, os.W_OK):
        pytest.fail("no writable cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu: the tests run as root on a "
                    "cgroup v1 host (the bootstrap's target); this host lacks it")
    outer = V1_CPU / f"k3rl-test-{uuid.uuid4().hex[:8]}"
    inner = outer / "inner"
    outer.mkdir()
    try:
        (outer / "cpu.cfs_period_us").write_text("100000")
        (outer / "cpu.cfs_quota_us").write_text(str(quota_us))
        inner.mkdir()
        (inner / "cpu.cfs_period_us").write_text("100000")
        (inner / "cpu.cfs_quota_us").write_text(str(inner_quota_us))
        yield inner
    finally:
        for folder in (inner, outer):
            with contextlib.suppress(FileNotFoundError):
                folder.rmdir()


def test_a_v1_cpu_quota_on_the_cgroup_path_caps_the_cores():
    cpus = sorted(os.sched_getaffinity(0))
    with v1_cgroup(50_000, -1) as inner:  # the parent's quota binds the child, which sets none
        seen = report(cgroup=inner)
    assert not inner.exists() and not inner.parent.exists()
    assert seen["quota"] == 0.5 and seen["cores"] == 0.5 and seen["spare"] <= 0.5
    with v1_cgroup(150_000, 30_000) as inner:  # the tighter of the two
        assert report(cgroup=inner)["cores"] == 0.3
    with v1_cgroup(150_000, -1) as inner:  # the affinity, when fewer CPUs than the quota's 1.5 cores
        pinned = report(["taskset", "-c", str(cpus[0])], cgroup=inner)
        free = report(cgroup=inner)
    assert (pinned["quota"], pinned["cores"]) == (1.5, 1.0)
    assert free["cores"] == min(len(cpus), 1.5)


def test_quotas_are_read_at_the_mounts_named_by_mountinfo_v2_and_a_namespaced_v1(tmp_path):
    """cgroup v2 ``cpu.max`` on an ancestor binds (``max`` sets none); a v1 hierarchy mounted from a
    container's cgroup (mount root ``/docker/abc``) is read at its mount point; the smaller quota wins."""
    unified, v1 = tmp_path / "unified", tmp_path / "cpu,cpuacct"
    (unified / "a" / "b").mkdir(parents=True)
    (unified / "a" / "cpu.max").write_text("200000 100000\n")
    (unified / "a" / "b" / "cpu.max").write_text("max 100000\n")
    v1.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"30 23 0:26 / {unified} rw,nosuid - cgroup2 cgroup2 rw\n"
        f"31 23 0:27 /docker/abc {v1} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
        f"32 23 0:28 / {tmp_path / 'memory'} rw - cgroup cgroup rw,memory\n"
        "33 23 8:1 / / rw - ext4 /dev/sda1 rw\n")
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/a/b\n")
    assert cpu.cpu_quota_cores(proc_cgroup, mountinfo) == 2.0  # v1 sets no quota (no files there)
    (v1 / "cpu.cfs_quota_us").write_text("75000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu.cpu_quota_cores(proc_cgroup, mountinfo) == 0.75
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (unified / "a" / "cpu.max").write_text("max 100000\n")
    assert cpu.cpu_quota_cores(proc_cgroup, mountinfo) is None
    proc_cgroup.write_text("4:cpu,cpuacct:/elsewhere\n")  # outside the mounted part: not readable here
    (v1 / "cpu.cfs_quota_us").write_text("10000\n")
    assert cpu.cpu_quota_cores(proc_cgroup, mountinfo) is None
    assert cpu.effective_cores([0, 1, 2], 2.5) == 2.5 and cpu.effective_cores([3], 2.5) == 1.0
