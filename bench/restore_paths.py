"""What each lever of a resume bought: one 128 MiB sandbox's resume on every path from today's Docker
restore to the warm backend's, each lever added on top of the one before, wall time and CPU in one run.

Writes the `restore-paths` section of docs/benchmarks.md (unless `--no-write`) and prints it.
Usage: python bench/restore_paths.py [--mb 128] [--reps 7] [--quick] [--no-write]

Design: docs/design/benchmarks.md#bench-restore-paths.
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

from backend_variants import FASTPATH, Variant, cool, page_fill  # noqa: E402
from bench_report import busy_cores_before, host_cpu_seconds, other_load_text, write_section  # noqa: E402
from bench_stats import spread  # noqa: E402
from sandbox import Bench, versions  # noqa: E402
from state_targets import RESUME_128, judge  # noqa: E402

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


WARM_EAGER = Variant("warm-eager", "warm", "warm shells restored eagerly",
                     {"lazy_pages": False, "spare_shells": False}, kdat=False)
WARM_LAZY = Variant("warm-lazy", "warm", "warm shells with lazy pages, no kernel-facts cache",
                    {"spare_shells": False}, kdat=False)
WARM_KDAT = Variant("warm-kdat", "warm", "warm shells (the default settings)", {"spare_shells": False})


@dataclass(frozen=True)
class Row:
    """One restore path of the table: its words, the lever it adds and the row it is set against."""

    key: str
    path: str
    lever: str
    against: str | None


ROWS = (
    Row("fastpath", "Docker's restore (backend `fastpath`)",
        "today's path: `docker start --checkpoint`, page images linked from the store", None),
    Row("runc", "runc alone", "no dockerd, no containerd shim (same images; invisible to Docker)",
        "fastpath"),
    Row("runc-lazy", "runc + lazy pages", "CRIU's page daemon: pages on first touch, the rest after",
        "runc"),
    Row("warm-eager", "warm shell, eager (`lazy_pages: false`)",
        "restore into the running container: no namespaces, cgroup or mounts rebuilt", "runc"),
    Row("warm-lazy", "warm shell, lazy pages", "lazy pages in the warm shell", "warm-eager"),
    Row("warm-kdat", "warm + CRIU kernel-facts cache (the default)",
        "CRIU's kernel facts read from a cache instead of probed on each run", "warm-lazy"),
    Row("stopped", "stopped shell (cold start + restore)",
        "the shell was cooled: Docker's start and the tmpfs unpacked first", "warm-kdat"),
)


def warm_resume(bench: Bench, sb, *, stopped: bool = False) -> DirectOutcome:
    """Pause (and with `stopped` cool the shell), then a timed resume of a warm-backend sandbox; the CPU
    window stays open until the page daemon (if any) sent the last page."""
    before = bench.count(sb)
    sb.pause()
    if stopped:
        cool(sb)
    cpu0, t0 = host_cpu_seconds(), time.perf_counter()
    sb.resume()
    resume = time.perf_counter() - t0
    filled = page_fill(sb)
    all_pages = time.perf_counter() - t0 if filled is not None else None
    cpu = host_cpu_seconds() - cpu0
    if bench.count(sb) < before:
        raise SystemExit(f"sandbox {sb.id}: its workload's counter went back across the resume")
    return DirectOutcome(resume, bench.criu_restore_seconds(sb), cpu, all_pages, None)


def measure(args: argparse.Namespace, root: Path) -> tuple[dict[str, PathSamples], dict[str, object]]:
    bench = Bench(argparse.Namespace(rows=args.rows), root)
    scratch = root / "scratch"
    scratch.mkdir()
    paths = {row.key: PathSamples() for row in ROWS}
    facts: dict[str, object] = {"versions": versions(bench.api), "load": [os.getloadavg()],
                                "busy": busy_cores_before()}
    direct = None

    def add(key: str, out: DirectOutcome) -> None:
        s = paths[key]
        s.resume.append(out.resume_s)
        s.cpu.append(out.cpu_s)
        if out.criu_s is not None:
            s.criu.append(out.criu_s)
        if out.all_pages_s is not None:
            s.all_pages.append(out.all_pages_s)
        if out.daemon_s is not None:
            s.daemon.append(out.daemon_s)

    try:
        with bench.backends.use(FASTPATH) as rt:
            fp, _ = bench.sandbox(args.mb, FASTPATH)
            facts["fastpath"] = rt.backend.describe()["restore"]
            cid = fp.container_id
            bundle = rt.backend.host.containerd.bundle(rt.backend.settings.containerd_namespace, cid)
            spec = json.loads((bundle / "config.json").read_text())
            direct = DirectRestore(spec, bench.api.inspect_container(cid)["GraphDriver"]["Data"], scratch)
        warm = {}
        for v in (WARM_EAGER, WARM_LAZY, WARM_KDAT):
            with bench.backends.use(v) as rt:
                warm[v.key] = bench.sandbox(args.mb, v)[0]
                facts[v.key] = rt.backend.describe()["restore"]
        for rep in range(args.reps + 1):  # the first repetition warms the caches and is not counted
            counted = rep > 0
            with bench.backends.use(FASTPATH):
                fp.pause()
                row = fp._rt.registry.latest_checkpoint(fp.id)
                facts["image_bytes"] = row.bytes
                for key in (("runc", "runc-lazy") if rep % 2 else ("runc-lazy", "runc")):
                    out = direct.restore(Path(row.path), row.marker, lazy=key == "runc-lazy")
                    if counted:
                        add(key, out)
                direct.unmount_rootfs()  # Docker mounts the layers itself at the resume
                cpu0, t0 = host_cpu_seconds(), time.perf_counter()
                fp.resume()
                resume, cpu = time.perf_counter() - t0, host_cpu_seconds() - cpu0
                out = DirectOutcome(resume, bench.criu_restore_seconds(fp), cpu, None, None)
                if counted:
                    add("fastpath", out)
            for v in (WARM_EAGER, WARM_LAZY, WARM_KDAT):
                with bench.backends.use(v):
                    sb = warm[v.key]
                    out = warm_resume(bench, sb)
                    if counted:
                        add(v.key, out)
                    if v is WARM_KDAT:
                        out = warm_resume(bench, sb, stopped=True)
                        if counted:
                            add("stopped", out)
            done = ", ".join(f"{k} {v.resume[-1]:.3f} s" for k, v in paths.items() if v.resume)
            print(f"rep {rep}: {done or '(warm-up)'}", flush=True)
    finally:
        if direct is not None:
            direct.close()
        bench.cleanup()
    facts["load"].append(os.getloadavg())  # type: ignore[union-attr]
    return paths, facts


def _s(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f} {unit}"


def _spread(values: list[float], unit: str = "s") -> str:
    """`p50 (min–max)` of one path's repetitions."""
    s = spread(values)
    if s is None:
        return "-"
    return f"{s.median:.3f} {unit} ({s.low:.3f}–{s.high:.3f})"


def lever_cells(paths: dict[str, PathSamples], row: Row) -> tuple[str, str]:
    """The row against the row it changes: its wall time and CPU-s minus that row's (p50s; negative:
    the lever saved), and the ratio."""
    if row.against is None:
        return "(baseline)", "(baseline)"
    cells = []
    for pick, unit in ((lambda s: s.resume, "s"), (lambda s: s.cpu, "CPU-s")):
        mine, base = PathSamples.p50(pick(paths[row.key])), PathSamples.p50(pick(paths[row.against]))
        cells.append("-" if mine is None or not base else f"{mine - base:+.3f} {unit} ({mine / base:.2f}×)")
    return cells[0], cells[1]


def render(paths: dict[str, PathSamples], facts: dict, args: argparse.Namespace, cmd: str) -> str:
    cores = os.cpu_count() or 1
    names = {row.key: row.path for row in ROWS}
    v = facts["versions"]
    load = facts["load"]
    lines = [
        f"Command: `{cmd}`. {args.reps} repetitions after one uncounted; one sandbox of {args.mb} MiB "
        f"touched memory per path ({facts['image_bytes'] / 2**20:.0f} MiB of page images). "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f"; {cores} CPU cores; load average {load[0][0]:.1f} before, {load[1][0]:.1f} after; "
        + other_load_text(facts["busy"]),
        "",
        f"What each lever bought, at {args.mb} MiB: resume p50 (min–max of the repetitions), host CPU-s "
        "until the restore's work was done (lazy pages: until the page daemon sent the last page, after the "
        "resume returned), and each row against the row whose path it changes (Δ = this row − that row: "
        "negative is what the lever saved).",
        "",
        "| restore path | lever | resume | host CPU | all pages in p50 | CRIU's own restore p50 | against "
        "| Δ resume | Δ CPU-s | fork(8) floor on these cores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        s = paths[row.key]
        resume, cpu = PathSamples.p50(s.resume), PathSamples.p50(s.cpu)
        floor = "-" if cpu is None or not resume else \
            f"{FORK_N * cpu / cores:.2f} s = {FORK_N * cpu / cores / resume:.1f}× its resume"
        d_wall, d_cpu = lever_cells(paths, row)
        against = names[row.against] if row.against else "–"
        lines.append(f"| {row.path} | {row.lever} | {_spread(s.resume)} | {_spread(s.cpu, 'CPU-s')} | "
                     f"{_s(PathSamples.p50(s.all_pages))} | {_s(PathSamples.p50(s.criu))} | {against} | "
                     f"{d_wall} | {d_cpu} | {floor} |")
    criu_plain, criu_lazy = PathSamples.p50(paths["runc"].criu), PathSamples.p50(paths["runc-lazy"].criu)
    lines += [""]
    if criu_plain is not None and criu_lazy is not None:
        lines.append(f"Reading the page images accounts for about {criu_plain - criu_lazy:.3f} s of CRIU's "
                     f"{criu_plain:.3f} s through runc (its time without lazy pages minus with); the rest is "
                     f"its fixed work there: namespaces, the mounts (each tmpfs restored from a tar), the "
                     f"process tree, resuming the tasks. A warm shell's restore skips the namespaces and "
                     "mounts: CRIU's own time there is "
                     f"{_s(PathSamples.p50(paths['warm-eager'].criu))} eager, "
                     f"{_s(PathSamples.p50(paths['warm-kdat'].criu))} lazy with the cache.")
    daemon = PathSamples.p50(paths["runc-lazy"].daemon)
    if daemon is not None:
        lines.append(f"Starting the page daemon took {daemon:.3f} s (p50) of the runc lazy path's resume "
                     "(the warm backend starts it while it prepares the shell).")
    if args.mb == 128:
        lines.append("In this run, per repetition: "
                     + judge(RESUME_128.at("(the default warm path; this script's repetitions)"),
                             paths["warm-kdat"].resume).text() + ".")
    lines.append(f"fork(8) cannot finish before its {FORK_N} restores' CPU time is spread over the {cores} "
                 f"cores (the floor column: {FORK_N} × host CPU / cores; creating the forks' containers and "
                 "copying their files come on top).")
    lines.append(f"The paths' restores: fastpath: {facts['fastpath']}; warm: {facts['warm-kdat']}; eager: "
                 f"{facts['warm-eager']}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=128, help="touched memory of each sandbox (MiB)")
    ap.add_argument("--reps", type=int, default=None, help="counted repetitions (one more warms up; "
                                                           "default 7, quick 2)")
    ap.add_argument("--rows", type=int, default=400_000, help="SQLite rows the workload builds")
    ap.add_argument("--quick", action="store_true", help="2 repetitions, a small SQLite table")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 7)
    if args.quick:
        args.rows = min(args.rows, 20_000)
    if args.reps < 1 or args.mb < 1:
        raise SystemExit("--reps and --mb must be at least 1")
    if shutil.which("runc") is None:
        raise SystemExit("runc is not on PATH: this benchmark restores through it directly")
    cmd = ("python bench/restore_paths.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    root = Path(tempfile.mkdtemp(prefix="agentenv-bench-"))  # private registries: nobody else's touched
    try:
        paths, facts = measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = render(paths, facts, args, cmd)
    print(text)
    if not args.no_write:
        write_section("restore-paths", text)


if __name__ == "__main__":
    main()
