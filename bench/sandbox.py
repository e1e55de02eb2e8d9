"""AgentENV sandbox benchmark: pause / resume / fork of real sandboxes (the Sandbox API the trainer, the
pool and the CLI use) against Docker's own paths, with paused footprints measured from the host.

For sandboxes holding 16, 128 and 512 MiB of touched memory (a Python process that imported its
libraries, built an SQLite index and wrote project files, then filled its buffer), in one run:

* AgentENV (`Sandbox.pause/resume/fork` on the configured backend): pause, resume, fork(8) of a paused
  sandbox, warm start (fork(1));
* Docker's checkpoint path on a plain container of the same image running the same process:
  `docker checkpoint create` / `docker start --checkpoint`;
* Docker's freezer: `docker pause` / `docker unpause` (fast, but the memory stays);
* cold start: a new sandbox until the same state is rebuilt.

Paused footprint, from the host: the container's cgroup must hold no process; the drop in the host's
`MemAvailable` for N sandboxes running vs paused; bytes of checkpoint images on disk; CPU time of the
sandbox's cgroup over a 10 s window (running, frozen by `docker pause`, paused by AgentENV). The versions
(kernel, Docker, containerd, runc, CRIU), the load average before and after, and the cores other processes
kept busy just before the run (the load average lags by a minute) are detected and printed.

Part `server` (bench/sandbox_server.py): `agentenv serve` through the real e2b SDK vs local sandboxes
in the same run (commands.run("true"), create -> first command), and one server holding >= 200 paused
sandboxes (its own RSS, time to reach a random one).

Writes the `sandbox` and `server` sections of docs/benchmarks.md (unless `--no-write`) and prints them.
Usage: python bench/sandbox.py [--only sandbox|server] [--quick] [--sizes 16,128,512] [--reps N]
       [--paused 200] [--no-write]
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_report import busy_cores_before, host_cpu_seconds, other_load_text, write_section  # noqa: E402

from agentenv.pool.cpu import HOST, OpCpu  # noqa: E402

MiB = 2**20
# The sandbox's state: what an agent's earlier steps built. Rebuilding it is what a cold start costs.
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
buf = bytearray(os.urandom(1 << 20)) * MB
open('/tmp/ready', 'w').write(str(round(time.time() - t0, 3)))
count = 0
while True:
    count += 1
    with open('/tmp/state', 'w') as f:
        f.write(str(count))
    time.sleep(0.1)
"""


@dataclass
class Samples:
    values: list[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(v)

    @property
    def p50(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def p90(self) -> float:
        if not self.values:
            return float("nan")
        s = sorted(self.values)
        return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]

    def fmt(self) -> str:
        return f"{self.p50:.3f} / {self.p90:.3f}" if self.values else "–"


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
    def __init__(self, args: argparse.Namespace) -> None:
        from agentenv import SandboxConfig
        from agentenv.backend import docker_client
        from agentenv.sandbox import runtime

        self.args = args
        self.rt = runtime()
        self.backend = self.rt.backend
        self.api = docker_client.api()
        self.config = SandboxConfig.load
        self.plain: list[str] = []  # plain containers of the Docker baselines
        self.sandboxes: list = []

    # ---- AgentENV sandboxes --------------------------------------------------------------------
    def sandbox(self, mb: int):
        """A sandbox running the workload; returns (sandbox, seconds from create to READY)."""
        from agentenv import Sandbox

        cfg = self.config(memory=f"{mb + 384}m", tmpfs={"/tmp": "size=64m,mode=1777"}, pids_limit=256)
        t = time.perf_counter()
        sb = Sandbox.create(config=cfg)
        self.sandboxes.append(sb)
        sb.write_file("workload.py", WORKLOAD.format(mb=mb, rows=self.args.rows))
        sb.exec("nohup python3 /workspace/workload.py >/tmp/workload.log 2>&1 &")
        wait_until(lambda: sb.exec("test -s /tmp/ready").exit_code == 0, 300,
                   lambda: sb.exec("cat /tmp/workload.log").stdout)
        return sb, time.perf_counter() - t

    @staticmethod
    def count(sb) -> int:
        return int(sb.exec("cat /tmp/state").stdout.strip() or 0)

    def no_process_left(self, sb) -> bool:
        """Host view of a paused sandbox: Docker has no pid for it and no cgroup of it has a process."""
        state = self.api.inspect_container(sb.container_id)["State"]
        cgroups = [p for p in Path("/sys/fs/cgroup").glob(f"*/docker/{sb.container_id}") if p.is_dir()]
        procs = sum(len((p / "cgroup.procs").read_text().split()) for p in cgroups
                    if (p / "cgroup.procs").exists())
        return state["Pid"] == 0 and procs == 0

    # ---- Docker's own paths on a plain container ---------------------------------------------
    def plain_container(self, mb: int) -> str:
        hc = self.api.create_host_config(network_mode="none", read_only=True, cap_drop=["ALL"],
                                         tmpfs={"/tmp": "size=64m,mode=1777", "/workspace": "size=64m"},
                                         mem_limit=f"{mb + 384}m",
                                         security_opt=["no-new-privileges"], pids_limit=256)
        cid = self.api.create_container(self.sandboxes[-1].image, user="0",
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
        folder = self.backend.docker_root() / "containers" / cid / "checkpoints" / name
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
    def run_size(self, mb: int) -> dict[str, object]:
        from agentenv.backend.cgroups import read_usage

        a = self.args
        out: dict[str, object] = {}
        cold = Samples()
        for _ in range(a.cold_reps):
            sb, secs = self.sandbox(mb)
            cold.add(secs)
            sb.close()
        out["cold"] = cold
        sb, _ = self.sandbox(mb)
        time.sleep(0.3)
        out["running_rss"] = sb.stats().rss_bytes
        pause, resume, image, empty = Samples(), Samples(), [], []
        resume_cpu, criu_restore, cycle_cpu, cycle_runtime = Samples(), Samples(), Samples(), Samples()
        meter = OpCpu()  # what the pool charges an operation: the runtime's cgroup when it has one
        for _ in range(a.reps):
            before = self.count(sb)
            cpu0, token = host_cpu_seconds(), meter.start()
            pause.add(timed(sb.pause))
            pause_cpu, pause_runtime = host_cpu_seconds() - cpu0, meter.stop(token)
            empty.append(self.no_process_left(sb) and sb.stats().rss_bytes == 0)
            image.append(sb.stats().checkpoint_bytes)
            cpu, token = host_cpu_seconds(), meter.start()
            resume.add(timed(sb.resume))
            resume_cpu.add(host_cpu_seconds() - cpu)
            restored = sb.stats().cpu_seconds_since_start  # CRIU's copies back, inside the restored processes
            cycle_runtime.add(pause_runtime + meter.stop(token, restored_cpu_s=restored))
            cycle_cpu.add(pause_cpu + resume_cpu.values[-1])
            if (criu_s := self.criu_restore_seconds(sb)) is not None:
                criu_restore.add(criu_s)
            assert self.count(sb) >= before, "state lost across pause/resume"
        out.update(pause=pause, resume=resume, image=max(image), paused_empty=all(empty),
                   resume_cpu=resume_cpu, criu_restore=criu_restore, cycle_cpu=cycle_cpu,
                   cycle_runtime=cycle_runtime, cpu_source=meter.source)

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
        out.update(dk_pause=dk_pause, dk_resume=dk_resume, fz_pause=fz_pause, fz_resume=fz_resume,
                   fz_rss=min(fz_rss))
        if mb == a.cpu_size:
            out["cpu"] = self.cpu_window(sb, cid)
        self.api.remove_container(cid, force=True)
        self.plain.remove(cid)

        sb.pause()  # a paused template: warm starts and fork(8) restore its checkpoint
        warm, fork8, fork8_cpu = Samples(), Samples(), Samples()
        for _ in range(a.fork_reps):
            for n, samples in ((1, warm), (8, fork8)):
                cpu, t = host_cpu_seconds(), time.perf_counter()
                forks = sb.fork(n)
                samples.add(time.perf_counter() - t)
                if n == 8:
                    fork8_cpu.add(host_cpu_seconds() - cpu)
                for f in forks:
                    f.close()
        out.update(warm=warm, fork8=fork8, fork8_cpu=fork8_cpu)
        sb.close()
        return out

    def criu_restore_seconds(self, sb) -> float | None:
        """How long CRIU itself took for the sandbox's last restore, from its log (None: no log here)."""
        from agentenv.backend import criu_log

        path = self.backend.restore_log(sb.container_id)
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
        paused_cgroup = self.cgroup_cpu_delta(sb.container_id, w)  # None: no cgroup exists to charge
        after = sb.stats().cpu_seconds
        sb.resume()
        return {"running": running, "frozen": frozen, "paused_cgroup": paused_cgroup,
                "paused_accounted": after - before, "window": w}

    # ---- density -----------------------------------------------------------------------------
    def density(self, mb: int, n: int) -> dict[str, object]:
        """n forks of one paused `mb` MiB sandbox: host MemAvailable and disk, running vs paused."""
        sb, _ = self.sandbox(mb)
        sb.pause()
        settle()
        base = host_memory()
        disk0 = self.backend.store.usage()
        forks = sb.fork(n)
        settle()
        running = host_memory()
        for f in forks:
            f.pause()
        settle()
        paused = host_memory()
        running_drop, paused_drop = (base["MemAvailable"] - m["MemAvailable"] for m in (running, paused))
        anon_running, anon_paused = (m["AnonPages"] - base["AnonPages"] for m in (running, paused))
        cached_paused = paused["Cached"] - base["Cached"]
        disk = self.backend.store.usage() - disk0
        empty = all(self.no_process_left(f) for f in forks)
        reach = Samples()
        for f in forks:
            reach.add(timed(f.resume))
            f.pause()
        for f in [*forks, sb]:
            f.close()
        return {"n": n, "running_drop": running_drop, "paused_drop": paused_drop, "disk": disk,
                "anon_running": anon_running, "anon_paused": anon_paused, "cached_paused": cached_paused,
                "reach": reach, "empty": empty}

    def cleanup(self) -> None:
        from agentenv import Sandbox

        for sb in Sandbox.list():  # the private registry: this run's sandboxes and forks only
            try:
                sb.close()
            except Exception as e:  # noqa: BLE001 - report and go on cleaning
                print(f"cleanup: {sb.id}: {e}", file=sys.stderr)
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


RESUME_TARGET_S = 0.25


def target_verdicts(r: dict) -> str:
    """Each target of the section met or missed at one size, with its figure."""
    one = r["resume"].p50
    checks = [
        (f"resume p50 ≤ {RESUME_TARGET_S} s", one <= RESUME_TARGET_S, f"{one:.3f} s"),
        ("resume ≤ 0.1× Docker's restore", one <= 0.1 * r["dk_resume"].p50,
         ratio(r["resume"], r["dk_resume"])),
        ("pause ≤ 0.3× Docker's checkpoint", r["pause"].p50 <= 0.3 * r["dk_pause"].p50,
         ratio(r["pause"], r["dk_pause"])),
        ("fork(8) ≤ 2× one resume", r["fork8"].p50 <= 2 * one, f"{r['fork8'].p50 / one:.1f}×"),
    ]
    return "; ".join(f"{name} **{'met' if ok else 'missed'}** ({figure})" for name, ok, figure in checks)


def cpu_source_words(source: str) -> str:
    return ("the host's busy time: the runtime's daemons share the root cgroup here" if source == HOST
            else f"the runtime's cgroup `{source}` plus the calling thread")


def _cpu(v: float | None) -> str:
    return "no cgroup (no process to charge)" if v is None else f"{v:.3f} s"


def render(results: dict[int, dict], dens: dict | None, pool: dict | None, facts: dict, cmd: str) -> str:
    load0, load1 = facts["load"]
    ver = ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
    lines = [
        f"Command: `{cmd}`  ",
        f"Machine: {platform.node()}, {os.cpu_count()} cores; {ver}. Backend `{facts['backend']}` "
        f"({facts['reason']}); checkpoint images on {facts['store_fs']} (local disk). Load average "
        f"(1/5/15 min) before: {' / '.join(f'{x:.2f}' for x in load0)}, after: "
        f"{' / '.join(f'{x:.2f}' for x in load1)}; {other_load_text(facts['busy'])}",
        "",
        "Seconds, median / p90 of the repetitions; AgentENV = `Sandbox.pause/resume/fork` (what the trainer, "
        "the pool and the CLI call); ratio = AgentENV ÷ Docker's checkpoint path on a plain container of the "
        "same image running the same process.",
        "",
        "| touched memory (RSS) | pause | Docker checkpoint | ratio | resume | Docker restore | ratio | "
        "fork(8) | warm start (fork 1) | cold start (create + rebuild) | docker pause / unpause | "
        "paused: process left / RSS kept by docker pause | image on disk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mb, r in results.items():
        lines.append(
            f"| {mb} MiB (RSS {r['running_rss'] / MiB:.0f} MiB) | {r['pause'].fmt()} | "
            f"{r['dk_pause'].fmt()} | "
            f"{ratio(r['pause'], r['dk_pause'])} | {r['resume'].fmt()} | {r['dk_resume'].fmt()} | "
            f"{ratio(r['resume'], r['dk_resume'])} | {r['fork8'].fmt()} | {r['warm'].fmt()} | "
            f"{r['cold'].fmt()} | {r['fz_pause'].p50:.3f} / {r['fz_resume'].p50:.3f} | "
            f"{'none' if r['paused_empty'] else 'YES'} / {r['fz_rss'] / MiB:.0f} MiB | "
            f"{r['image'] / MiB:.0f} MiB |"
        )
    lines += ["", "Targets, from this run: resume p50 ≤ 0.25 s and ≤ 0.1× Docker's restore; pause ≤ 0.3× "
              "Docker's checkpoint; fork(8) ≤ 2× one resume.", ""]
    lines += [f"- {mb} MiB: {target_verdicts(r)}" for mb, r in results.items()]
    lines.append("")
    cores = os.cpu_count() or 1
    for mb, r in results.items():
        one = r["resume"].p50
        criu = (f"CRIU's own restore, from its log, {r['criu_restore'].p50:.3f} s of it"
                if r["criu_restore"].values else "CRIU's restore log not found")
        lines.append(
            f"- {mb} MiB: resume {one:.3f} s = {ratio(r['resume'], r['dk_resume'])} of Docker's ({criu}; "
            f"the host's CPU busy for {r['resume_cpu'].p50:.3f} CPU-s); pause "
            f"{ratio(r['pause'], r['dk_pause'])} of Docker's; fork(8) = {r['fork8'].p50 / one:.1f}× one "
            f"resume, using {r['fork8_cpu'].p50:.2f} CPU-s of the host: on {cores} cores its restores "
            f"cannot take less than {r['fork8_cpu'].p50 / cores:.2f} s = "
            f"{r['fork8_cpu'].p50 / cores / one:.1f}× one resume; "
            f"warm start {ratio(r['warm'], r['cold'])} of a cold start; a pause + resume "
            f"{r['cycle_cpu'].p50:.3f} CPU-s of the host, {r['cycle_runtime'].p50:.3f} CPU-s charged by "
            f"the pool ({cpu_source_words(r['cpu_source'])})."
        )
    lines += ["", "CPU-s: the host's busy CPU time over the call (/proc/stat, every core and process: "
              "dockerd, containerd, runc and CRIU included): the call's cost when nothing else runs "
              "(see the load above). Charged by the pool: `agentenv.pool.cpu.OpCpu`, what the cost model "
              "weighs a pause by: the runtime's own cgroup (its daemons, shims, runc, CRIU and their "
              "helpers), the calling thread and, on a resume, the restored processes' cgroup (CRIU copies "
              "the memory back inside them); without the dumped processes' share (CRIU's parasite "
              "copying their pages out) or kernel threads writing the images back."]
    cpu = next((r["cpu"] for r in results.values() if "cpu" in r), None)
    if cpu:
        lines += [
            "",
            f"CPU over {cpu['window']:.0f} s, from the cgroup (cpuacct): running sandbox "
            f"{_cpu(cpu['running'])} (its workload wakes every 0.1 s); `docker pause` (frozen) "
            f"{_cpu(cpu['frozen'])}; paused sandbox "
            f"{_cpu(cpu['paused_cgroup'])}, accounted CPU time advanced {cpu['paused_accounted']:.3f} s.",
        ]
    if dens:
        n = dens["n"]
        lines += [
            "",
            f"Footprint of {n} forks of one paused 128 MiB sandbox, from the host (measured before the "
            "Docker baselines above ran): `MemAvailable` dropped by "
            f"{dens['running_drop'] / MiB:.0f} MiB with all {n} running "
            f"({dens['running_drop'] / n / MiB:.0f} MiB "
            f"each) and by {dens['paused_drop'] / MiB:.0f} MiB with all {n} paused; processes' memory "
            f"(`AnonPages`) rose by {dens['anon_running'] / MiB:.0f} MiB running and "
            f"{dens['anon_paused'] / MiB:.0f} MiB paused, while the page cache grew by "
            f"{dens['cached_paused'] / MiB:.0f} MiB (the checkpoint images just written, which the kernel "
            "can drop, partly counted as unavailable in `MemAvailable`); process left in their "
            f"cgroups while paused: {'none' if dens['empty'] else 'YES'}; checkpoint images on disk "
            f"{dens['disk'] / MiB:.0f} MiB ({dens['disk'] / n / MiB:.0f} MiB each); each was reachable again "
            "in "
            f"{dens['reach'].fmt()} s (resume p50 / p90).",
        ]
    if pool:
        pm = pool["metrics"]
        lines += [
            "",
            f"SandboxPool ({pool['n']} sandboxes of 128 MiB, budget {pool['budget'] / MiB:.0f} MiB = room "
            f"for {pool['active']} running, idle_after_s 0, {pool['steps']} execs on random members): exec "
            f"on a running member {pool['hit'].fmt()} s, on a paused one {pool['miss'].fmt()} s (p50 / p90; "
            f"{len(pool['miss'].values)} of {pool['steps']} execs needed a transparent resume); "
            f"{pm.pauses} LRU pauses (p50 {pm.pause_p50_s:.2f} s), {pm.resumes} resumes (p50 "
            f"{pm.resume_p50_s:.2f} s), {pm.warm_starts} warm starts (p50 {pm.warm_start_p50_s:.2f} s) from "
            f"one template (cold start {pm.cold_start_p50_s:.2f} s); peak RSS of running members "
            f"{pool['peak'] / MiB:.0f} MiB.",
        ]
    lines += [
        "",
        f"How: {facts['dump']}; restore = {facts['restore']}; forks restore the same images in parallel. "
        f"CRIU lazy pages (userfaultfd) here: {facts['lazy']}; memory dirty tracking (pre-dump): "
        f"{facts['dirty']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 and 128 MiB, fewer repetitions")
    ap.add_argument("--sizes", default=None, help="comma-separated MiB (default 16,128,512; quick 16,128)")
    ap.add_argument("--reps", type=int, default=None, help="pause/resume repetitions per size")
    ap.add_argument("--rows", type=int, default=400_000, help="SQLite rows the workload builds (cold start)")
    ap.add_argument("--density", type=int, default=None, help="forks in the footprint run (0 = skip)")
    ap.add_argument("--cpu-window", type=float, default=10.0, help="seconds of the paused-CPU window")
    ap.add_argument("--no-pool", dest="pool", action="store_false", help="skip the SandboxPool run")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    ap.add_argument("--only", choices=("sandbox", "server"), default=None,
                    help="run one part: sandbox (pause/resume/fork vs Docker) or server (e2b SDK vs local)")
    ap.add_argument("--paused", type=int, default=200, help="paused sandboxes the server holds (server part)")
    ap.add_argument("--server-reps", type=int, default=30, help="timed commands per side (server part)")
    args = ap.parse_args(argv)
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
    """The `sandbox` section: pause/resume/fork vs Docker's paths, footprint, the pool."""
    sizes = [int(s) for s in (args.sizes or ("16,128" if args.quick else "16,128,512")).split(",")]
    args.reps = args.reps or (3 if args.quick else 7)
    args.docker_reps = 2 if args.quick else 4
    args.cold_reps = 1 if args.quick else 3
    args.fork_reps = 2 if args.quick else 3
    args.cpu_size = 128 if 128 in sizes else sizes[0]
    n_density = args.density if args.density is not None else (4 if args.quick else 12)

    home = tempfile.mkdtemp(prefix="agentenv-bench-")
    os.environ["AGENTENV_HOME"] = home  # a private registry: nothing of anyone else's is touched
    bench = Bench(args)
    info = bench.backend.describe()
    facts = {"versions": versions(bench.api), "backend": bench.backend.name, "reason": bench.backend.reason,
             "store_fs": info["checkpoint_store_fs"], "dump": info["dump"], "restore": info["restore"],
             "lazy": ("uffd-noncoop yes, not used: Docker's restore cannot ask for them (section "
                      "`restore-paths` measures restores through runc with and without them)")
             if info["criu_lazy_pages"] else "no",
             "dirty": "yes" if info["criu_dirty_tracking"] else "off on this kernel",
             "load": [os.getloadavg()], "busy": busy_cores_before()}
    results: dict[int, dict] = {}
    dens = pool = None
    try:
        if n_density:  # first: measured after Docker's own checkpoint path (below), the host's
            # MemAvailable moved by hundreds of MiB that were not the forks' (a drop below zero)
            print(f"== footprint: {n_density} x 128 MiB", flush=True)
            dens = bench.density(128, n_density)
        for mb in sizes:
            print(f"== {mb} MiB", flush=True)
            results[mb] = bench.run_size(mb)
            print({k: (v.fmt() if isinstance(v, Samples) else v) for k, v in results[mb].items()}, flush=True)
        if args.pool:
            print("== SandboxPool", flush=True)
            pool = pool_run(128, n=4 if args.quick else 8, active=2 if args.quick else 3,
                            steps=12 if args.quick else 30)
    finally:
        bench.cleanup()
        shutil.rmtree(home, ignore_errors=True)
    facts["load"].append(os.getloadavg())
    text = render(results, dens, pool, facts, cmd)
    print(text)
    if not args.no_write:
        write_section("sandbox", text)


if __name__ == "__main__":
    main()
