"""AgentENV sandbox benchmark: pause / resume / fork of real sandboxes (the Sandbox API the trainer, the
pool and the CLI use) on the warm backend, against today's Docker path and Docker's own, in one run.

Writes the `sandbox` and `server` sections of docs/benchmarks.md (unless `--no-write`) and prints them.
Usage: python bench/sandbox.py [--only sandbox|server] [--quick] [--sizes 16,128,512,1024] [--no-write]

Design: docs/design/benchmarks.md#bench-sandbox.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_variants import FASTPATH, WARM, WARM_NO_SPARES, Backends, Variant, cool, page_fill  # noqa: E402
from bench_report import busy_cores_before, host_cpu_seconds, other_load_text, write_section  # noqa: E402
from bench_stats import quantile  # noqa: E402
from state_targets import (  # noqa: E402
    FORK8,
    FORK_MEMORY,
    PAUSE_128,
    RESUME_1G,
    RESUME_128,
    RESUME_TAIL,
    judge,
    ksm_settled,
    ratios,
)

from agentenv.pool.cpu import HOST, OpCpu  # noqa: E402

MiB = 2**20
FORK_MAX_MB = 512      # fork(8) is measured up to this size (8 forks of 1 GiB: 8 GiB of memory)
DENSITY_MB, DENSITY_FORKS = 128, 8
SPARES_WAIT_S = 120.0  # spare shells of a template made again after a fork, at most this long
# The sandbox's state: what an agent's earlier steps built. Rebuilding it is what a cold start costs. The
# buffer is random bytes throughout (no two pages alike), so that KSM merges only what forks share.
WORKLOAD = r"""
import time; t0 = time.time()
import json, sqlite3, email.parser, http.client, xml.etree.ElementTree, decimal, asyncio, unittest
import argparse, logging, csv, hashlib, random, os
MB, ROWS, FILES = {mb}, {rows}, 200
rnd = random.Random(1234)
db = sqlite3.connect(':memory:')
db.execute('create table docs (id integer primary key, body text, score real)')
db.executemany('insert into docs values (?,?,?)',
               ((i, ''.join(rnd.choices('abcdefgh ', k=40)), rnd.random()) for i in range(ROWS)))
db.execute('create index docs_score on docs(score)')
os.makedirs('/workspace/project', exist_ok=True)
for i in range(FILES):
    with open(f'/workspace/project/f{{i}}.json', 'w') as f:
        f.write(json.dumps([rnd.random() for _ in range(300)]))
buf = bytearray(MB << 20)
for i in range(MB):
    buf[i << 20:(i + 1) << 20] = os.urandom(1 << 20)
open('/tmp/ready', 'w').write(str(round(time.time() - t0, 3)))
count = 0
while True:
    count += 1
    with open('/tmp/state', 'w') as f:
        f.write(str(count))
    time.sleep(0.1)
"""


def sandbox_memory(mb: int) -> str:
    """The memory limit of a sandbox whose workload touches `mb` MiB (room for Python, SQLite, tmpfs)."""
    return f"{max(mb + 384, mb * 3 // 2)}m"


@dataclass
class Samples:
    values: list[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(v)

    @property
    def p50(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def p99(self) -> float:
        return quantile(self.values, 0.99)

    def fmt(self) -> str:
        """`p50 / p99` in seconds."""
        return f"{self.p50:.3f} / {self.p99:.3f}" if self.values else "–"

    @staticmethod
    def merge(runs: list[Samples]) -> Samples:
        """Every sample of every run (a table's pooled figures)."""
        return Samples([v for r in runs for v in r.values])


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ratio(a: Samples, b: Samples) -> str:
    return f"{a.p50 / b.p50:.2f}×" if a.values and b.values else "–"


def meminfo(field_name: str) -> int:
    """One /proc/meminfo field in bytes (MemAvailable, AnonPages, Cached)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field_name}")


def host_memory() -> dict[str, int]:
    """MemAvailable (what the kernel could hand out, page cache mostly counted in), AnonPages (memory of
    processes, which only they can free) and Cached (page cache: checkpoint images read or written)."""
    return {k: meminfo(k) for k in ("MemAvailable", "AnonPages", "Cached")}


def pss_bytes(pids: list[int]) -> int:
    """The processes' summed proportional set size (/proc/<pid>/smaps_rollup's `Pss`): a page mapped by k
    processes (KSM's merged pages too) counts 1/k in each; a process gone meanwhile counts 0."""
    total = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        pss = [line for line in text.splitlines() if line.startswith("Pss:")]
        total += int(pss[0].split()[1]) * 1024 if pss else 0
    return total


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "not found"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "?"


def versions(api) -> dict[str, str]:
    """What this run ran on, detected (never assumed)."""
    v = api.version()
    return {
        "kernel": platform.release(),
        "Docker": v.get("Version", "?"),
        "containerd": _first_line(["containerd", "--version"]).split(" ")[2] if shutil.which("containerd")
        else "not found",
        "runc": _first_line(["runc", "--version"]).split(" ")[-1],
        "CRIU": _first_line(["criu", "--version"]).split(" ")[-1],
    }


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        from agentenv import SandboxConfig
        from agentenv.backend import docker_client

        self.args = args
        self.backends = Backends(root)
        self.api = docker_client.api()
        self.plain: list[str] = []  # plain containers of the Docker baselines
        with self.backends.use(WARM) as rt:
            self.image = rt.backend.resolve_image(SandboxConfig.load().image)

    # ---- AgentENV sandboxes --------------------------------------------------------------------
    def sandbox(self, mb: int, variant: Variant = WARM):
        """A sandbox of `variant` running the workload; returns (sandbox, seconds from create to READY)."""
        from agentenv import Sandbox, SandboxConfig

        cfg = SandboxConfig.load(memory=sandbox_memory(mb), tmpfs={"/tmp": "size=64m,mode=1777"},
                                 pids_limit=256)
        t = time.perf_counter()
        with self.backends.use(variant):
            sb = Sandbox.create(config=cfg)
        sb.write_file("workload.py", WORKLOAD.format(mb=mb, rows=self.args.rows))
        sb.exec("nohup python3 /workspace/workload.py >/tmp/workload.log 2>&1 &")
        wait_until(lambda: sb.exec("test -s /tmp/ready").exit_code == 0, 300,
                   lambda: sb.exec("cat /tmp/workload.log").stdout)
        return sb, time.perf_counter() - t

    @staticmethod
    def count(sb) -> int:
        return int(sb.exec("cat /tmp/state").stdout.strip() or 0)

    def processes(self, cid: str) -> list[int]:
        """Host pids of every process in the container's cgroup ([] when it runs none)."""
        from agentenv.backend.cgroups import cgroup_pids

        return cgroup_pids(int(self.api.inspect_container(cid)["State"]["Pid"] or 0))

    # ---- spare shells --------------------------------------------------------------------------
    @staticmethod
    def spares_ready(sb) -> int:
        """Spare shells of the sandbox's template ready in its registry."""
        from agentenv import spares

        rec = sb._rt.registry.get_sandbox(sb.id)
        key = spares.template_key(rec.image, rec.user, rec.config)
        return sum(1 for r in sb._rt.registry.list_sandboxes()
                   if r.state == spares.SPARE and r.labels.get(spares.TEMPLATE_LABEL) == key)

    def fork_timed(self, sb, n: int, ready: bool) -> float:
        """Seconds of `sb.fork(n)` with `n` spare shells ready, or with none (the first fork of a
        template); the forks are closed and the spares made again before it returns, so that no
        container is made in the background while the next figure is taken."""
        from agentenv import spares

        rec = sb._rt.registry.get_sandbox(sb.id)
        if ready:
            spares.replenish(sb._rt, rec.image, rec.user, rec.config, n)
            wait_until(lambda: self.spares_ready(sb) >= n, SPARES_WAIT_S, lambda: "spare shells not made")
        else:
            spares.expire(sb._rt, 0.0)
        t = time.perf_counter()
        forks = sb.fork(n)
        secs = time.perf_counter() - t
        for f in forks:
            f.close()
        wait_until(lambda: self.spares_ready(sb) >= n, SPARES_WAIT_S, lambda: "spare shells not made")
        return secs

    # ---- Docker's own paths on a plain container ---------------------------------------------
    def plain_container(self, mb: int) -> str:
        hc = self.api.create_host_config(network_mode="none", read_only=True, cap_drop=["ALL"],
                                         tmpfs={"/tmp": "size=64m,mode=1777", "/workspace": "size=64m"},
                                         mem_limit=sandbox_memory(mb),
                                         security_opt=["no-new-privileges"], pids_limit=256)
        cid = self.api.create_container(self.image, user="0",
                                        command=["python3", "-c",
                                                 WORKLOAD.format(mb=mb, rows=self.args.rows)],
                                        host_config=hc, labels={"org.k3rl.bench": "sandbox"},
                                        working_dir="/tmp")["Id"]
        self.plain.append(cid)
        self.api.start(cid)
        wait_until(lambda: self._plain_exec(cid, "test -s /tmp/ready") == 0, 300, lambda: "")
        return cid

    def _plain_exec(self, cid: str, cmd: str) -> int:
        e = self.api.exec_create(cid, ["sh", "-c", cmd])["Id"]
        self.api.exec_start(e)
        return int(self.api.exec_inspect(e)["ExitCode"])

    def docker_checkpoint_cycle(self, cid: str) -> tuple[float, float]:
        from agentenv.backend import containerd

        name = f"bench-{uuid.uuid4().hex[:8]}"
        t = time.perf_counter()
        self.api._raise_for_status(self.api._post_json(self.api._url("/containers/{0}/checkpoints", cid),
                                                       data={"CheckpointID": name, "Exit": True}))
        self.api.wait(cid, condition="not-running")
        pause = time.perf_counter() - t
        token = uuid.uuid4().hex  # marks containerd's leftover copy of this restore for removal
        with self.backends.use(WARM) as rt:
            folder = rt.backend.docker_root() / "containers" / cid / "checkpoints" / name
        (folder / containerd.RESTORE_TOKEN_FILE).write_text(token)
        t = time.perf_counter()
        self.api._raise_for_status(self.api._post(self.api._url("/containers/{0}/start", cid),
                                                  params={"checkpoint": name}))
        resume = time.perf_counter() - t
        shutil.rmtree(folder, ignore_errors=True)
        containerd.remove_restore_copies(token=token)
        return pause, resume

    def cgroup_cpu_delta(self, cid: str, window_s: float) -> float | None:
        """CPU seconds the container's cgroup used over `window_s` (None: it has no cgroup at all)."""
        from agentenv.backend.cgroups import read_usage

        pid = int(self.api.inspect_container(cid)["State"]["Pid"] or 0)
        if pid == 0:
            time.sleep(window_s)
            return None
        before = read_usage(pid).cpu_seconds
        time.sleep(window_s)
        return read_usage(pid).cpu_seconds - before

    # ---- one memory size ---------------------------------------------------------------------
    # Each phase runs inside `Backends.use` of its variant: some Sandbox calls (a fork's handles) find
    # their registry through $AGENTENV_HOME.
    def run_size(self, mb: int) -> dict[str, object]:
        """Every figure at one size (see the module docstring); per-round lists where a verdict needs them."""
        a = self.args
        out: dict[str, object] = {"mb": mb}
        print(f"-- {mb} MiB: Docker's own checkpoint and freezer, cold starts", flush=True)
        with self.backends.use(WARM):  # the cold starts' sandboxes
            out.update(self.docker_paths(mb))
        print(f"-- {mb} MiB: warm, {a.rounds} round(s)", flush=True)
        with self.backends.use(WARM):
            rounds = [self.warm_round(mb) for _ in range(a.rounds)]
        for key in rounds[0]:
            out[key] = [r[key] for r in rounds]
        print(f"-- {mb} MiB: fastpath", flush=True)
        with self.backends.use(FASTPATH):
            out.update(self.fastpath(mb))
        return out

    def docker_paths(self, mb: int) -> dict[str, object]:
        from agentenv.backend.cgroups import read_usage

        a = self.args
        cid = self.plain_container(mb)
        dk_pause, dk_resume = Samples(), Samples()
        for _ in range(a.docker_reps if mb < 512 else max(1, a.docker_reps - 1)):
            p, r = self.docker_checkpoint_cycle(cid)
            dk_pause.add(p)
            dk_resume.add(r)
        fz_pause, fz_resume, fz_rss = Samples(), Samples(), []
        for _ in range(a.reps):
            fz_pause.add(timed(lambda: self.api.pause(cid)))
            fz_rss.append(read_usage(int(self.api.inspect_container(cid)["State"]["Pid"])).rss_bytes)
            fz_resume.add(timed(lambda: self.api.unpause(cid)))
        out: dict[str, object] = {"dk_pause": dk_pause, "dk_resume": dk_resume, "fz_pause": fz_pause,
                                  "fz_resume": fz_resume, "fz_rss": min(fz_rss)}
        cold = Samples()
        for i in range(a.cold_reps):
            sb, secs = self.sandbox(mb, WARM)
            cold.add(secs)
            if i == 0 and mb == a.cpu_size:
                out["cpu"] = self.cpu_window(sb, cid)
            sb.close()
        out["cold"] = cold
        self.api.remove_container(cid, force=True)
        self.plain.remove(cid)
        return out

    def warm_round(self, mb: int) -> dict[str, object]:
        """One round on a fresh warm sandbox: pause + resume, a stopped shell's resume, forks."""
        from agentenv import spares

        a = self.args
        sb, _ = self.sandbox(mb, WARM)
        time.sleep(0.3)
        rss = sb.stats().rss_bytes
        pause, resume, fill, criu, cycle_cpu, cycle_charged = (Samples() for _ in range(6))
        procs, image = [], []
        meter = OpCpu()  # what the pool charges an operation: the runtime's cgroup when it has one
        for _ in range(a.reps):
            before = self.count(sb)
            cpu0, token = host_cpu_seconds(), meter.start()
            pause.add(timed(sb.pause))
            pause_cpu, pause_charged = host_cpu_seconds() - cpu0, meter.stop(token)
            procs.append(len(self.processes(sb.container_id)))
            image.append(sb.stats().checkpoint_bytes)
            cpu0, token = host_cpu_seconds(), meter.start()
            resume.add(timed(sb.resume))
            filled = page_fill(sb)  # the page daemon's work ends after the resume returned
            cycle_cpu.add(pause_cpu + host_cpu_seconds() - cpu0)
            restored = sb.stats().cpu_seconds_since_start  # CRIU's copies back, inside the restored processes
            cycle_charged.add(pause_charged + meter.stop(token, restored_cpu_s=restored))
            if filled is not None:
                fill.add(filled)
            if (criu_s := self.criu_restore_seconds(sb)) is not None:
                criu.add(criu_s)
            assert self.count(sb) >= before, "state lost across pause/resume"
        stopped, stopped_procs = Samples(), []
        for _ in range(a.stopped_reps):
            before = self.count(sb)
            sb.pause()
            cool(sb)
            stopped_procs.append(len(self.processes(sb.container_id)))
            stopped.add(timed(sb.resume))
            page_fill(sb)
            assert self.count(sb) >= before, "state lost across a stopped shell's resume"
        forks = {(n, ready): Samples() for n in (1, 8) for ready in (False, True)}  # (n, spares ready)
        if mb <= FORK_MAX_MB:
            sb.pause()  # a paused template: forks restore its checkpoint
            for _ in range(a.fork_reps):
                for (n, ready), samples in forks.items():
                    samples.add(self.fork_timed(sb, n, ready))
        sb.close()
        spares.expire(sb._rt, 0.0)  # none left up while the next size is measured
        return {"rss": rss, "pause": pause, "resume": resume, "fill": fill, "criu": criu,
                "cycle_cpu": cycle_cpu, "cycle_charged": cycle_charged, "cpu_source": meter.source,
                "paused_procs": max(procs), "image": max(image), "stopped": stopped,
                "stopped_procs": max(stopped_procs, default=0), "forks": forks}

    def fastpath(self, mb: int) -> dict[str, object]:
        a = self.args
        sb, _ = self.sandbox(mb, FASTPATH)
        pause, resume, cycle_cpu, fork8 = Samples(), Samples(), Samples(), Samples()
        for _ in range(a.fastpath_reps if mb < 512 else max(2, a.fastpath_reps // 2)):
            cpu0 = host_cpu_seconds()
            pause.add(timed(sb.pause))
            resume.add(timed(sb.resume))
            cycle_cpu.add(host_cpu_seconds() - cpu0)
        if mb <= FORK_MAX_MB:
            sb.pause()
            for _ in range(a.fork_reps):
                t = time.perf_counter()
                forks = sb.fork(8)
                fork8.add(time.perf_counter() - t)
                for f in forks:
                    f.close()
        sb.close()
        return {"fp_pause": pause, "fp_resume": resume, "fp_cycle_cpu": cycle_cpu, "fp_fork8": fork8}

    def criu_restore_seconds(self, sb) -> float | None:
        """How long CRIU itself took for the sandbox's last restore, from its log (None: no log here)."""
        from agentenv.backend import criu_log

        path = sb._rt.backend.restore_log(sb.container_id)
        return criu_log.restore_seconds(path) if path is not None else None

    def cpu_window(self, sb, plain: str) -> dict[str, float | None]:
        """CPU seconds over `--cpu-window` s: sandbox running, plain container frozen, sandbox paused."""
        w = self.args.cpu_window
        running = self.cgroup_cpu_delta(sb.container_id, w)
        self.api.pause(plain)
        frozen = self.cgroup_cpu_delta(plain, w)
        self.api.unpause(plain)
        sb.pause()
        before = sb.stats().cpu_seconds
        paused_cgroup = self.cgroup_cpu_delta(sb.container_id, w)  # a warm shell: its init alone
        after = sb.stats().cpu_seconds
        sb.resume()
        return {"running": running, "frozen": frozen, "paused_cgroup": paused_cgroup,
                "paused_accounted": after - before, "window": w}

    # ---- forks' memory -----------------------------------------------------------------------
    def fork_memory(self, mb: int, n: int) -> dict[str, object]:
        """`n` running forks of one paused `mb` MiB sandbox against one fork, each once KSM settled (per
        round: MemAvailable drop and summed PSS), then the `n` paused; see `measure_forks`."""
        from agentenv.backend import ksm

        sb, _ = self.sandbox(mb, WARM_NO_SPARES)  # no spare shells made in the background meanwhile
        sb.pause()
        rounds = []
        try:
            for _ in range(self.args.rounds):
                one = self.measure_forks(sb, 1)
                many = self.measure_forks(sb, n, pause_after=True)
                rounds.append({"one": one, "many": many})
        finally:
            sb.close()
        return {"n": n, "mb": mb, "rounds": rounds, "settings": ksm.describe()}

    def measure_forks(self, sb, n: int, pause_after: bool = False) -> dict[str, object]:
        """`n` forks of the paused `sb` running: the host's memory and their PSS once every page was in,
        again once KSM settled (at most `--ksm-timeout` s; the time it took, ksmd's CPU, the counters),
        and with `pause_after` once all `n` are paused again (memory, disk)."""
        from agentenv.backend import ksm

        settle()
        base = host_memory()
        disk0 = sb._rt.backend.store.usage()
        counters0, ksmd0 = ksm.counters(), ksm.ksmd_cpu_seconds()
        forks = sb.fork(n)
        t0 = time.perf_counter()
        try:
            for f in forks:
                page_fill(f)
            filled = host_memory()
            pids = [p for f in forks for p in self.processes(f.container_id)]
            pss_filled = pss_bytes(pids)
            samples: list[tuple[int, int]] = []
            deadline = time.monotonic() + (self.args.ksm_timeout if counters0 else 0.0)  # no KSM: no wait
            while time.monotonic() < deadline:
                c = ksm.counters()
                samples.append((c.get("full_scans", 0), c.get("pages_sharing", 0)))
                if ksm_settled(samples):
                    break
                time.sleep(0.2)
            settle_s, settled = time.perf_counter() - t0, ksm_settled(samples)
            ksmd1, counters1 = ksm.ksmd_cpu_seconds(), ksm.counters()
            time.sleep(1.0)  # the kernel's free page counts catch up
            running = host_memory()
            out = {"n": n, "filled_drop": base["MemAvailable"] - filled["MemAvailable"],
                   "anon_filled": filled["AnonPages"] - base["AnonPages"], "pss_filled": pss_filled,
                   "drop": base["MemAvailable"] - running["MemAvailable"],
                   "anon": running["AnonPages"] - base["AnonPages"], "pss": pss_bytes(pids),
                   "settle_s": settle_s, "settled": settled,
                   "ksmd_cpu": None if ksmd0 is None or ksmd1 is None else ksmd1 - ksmd0,
                   "counters0": counters0, "counters1": counters1}
            if pause_after:
                for f in forks:
                    f.pause()
                settle()
                paused = host_memory()
                out.update(paused_drop=base["MemAvailable"] - paused["MemAvailable"],
                           anon_paused=paused["AnonPages"] - base["AnonPages"],
                           cached_paused=paused["Cached"] - base["Cached"],
                           disk=sb._rt.backend.store.usage() - disk0,
                           paused_procs=max(len(self.processes(f.container_id)) for f in forks))
        finally:
            for f in forks:
                f.close()
        return out

    def cleanup(self) -> None:
        try:
            self.backends.close_all()
        finally:
            for cid in self.plain:
                self.api.remove_container(cid, force=True)


def wait_until(cond: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s} s: {why()[-500:]}")
        time.sleep(0.1)


def settle() -> None:
    """Write back dirty pages (checkpoint images just written) and let the kernel finish freeing memory
    before MemAvailable is read."""
    os.sync()
    time.sleep(2.0)


def pool_run(mb: int, n: int, active: int, steps: int) -> dict[str, object]:
    """n sandboxes holding `mb` MiB in a SandboxPool whose budget fits `active` of them; a random
    sequence of execs over all n: what a trainer sees (transparent resumes, LRU pauses)."""
    import random

    from agentenv import SandboxConfig
    from agentenv.pool import SandboxPool

    holder = (
        f'nohup python3 -c \'import os,time; b=bytearray(os.urandom(1<<20))*{mb}; open("/tmp/up","w"); '
        "time.sleep(10**6)' >/dev/null 2>&1 & while [ ! -e /tmp/up ]; do sleep 0.05; done"
    )
    cfg = SandboxConfig.load(memory=f"{mb + 256}m", tmpfs={"/tmp": "size=64m,mode=1777"})
    pool = SandboxPool(f"bench-{uuid.uuid4().hex[:6]}", config=cfg, idle_after_s=0.0,
                       memory_budget=int(active * (mb + 24) * MiB), rss_refresh_s=0.0)
    try:
        members = [pool.create(template="holder", setup=lambda s: s.exec(holder)) for _ in range(n)]
        rng, hit, miss, peak = random.Random(0), Samples(), Samples(), 0
        for _ in range(steps):
            m = rng.choice(members)
            (miss if m.status == "paused" else hit).add(timed(lambda m=m: m.exec("true")))
            peak = max(peak, pool.metrics().memory_used_bytes)
        metrics = pool.metrics()
    finally:
        pool.close()
    return {"n": n, "active": active, "steps": steps, "hit": hit, "miss": miss, "peak": peak,
            "metrics": metrics, "budget": pool.settings.memory_budget}


# ---- verdicts and the section ------------------------------------------------------------------------
def p50s(runs: list[Samples]) -> list[float | None]:
    """Each round's p50 (None: a round without samples)."""
    return [r.p50 if r.values else None for r in runs]


def target_verdicts(results: Mapping[int, Mapping], forks_memory: Mapping | None) -> list[str]:
    """Every target of the section judged on this run's rounds (see bench/state_targets.py)."""
    lines = []
    by_size = {mb: r for mb, r in results.items()}
    r128, r1g = by_size.get(128), by_size.get(1024)
    lines.append(judge(RESUME_128, p50s(r128["resume"]) if r128 else []).text())
    lines.append(judge(RESUME_1G, p50s(r1g["resume"]) if r1g else []).text())
    for mb, r in by_size.items():
        tails = [s.p99 / s.p50 if s.values and s.p50 else None for s in r["resume"]]
        lines.append(judge(RESUME_TAIL.at(f"at {mb} MiB"), tails).text())
    lines.append(judge(PAUSE_128, p50s(r128["pause"]) if r128 else []).text())
    for mb, r in by_size.items():
        if mb > FORK_MAX_MB:
            continue
        for ready, words in ((True, "spare shells ready"),
                             (False, "no spare shell (a template's first fork)")):
            fork8 = [rnd[(8, ready)] for rnd in r["forks"]]
            lines.append(judge(FORK8.at(f"at {mb} MiB, {words}"),
                               ratios(p50s(fork8), p50s(r["resume"]))).text())
    if forks_memory:
        rounds = forks_memory["rounds"]
        for key, words in (("drop", "(host `MemAvailable` drop)"), ("pss", "(the forks' summed PSS)")):
            lines.append(judge(FORK_MEMORY.at(words), ratios([r["many"][key] for r in rounds],
                                                             [r["one"][key] for r in rounds])).text())
    return lines


def cpu_source_words(source: str) -> str:
    return ("the host's busy time: the runtime's daemons share the root cgroup here" if source == HOST
            else f"the runtime's cgroup `{source}` plus the calling thread")


def _cpu(v: float | None) -> str:
    return "no cgroup (no process to charge)" if v is None else f"{v:.3f} s"


def _mib(v: float) -> str:
    return f"{v / MiB:.0f} MiB"


def forks_memory_text(d: Mapping) -> list[str]:
    """The forks' memory paragraph: each round's figures, KSM's settling and counters."""
    n, mb = d["n"], d["mb"]
    s = d["settings"]
    lines = ["", f"Memory of {n} running forks of one paused {mb} MiB sandbox against one fork of it, "
             "from the host (`MemAvailable` drop since the forks were made) and from their processes "
             "(summed PSS, /proc/<pid>/smaps_rollup: a page shared by k processes counts 1/k in each; "
             "beside them the rise of the host's `AnonPages`, where a merged page counts once), once "
             f"every page was in and KSM had settled (ksmd: {s.get('pages_to_scan', '?')} pages every "
             f"{s.get('sleep_millisecs', '?')} ms, `ksm_pages_to_scan` / `ksm_sleep_ms` in "
             "conf/agentenv/backend.yaml; ksmd and its counters are host-wide: another process's "
             "mergeable memory counts too). Spare shells off for this part (none made meanwhile).", "",
             f"| round | one fork: drop / AnonPages / PSS | {n} forks, pages in: the same | {n} forks, KSM "
             f"settled: the same | ratio {n}:1: the same | KSM settled after | ksmd CPU-s | pages_sharing "
             f"before → after | {n} paused: "
             "drop / disk |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(d["rounds"], 1):
        one, many = r["one"], r["many"]
        c0, c1 = many["counters0"], many["counters1"]
        settled = f"{many['settle_s']:.1f} s" + ("" if many["settled"] else " (not settled: timed out)")
        ksmd = "–" if many["ksmd_cpu"] is None else f"{many['ksmd_cpu']:.2f}"
        lines.append(
            f"| {i} | {_mib(one['drop'])} / {_mib(one['anon'])} / {_mib(one['pss'])} | "
            f"{_mib(many['filled_drop'])} / {_mib(many['anon_filled'])} / {_mib(many['pss_filled'])} | "
            f"{_mib(many['drop'])} / {_mib(many['anon'])} / {_mib(many['pss'])} | "
            f"{many['drop'] / one['drop']:.2f}× / {many['anon'] / one['anon']:.2f}× / "
            f"{many['pss'] / one['pss']:.2f}× | {settled} | {ksmd} | "
            f"{c0.get('pages_sharing', '?')} → {c1.get('pages_sharing', '?')} | "
            f"{_mib(many['paused_drop'])} / {_mib(many['disk'])} |")
    last = d["rounds"][-1]["many"]
    lines += ["", "KSM counters (host-wide) before and after the last round's forks: "
              + ", ".join(f"{k} {last['counters0'].get(k, '?')} → {last['counters1'].get(k, '?')}"
                          for k in last["counters1"])
              + f". Paused, the {n} forks' cgroups held {last['paused_procs']} process(es) each at most "
              f"(a warm shell: its init), processes' memory (`AnonPages`) {_mib(last['anon_paused'])} above "
              f"the start and page cache {_mib(last['cached_paused'])} (the images just written)."]
    return lines


def render(results: dict[int, dict], forks_memory: dict | None, pool: dict | None, facts: dict,
           cmd: str) -> str:
    load0, load1 = facts["load"]
    ver = ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
    a = facts["args"]
    lines = [
        f"Command: `{cmd}`  ",
        f"Machine: {platform.node()}, {os.cpu_count()} cores; {ver}. Backends in this one run: "
        f"`warm` ({facts['warm']['restore']}) and `fastpath` ({facts['fastpath']['restore']}), each in a "
        f"registry of its own; Docker's own checkpoint path on a plain container of the same image. "
        f"Checkpoint images on {facts['store_fs']} (local disk). Load average (1/5/15 min) before: "
        f"{' / '.join(f'{x:.2f}' for x in load0)}, after: {' / '.join(f'{x:.2f}' for x in load1)}; "
        f"{other_load_text(facts['busy'])}",
        "",
        f"Warm: {a.rounds} round(s) per size, each a fresh sandbox with {a.reps} pause + resume, "
        f"{a.stopped_reps} resumes of a stopped shell and {a.fork_reps} fork(s) of each kind; fastpath "
        f"{a.fastpath_reps} pause + resume; Docker {a.docker_reps}. Seconds, p50 / p99 of every repetition "
        "(p99 of fewer than 100: the slowest); verdicts below rest on each round's figure.",
        "",
        "| touched memory (RSS) | resume: warm shell | all pages in (warm) | resume: stopped shell | "
        "resume: fastpath | Docker's restore | warm ÷ fastpath | warm ÷ Docker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mb, r in results.items():
        resume, stopped = Samples.merge(r["resume"]), Samples.merge(r["stopped"])
        lines.append(f"| {mb} MiB (RSS {max(r['rss']) / MiB:.0f} MiB) | {resume.fmt()} | "
                     f"{Samples.merge(r['fill']).fmt()} | {stopped.fmt()} | {r['fp_resume'].fmt()} | "
                     f"{r['dk_resume'].fmt()} | {ratio(resume, r['fp_resume'])} | "
                     f"{ratio(resume, r['dk_resume'])} |")
    lines += ["", "| touched memory | pause: warm | pause: fastpath | Docker checkpoint | warm ÷ Docker | "
              "CPU-s of pause + resume: warm (page daemon in) / fastpath | charged by the pool (warm) | "
              "processes while paused: warm / stopped shell | image on disk | docker pause / unpause | "
              "cold start (create + rebuild) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mb, r in results.items():
        pause = Samples.merge(r["pause"])
        lines.append(f"| {mb} MiB | {pause.fmt()} | {r['fp_pause'].fmt()} | {r['dk_pause'].fmt()} | "
                     f"{ratio(pause, r['dk_pause'])} | {Samples.merge(r['cycle_cpu']).p50:.3f} / "
                     f"{r['fp_cycle_cpu'].p50:.3f} | {Samples.merge(r['cycle_charged']).p50:.3f} | "
                     f"{max(r['paused_procs'])} / {max(r['stopped_procs'])} | {_mib(max(r['image']))} | "
                     f"{r['fz_pause'].p50:.3f} / {r['fz_resume'].p50:.3f} | {r['cold'].fmt()} |")
    forked = {mb: r for mb, r in results.items() if mb <= FORK_MAX_MB}
    if forked:
        lines += ["", f"Forks (sizes up to {FORK_MAX_MB} MiB), warm: spare shells ready (made after the "
                  "previous fork of the template) or none (the first fork of a template); fastpath makes "
                  "no spare shells.", "",
                  "| touched memory | one resume (warm) | fork(8), no spare shell | fork(8), spares ready | "
                  "fork(8) ÷ one resume: none / ready | fork(1) p50: none / ready | fork(8): fastpath |",
                  "|---|---|---|---|---|---|---|"]
        for mb, r in forked.items():
            one = Samples.merge(r["resume"])
            f = {k: Samples.merge([rnd[k] for rnd in r["forks"]]) for k in r["forks"][0]}
            lines.append(f"| {mb} MiB | {one.p50:.3f} | {f[(8, False)].fmt()} | {f[(8, True)].fmt()} | "
                         f"{ratio(f[(8, False)], one)} / {ratio(f[(8, True)], one)} | "
                         f"{f[(1, False)].p50:.3f} / {f[(1, True)].p50:.3f} | {r['fp_fork8'].fmt()} |")
    lines += ["", "Targets, from this run (each the median of the rounds' figures, min–max):", ""]
    lines += [f"- {v}" for v in target_verdicts(results, forks_memory)]
    sizes = sorted(results)
    if len(sizes) > 1:
        lo, hi = (Samples.merge(results[m]["resume"]).p50 for m in (sizes[0], sizes[-1]))
        lines += ["", f"Lazy pages keep a resume nearly flat in size: {hi:.3f} s at {sizes[-1]} MiB against "
                  f"{lo:.3f} s at {sizes[0]} MiB ({hi / lo:.2f}×); the pages arrive after it returns (the "
                  "all-pages column)."]
    cores = os.cpu_count() or 1
    lines.append("")
    for mb, r in results.items():
        resume = Samples.merge(r["resume"])
        criu = Samples.merge(r["criu"])
        criu_words = (f"CRIU's own restore, from its log, {criu.p50:.3f} s of it" if criu.values
                      else "CRIU's restore log not found")
        lines.append(f"- {mb} MiB: warm resume {resume.p50:.3f} s ({criu_words}); a pause + resume "
                     f"{Samples.merge(r['cycle_cpu']).p50:.3f} CPU-s of the host until the last page was in, "
                     f"{Samples.merge(r['cycle_charged']).p50:.3f} CPU-s charged by the pool "
                     f"({cpu_source_words(r['cpu_source'][0])}); on {cores} cores.")
    cpu = next((r["cpu"] for r in results.values() if "cpu" in r), None)
    if cpu:
        lines += ["", f"CPU over {cpu['window']:.0f} s, from the cgroup (cpuacct): running sandbox "
                  f"{_cpu(cpu['running'])} (its workload wakes every 0.1 s); `docker pause` (frozen) "
                  f"{_cpu(cpu['frozen'])}; paused sandbox (its warm shell's init) "
                  f"{_cpu(cpu['paused_cgroup'])}, "
                  f"accounted CPU time advanced {cpu['paused_accounted']:.3f} s."]
    if forks_memory:
        lines += forks_memory_text(forks_memory)
    if pool:
        pm = pool["metrics"]
        lines += [
            "",
            f"SandboxPool (warm; {pool['n']} sandboxes of 128 MiB, budget {pool['budget'] / MiB:.0f} MiB = "
            f"room for {pool['active']} running, idle_after_s 0, {pool['steps']} execs on random members): "
            f"exec on a running member {pool['hit'].fmt()} s, on a paused one {pool['miss'].fmt()} s "
            f"(p50 / p99; {len(pool['miss'].values)} of {pool['steps']} execs needed a transparent resume); "
            f"{pm.pauses} LRU pauses (p50 {pm.pause_p50_s:.2f} s), {pm.resumes} resumes (p50 "
            f"{pm.resume_p50_s:.2f} s), {pm.warm_starts} warm starts (p50 {pm.warm_start_p50_s:.2f} s) from "
            f"one template (cold start {pm.cold_start_p50_s:.2f} s); peak RSS of running members "
            f"{pool['peak'] / MiB:.0f} MiB.",
        ]
    lines += ["", f"How: warm: {facts['warm']['dump']}; fastpath: {facts['fastpath']['dump']}. CPU-s: the "
              "host's busy CPU time (/proc/stat, every core and process) from the call until the last page "
              "was in: the cost when nothing else runs (see the load above). Memory dirty tracking "
              f"(pre-dump): {facts['dirty']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 and 128 MiB, one round, fewer repetitions")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated MiB (default 16,128,512,1024; quick 16,128)")
    ap.add_argument("--rounds", type=int, default=None, help="warm rounds per size (default 3, quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="pause/resume repetitions per round")
    ap.add_argument("--rows", type=int, default=400_000, help="SQLite rows the workload builds (cold start)")
    ap.add_argument("--forks-memory", dest="forks_memory", action=argparse.BooleanOptionalAction,
                    default=True, help="measure 8 running forks' memory against one (KSM)")
    ap.add_argument("--ksm-timeout", type=float, default=None, help="seconds KSM may take to settle")
    ap.add_argument("--cpu-window", type=float, default=10.0, help="seconds of the paused-CPU window")
    ap.add_argument("--no-pool", dest="pool", action="store_false", help="skip the SandboxPool run")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    ap.add_argument("--only", choices=("sandbox", "server"), default=None,
                    help="run one part: sandbox (pause/resume/fork vs Docker) or server (e2b SDK vs local)")
    ap.add_argument("--paused", type=int, default=200, help="paused sandboxes the server holds (server part)")
    ap.add_argument("--server-reps", type=int, default=30, help="timed commands per side (server part)")
    args = ap.parse_args(argv)
    for name in ("rounds", "reps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1")
    cmd = "python bench/sandbox.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.only != "server":
        sandbox_part(args, cmd.strip())
    if args.only != "sandbox":
        server_part(args, cmd.strip())


def server_part(args: argparse.Namespace, cmd: str) -> None:
    """The `server` section (see bench/sandbox_server.py)."""
    from importlib.metadata import version

    import sandbox_server

    print(f"== server: e2b SDK vs local, {args.paused} paused sandboxes", flush=True)
    text = sandbox_server.render(sandbox_server.run(args.paused, args.server_reps), cmd, version("e2b"))
    print(text)
    if not args.no_write:
        write_section("server", text)


def sandbox_part(args: argparse.Namespace, cmd: str) -> None:
    """The `sandbox` section: warm against fastpath and Docker's paths, forks, forks' memory, the pool."""
    try:
        sizes = [int(s) for s in (args.sizes or ("16,128" if args.quick else "16,128,512,1024")).split(",")]
    except ValueError:
        raise SystemExit(f"--sizes takes comma-separated MiB, e.g. 16,128 (got {args.sizes!r})") from None
    if any(mb < 1 for mb in sizes):
        raise SystemExit(f"--sizes must be positive MiB (got {args.sizes!r})")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.reps = args.reps or (3 if args.quick else 7)
    args.stopped_reps = 2 if args.quick else 3
    args.fastpath_reps = 2 if args.quick else 5
    args.docker_reps = 1 if args.quick else 3
    args.cold_reps = 1 if args.quick else 3
    args.fork_reps = 1 if args.quick else 2
    args.cpu_size = 128 if 128 in sizes else sizes[0]
    args.ksm_timeout = args.ksm_timeout or (60.0 if args.quick else 180.0)

    root = Path(tempfile.mkdtemp(prefix="agentenv-bench-"))  # private registries: nobody else's touched
    bench = Bench(args, root)
    with bench.backends.use(WARM) as rt:
        warm = rt.backend.describe()
    with bench.backends.use(FASTPATH) as rt:
        fastpath = rt.backend.describe()
    facts = {"versions": versions(bench.api), "warm": warm, "fastpath": fastpath, "args": args,
             "store_fs": warm["checkpoint_store_fs"],
             "dirty": "yes" if warm["criu_dirty_tracking"] else "off on this kernel",
             "load": [os.getloadavg()], "busy": busy_cores_before()}
    results: dict[int, dict] = {}
    forks_memory = pool = None
    try:
        if args.forks_memory:  # first, before Docker's own checkpoint path moved the host's page cache
            print(f"== forks' memory: {DENSITY_FORKS} x {DENSITY_MB} MiB", flush=True)
            with bench.backends.use(WARM_NO_SPARES):
                forks_memory = bench.fork_memory(DENSITY_MB, DENSITY_FORKS)
        for mb in sizes:
            print(f"== {mb} MiB", flush=True)
            results[mb] = bench.run_size(mb)
        if args.pool:
            print("== SandboxPool", flush=True)
            with bench.backends.use(WARM):
                pool = pool_run(128, n=4 if args.quick else 8, active=2 if args.quick else 3,
                                steps=12 if args.quick else 30)
    finally:
        try:
            bench.cleanup()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    facts["load"].append(os.getloadavg())
    text = render(results, forks_memory, pool, facts, cmd)
    print(text)
    if not args.no_write:
        write_section("sandbox", text)


if __name__ == "__main__":
    main()
