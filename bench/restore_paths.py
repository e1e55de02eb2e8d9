"""Where a resume's time goes: the runtime's resume against a restore of the *same* CRIU images through
runc directly, with and without CRIU's lazy pages, on one paused sandbox, in one run.

The runtime resumes through Docker's `start --checkpoint` (fed links into the checkpoint store) so that
Docker keeps running the sandbox afterwards: `docker exec`, sessions, logs, stats and `docker ps` behave as
for any container. A restore through runc alone skips dockerd, containerd's shim and their copies of the
checkpoint folder, and with CRIU's lazy pages (userfaultfd) the page images are not read before the
processes run: a page daemon (`criu lazy-pages`) sends each page on its first touch and the rest in the
background. The runtime does not take these paths (a container runc runs alone is invisible to Docker),
and this script measures what they would give, so that the choice rests on figures.

Each repetition pauses the sandbox through the runtime, restores its images through runc (once plain, once
with lazy pages, in alternating order) and finally resumes it through the runtime, which is the baseline.
The runc restores run under a runc state root of their own, on the sandbox's own overlay layers (mounted
by this script, since Docker unmounts them when a container stops) and in a cgroup of their own; each one
is checked (the restore marker written before the pause is back and the workload's counter moves), then
killed. CRIU does not change its images, so the runtime's resume restores exactly what was paused.

Per path: wall time until the restored processes run; CRIU's own restore time (its log); the host's busy
CPU time (/proc/stat, every process) until the restore's work is done, with lazy pages until the daemon
has sent every page; with lazy pages, the time until every page is in. From those: the share of CRIU's
time spent reading pages, and the floor fork(8) meets on this host's cores on each path.

Writes the `restore-paths` section of docs/benchmarks.md (unless `--no-write`) and prints it.
Usage: python bench/restore_paths.py [--mb 128] [--reps 5] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_report import busy_cores_before, host_cpu_seconds, other_load_text, write_section  # noqa: E402
from sandbox import RESUME_TARGET_S, Bench, versions  # noqa: E402

RUNC_TIMEOUT_S = 60.0
SOCKET_WAIT_S = 10.0
FORK_N = 8
CGROUP_PARENT = "agentenv-bench"  # the runc restores' cgroups: <hierarchy>/agentenv-bench/<container>


@dataclass
class PathSamples:
    """What one restore path measured over the repetitions."""

    resume: list[float] = field(default_factory=list)
    criu: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    all_pages: list[float] = field(default_factory=list)
    daemon: list[float] = field(default_factory=list)

    @staticmethod
    def p50(values: list[float]) -> float | None:
        return statistics.median(values) if values else None


@dataclass(frozen=True)
class DirectOutcome:
    resume_s: float        # until runc returned with the processes running
    criu_s: float | None   # CRIU's own restore time, from its log
    cpu_s: float           # host busy CPU until the work was done (lazy: until every page was sent)
    all_pages_s: float | None  # lazy pages: until the daemon had sent every page
    daemon_s: float | None     # lazy pages: until the page daemon listened (part of resume_s)


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.run(argv, text=True, timeout=RUNC_TIMEOUT_S, **kwargs)


class DirectRestore:
    """Restores of one sandbox's CRIU images through runc alone (see the module docstring)."""

    def __init__(self, spec: dict, graph: dict[str, str], scratch: Path) -> None:
        self.spec, self.graph = spec, graph
        self.state_root = scratch / "runc-state"
        self.scratch = scratch
        self.merged = Path(graph["MergedDir"])
        self._mounted = False

    def _runc(self, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        return _run(["runc", "--root", str(self.state_root), *args], **kwargs)

    def mount_rootfs(self) -> None:
        """The container's overlay, as Docker mounts it at start (it unmounted it at the pause)."""
        if self._mounted:
            return
        self.merged.mkdir(mode=0o700, exist_ok=True)
        opts = f"lowerdir={self.graph['LowerDir']},upperdir={self.graph['UpperDir']}," \
               f"workdir={self.graph['WorkDir']}"
        r = _run(["mount", "-t", "overlay", "overlay", "-o", opts, str(self.merged)])
        if r.returncode:
            raise SystemExit(f"could not mount the sandbox's overlay at {self.merged}: {r.stderr.strip()}")
        self._mounted = True

    def unmount_rootfs(self) -> None:
        """Leave the layers as Docker left them: unmounted, without the mount point."""
        if self._mounted:
            _run(["umount", str(self.merged)])
            self._mounted = False
            self.merged.rmdir()

    def restore(self, images: Path, marker: str, *, lazy: bool) -> DirectOutcome:
        rid = f"agentenv-bench-{uuid.uuid4().hex[:12]}"
        bundle, work = self.scratch / rid / "bundle", self.scratch / rid / "work"
        bundle.mkdir(parents=True)
        work.mkdir()
        spec = json.loads(json.dumps(self.spec))
        spec["linux"]["cgroupsPath"] = f"/{CGROUP_PARENT}/{rid}"
        (bundle / "config.json").write_text(json.dumps(spec))
        daemon, daemon_s = None, None
        cpu0, t0 = host_cpu_seconds(), time.perf_counter()
        try:
            if lazy:
                daemon = self._start_page_daemon(images, work)
                daemon_s = time.perf_counter() - t0
            self.mount_rootfs()
            read, write = os.pipe()  # the init's stdio: a pipe, as Docker's shim gives it (dumpable)
            try:
                r = self._runc("--log", str(work / "runc.log"), "restore", "--detach", "--image-path",
                               str(images), "--work-path", str(work), "--bundle", str(bundle), "--pid-file",
                               str(work / "pid"), *(["--lazy-pages"] if lazy else []), rid,
                               stdin=subprocess.DEVNULL, stdout=write, stderr=write)
            finally:
                os.close(write)
                os.close(read)
            resume = time.perf_counter() - t0
            if r.returncode:
                log = (work / "runc.log").read_text(errors="replace") if (work / "runc.log").exists() else ""
                raise SystemExit(f"runc could not restore {images} (lazy={lazy}): {log.strip()[-400:]}")
            all_pages = None
            if daemon is not None:
                daemon.wait(timeout=RUNC_TIMEOUT_S)
                all_pages = time.perf_counter() - t0
            cpu = host_cpu_seconds() - cpu0
            self._check(int((work / "pid").read_text()), marker, rid)
            from agentenv.backend import criu_log

            return DirectOutcome(resume, criu_log.restore_seconds(work / "restore.log"), cpu, all_pages,
                                 daemon_s)
        finally:
            self._kill(rid)
            if daemon is not None and daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            shutil.rmtree(self.scratch / rid, ignore_errors=True)

    @staticmethod
    def _start_page_daemon(images: Path, work: Path) -> subprocess.Popen[bytes]:
        """`criu lazy-pages` on the images; the restore finds it through the socket in `work`."""
        argv = ["criu", "lazy-pages", "--images-dir", str(images), "--work-dir", str(work), "-o",
                "lazy-pages.log", "-v4"]
        daemon = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not (work / "lazy-pages.socket").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.kill()
                raise SystemExit(f"criu lazy-pages did not start (see {work / 'lazy-pages.log'})")
            time.sleep(0.002)
        return daemon

    @staticmethod
    def _check(pid: int, marker: str, rid: str) -> None:
        """The restore marker written before the pause is back, and the workload's counter moves."""
        root = Path(f"/proc/{pid}/root")
        found = (root / "run/agentenv/marker").read_text().strip()
        if found != marker:
            raise SystemExit(f"runc restore {rid}: restore marker {found!r}, expected {marker!r}")
        first = int((root / "tmp/state").read_text() or 0)
        deadline = time.monotonic() + 5.0
        while int((root / "tmp/state").read_text() or 0) == first:
            if time.monotonic() > deadline:
                raise SystemExit(f"runc restore {rid}: the workload's counter stayed at {first} for 5 s")
            time.sleep(0.05)

    def _kill(self, rid: str) -> None:
        self._runc("kill", rid, "KILL")
        for _ in range(50):
            if self._runc("delete", "--force", rid).returncode == 0:
                return
            time.sleep(0.1)

    def close(self) -> None:
        for rid in self._runc("list", "--quiet").stdout.split():
            self._kill(rid)
        self.unmount_rootfs()
        for parent in Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}"):  # runc removed its children
            with contextlib.suppress(OSError):
                parent.rmdir()


def measure(args: argparse.Namespace) -> tuple[dict[str, PathSamples], dict[str, object]]:
    from agentenv.backend import criu_log

    bench = Bench(argparse.Namespace(rows=args.rows))
    backend = bench.backend
    scratch = Path(tempfile.mkdtemp(prefix="agentenv-restore-paths-"))
    paths = {name: PathSamples() for name in ("runtime", "runc", "lazy")}
    facts: dict[str, object] = {"versions": versions(bench.api), "load": [os.getloadavg()],
                                "busy": busy_cores_before(),
                                "backend": backend.name, "restore": backend.describe()["restore"]}
    direct = None
    try:
        sb, _ = bench.sandbox(args.mb)
        cid = sb.container_id
        bundle = backend.host.containerd.bundle(backend.settings.containerd_namespace, cid)
        spec = json.loads((bundle / "config.json").read_text())
        direct = DirectRestore(spec, bench.api.inspect_container(cid)["GraphDriver"]["Data"], scratch)
        for rep in range(args.reps + 1):  # the first repetition warms the caches and is not counted
            sb.pause()
            row = sb._rt.registry.latest_checkpoint(sb.id)
            facts["image_bytes"] = row.bytes
            order = ("runc", "lazy") if rep % 2 else ("lazy", "runc")
            for name in order:
                out = direct.restore(Path(row.path), row.marker, lazy=name == "lazy")
                if rep:
                    s = paths[name]
                    s.resume.append(out.resume_s)
                    s.cpu.append(out.cpu_s)
                    if out.criu_s is not None:
                        s.criu.append(out.criu_s)
                    if out.all_pages_s is not None and out.daemon_s is not None:
                        s.all_pages.append(out.all_pages_s)
                        s.daemon.append(out.daemon_s)
            direct.unmount_rootfs()  # Docker mounts the layers itself at the resume
            cpu0, t0 = host_cpu_seconds(), time.perf_counter()
            sb.resume()
            resume, cpu = time.perf_counter() - t0, host_cpu_seconds() - cpu0
            if rep:
                paths["runtime"].resume.append(resume)
                paths["runtime"].cpu.append(cpu)
                own = criu_log.restore_seconds(backend.restore_log(cid))
                if own is not None:
                    paths["runtime"].criu.append(own)
            done = ", ".join(f"{k} {v.resume[-1]:.3f} s" for k, v in paths.items() if v.resume)
            print(f"rep {rep}: {done}", flush=True)
    finally:
        if direct is not None:
            direct.close()
        bench.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    facts["load"].append(os.getloadavg())  # type: ignore[union-attr]
    return paths, facts


def _s(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f} {unit}"


def render(paths: dict[str, PathSamples], facts: dict, args: argparse.Namespace, cmd: str) -> str:
    base = PathSamples.p50(paths["runtime"].resume)
    cores = os.cpu_count() or 1
    label = {
        "runtime": "the runtime: Docker's `start --checkpoint`, page images linked from the store",
        "runc": "runc restore of the same images (no dockerd, no containerd shim)",
        "lazy": "runc restore + CRIU lazy pages (a page daemon sends pages on demand)",
    }
    v = facts["versions"]
    load = facts["load"]
    lines = [
        f"Command: `{cmd}`. {args.reps} repetitions after one uncounted, one sandbox of {args.mb} MiB "
        f"touched memory ({facts['image_bytes'] / 2**20:.0f} MiB of page images), backend "
        f"`{facts['backend']}`. "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f"; {cores} CPU cores; load average {load[0][0]:.1f} before, {load[1][0]:.1f} after; "
        + other_load_text(facts["busy"]),
        "",
        "| restore path | resume p50 | vs the runtime | CRIU's own restore p50 | host CPU p50 | "
        "all pages in p50 | fork(8) floor on these cores (restores alone) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in paths.items():
        resume, cpu = PathSamples.p50(s.resume), PathSamples.p50(s.cpu)
        floor = "-" if cpu is None or not resume else \
            f"{FORK_N * cpu / cores:.2f} s = {FORK_N * cpu / cores / resume:.1f}x its resume"
        ratio = "-" if resume is None or not base else f"{resume / base:.2f}x"
        lines.append(f"| {label[name]} | {_s(resume)} | {ratio} | {_s(PathSamples.p50(s.criu))} | "
                     f"{_s(cpu, 'CPU-s')} | {_s(PathSamples.p50(s.all_pages))} | {floor} |")
    criu_plain, criu_lazy = PathSamples.p50(paths["runc"].criu), PathSamples.p50(paths["lazy"].criu)
    lazy = PathSamples.p50(paths["lazy"].resume)
    lines += [""]
    if criu_plain is not None and criu_lazy is not None:
        lines.append(f"Reading the page images accounts for about {criu_plain - criu_lazy:.3f} s of CRIU's "
                     f"{criu_plain:.3f} s (its time without lazy pages minus with); the remaining "
                     f"{criu_lazy:.3f} s is its fixed work: namespaces, the mounts (each tmpfs restored "
                     f"from a tar), the process tree, and resuming the tasks.")
    daemon = PathSamples.p50(paths["lazy"].daemon)
    if daemon is not None:
        lines.append(f"Starting the page daemon took {daemon:.3f} s (p50) of the lazy path's resume; a "
                     f"runtime could start it ahead of the resume.")
    if lazy is not None and daemon is not None:
        lazy_runs = paths["lazy"]
        ahead = statistics.median(r - d for r, d in zip(lazy_runs.resume, lazy_runs.daemon, strict=True))
        verdict = "meets" if ahead <= RESUME_TARGET_S else "misses"
        lines.append(f"The fastest path, its page daemon started ahead, {verdict} a {RESUME_TARGET_S} s "
                     f"resume target at p50 ({ahead:.3f} s; {lazy:.3f} s with the daemon's start), before "
                     f"anything a runtime adds around it (verifying the restore, its registry). "
                     f"fork(8) cannot finish before its {FORK_N} restores' CPU time is spread over the "
                     f"{cores} cores (the floor column: {FORK_N} x host CPU / cores; creating the forks' "
                     f"containers and copying their files come on top).")
    lines.append(f"The runtime's restore: {facts['restore']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=128, help="touched memory of the sandbox (MiB)")
    ap.add_argument("--reps", type=int, default=5, help="counted repetitions (one more warms up)")
    ap.add_argument("--rows", type=int, default=400_000, help="SQLite rows the workload builds")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.mb < 1:
        raise SystemExit("--reps and --mb must be at least 1")
    if shutil.which("runc") is None:
        raise SystemExit("runc is not on PATH: this benchmark restores through it directly")
    cmd = ("python bench/restore_paths.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    home = tempfile.mkdtemp(prefix="agentenv-bench-")
    os.environ["AGENTENV_HOME"] = home  # a private registry: nothing of anyone else's is touched
    try:
        paths, facts = measure(args)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    text = render(paths, facts, args, cmd)
    print(text)
    if not args.no_write:
        write_section("restore-paths", text)


if __name__ == "__main__":
    main()
