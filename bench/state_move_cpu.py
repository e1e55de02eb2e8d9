"""Where the CPU of moving a sandbox's state goes, on the warm backend and on fastpath (today's Docker
restore path): one pause, one resume and one warm start at a time, every core sampled by `perf record -a`
and the samples summed by who ran them (CRIU, runc, containerd, dockerd, the sandbox, the kernel, ...).

Needs `perf` and root. Writes the `state-move-cpu` section of docs/benchmarks.md (unless --no-write).
Usage: python bench/state_move_cpu.py [--mb 200] [--reps 4] [--quick] [--thp madvise always] [--no-write]

Design: docs/design/benchmarks.md#bench-state-move-cpu.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_variants import FASTPATH, WARM, Variant, page_fill  # noqa: E402
from bench_report import busy_cores_before, host_cpu_seconds, other_load_text, write_section  # noqa: E402
from sandbox import Bench, cpu_source_words, versions  # noqa: E402
from state_targets import CYCLE_CPU, judge  # noqa: E402

from agentenv.backend.cgroups import cgroup_pids  # noqa: E402
from agentenv.pool.cpu import HOST, OpCpu  # noqa: E402

FREQ = 999            # perf samples per second per core: a sample is 1/FREQ CPU-s
PERF_START_S = 0.5    # perf record is sampling within this after it starts
TAIL_S = 0.2          # kept sampling after an operation returns (work it left running)
# process kinds by their comm (15 characters at most); the criu wrapper of scripts/install_criu.sh runs
# CRIU through its own loader, so CRIU shows as the loader's name; the warm backend runs CRIU (and tar for
# the tmpfs archives) from a descriptor, so it shows as the descriptor's number (`kind_of`)
CRIU_KIND = "CRIU (its page daemon included; on warm, tar of each tmpfs too)"
SANDBOX_KIND = "the sandbox's processes (a dump: CRIU's parasite; a fork: its copy's)"
KINDS: list[tuple[str, tuple[str, ...]]] = [
    (CRIU_KIND, ("criu", "ld-linux-x86-64")),
    ("runc", ("runc",)),
    ("containerd shims", ("containerd-shim",)),
    ("containerd", ("containerd",)),
    ("dockerd", ("dockerd",)),
    ("`ctr` client (the dump's call)", ("ctr",)),
    ("tar + gzip (fastpath: CRIU's archive of each tmpfs)", ("tar", "gzip")),
    ("nsenter, setsid, unshare, mount (the warm backend's way into a sandbox)",
     ("nsenter", "setsid", "unshare", "mount")),
    ("iptables (CRIU's network lock)", ("iptables", "ip6tables", "iptables-restor", "ip6tables-resto",
                                        "iptables-nft", "xtables-nft-mul")),
    ("sh (the criu wrapper, hooks)", ("sh", "dash")),
]
KERNEL_PREFIXES = ("kworker", "ksoftirqd", "rcu_", "kdamond", "kswapd", "kcompactd", "jbd2", "migration")
# what CRIU and the sandbox's processes spent their samples on, by symbol (first match; user-space
# symbols are CRIU's own code and its libraries, with or without names)
WORK: list[tuple[str, tuple[str, ...]]] = [
    ("where interrupts come back on (a VM's perf samples there the work done with them off)",
     ("_raw_spin_unlock_irq", "__raw_spin_unlock_irq", "raw_spin_rq_unlock_irq", "finish_task_switch")),
    ("copying pages (memcpy, splice, copy to/from user)",
     ("__pi_memcpy", "memcpy", "copy_page", "copy_mc_", "copy_user", "rep_movs", "_copy_to", "_copy_from",
      "iter_file_splice", "splice", "pipe_", "page_cache_pipe", "vmsplice", "copy_page_to_iter",
      "copy_page_from_iter")),
    ("page faults, zeroing and allocating pages",
     ("clear_page", "do_anonymous_page", "handle_mm_fault", "__handle_mm_fault", "do_user_addr_fault",
      "exc_page_fault", "alloc_pages", "__alloc_", "get_page_from_freelist", "rmqueue", "folio_zero",
      "do_pte_missing", "lru_", "__lruvec", "mod_memcg", "__memcg", "charge_memcg", "free_", "release_pages",
      "__folio", "folio_", "zap_", "unmap_", "tlb_", "__mod_", "__count_memcg", "do_wp_page",
      "vm_normal_page", "gup_", "memcg", "mem_cgroup", "__mem_cgroup", "obj_cgroup", "get_mem_cgroup", "pte_",
      "__pte", "___pte", "set_ptes", "next_uptodate_folio", "folios_", "page_reporting",
      "lock_mm_and_find_vma", "access_error", "get_vma_policy", "policy_nodemask", "__next_zones",
      "percpu_counter", "filemap_map_pages")),
    ("kernel object allocation (slab)", ("kmem_cache", "___slab", "__slab", "__kmalloc", "kmalloc", "kfree",
                                         "__kmem_cache")),
    ("locks, RCU and system call entry",
     ("_raw_spin", "__raw_spin", "__raw_callee_save", "_raw_read", "_raw_write", "down_", "up_", "__rcu",
      "rcu_", "do_syscall", "entry_SYSCALL", "syscall_", "mutex_", "__mutex")),
    ("file system and page cache (ext4, writeback)",
     ("ext4_", "jbd2", "filemap", "__filemap", "block_", "mark_buffer", "iomap", "__dquot", "generic_perform",
      "generic_write", "__es_", "es_", "__block", "balance_dirty", "writeback", "find_get", "xas_", "__xa")),
    ("netfilter and socket queries (network lock, netns dump)",
     ("ctnetlink", "nf_", "nft_", "ipt_", "ip6t_", "xt_", "tcp_diag", "inet_diag", "netlink", "__netlink",
      "sock_diag", "nla_")),
    ("reading the processes' state (/proc, maps, ptrace)",
     ("pagemap", "smaps", "show_", "seq_", "proc_", "ptrace", "walk_", "pagemap_scan", "m_show", "m_start",
      "__walk", "task_", "mas_", "mt_", "vma_", "__vma", "find_vma", "mmap", "__mmap", "do_mmap", "dup_mmap",
      "dup_userfaultfd", "mprotect", "do_mprotect")),
]
OPS = ("pause", "resume", "warm start (fork of 1)")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODES = ("always", "madvise", "never")
FAULTS = "page faults, zeroing and allocating pages"
TOP_FUNCTIONS = 3     # kernel functions of CRIU + the sandbox named per mode in the huge-page table


class Window(NamedTuple):
    """One operation's perf window."""

    kinds: dict[str, float]      # CPU-s by who ran them (`kind_of`)
    host: float                  # the host's busy CPU-s (/proc/stat)
    charged: float               # CPU-s the pool's meter charges the operation (`OpCpu`)
    seconds: float               # wall seconds of the operation
    work: dict[str, float]       # CRIU's and the sandbox's CPU-s by what they did (`work_of`)
    functions: dict[str, float]  # the same by kernel function
    span: float                  # seconds from the call until its last page was in (>= seconds)


def kind_of(pid: int, comm: str, sandbox_pids: set[int]) -> str:
    if pid in sandbox_pids:
        return SANDBOX_KIND
    if pid == os.getpid():
        return "this benchmark (the client's calls)"
    if comm.isdigit():  # the warm backend execs CRIU (and tar) from a descriptor: /proc/self/fd/N
        return CRIU_KIND
    for name, comms in KINDS:
        if comm in comms:
            return name
    if comm.startswith(KERNEL_PREFIXES):
        return "kernel threads (writeback, RCU, ...)"
    return "other processes"


def work_of(symbol: str, user: bool) -> str:
    """What a sample of CRIU or the sandbox's processes was doing, by its symbol (`WORK`)."""
    if user:
        return "user space (CRIU's own code and libraries)"
    for name, prefixes in WORK:
        if symbol.startswith(prefixes):
            return name
    return "other kernel work"


def split_samples(data: Path, pids: set[int]) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """CPU-s of the samples in ``data`` by who ran them (`kind_of`, idle left out), and CRIU's and the
    sandbox's processes' by what they were doing (`work_of`) and by kernel function, from one `perf
    report` by pid and symbol."""
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--sort", "pid,sym", "-F",
                             "sample,pid,sym", "-g", "none"], capture_output=True, text=True, timeout=120)
    kinds: dict[str, float] = defaultdict(float)
    work: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    for line in report.stdout.splitlines():
        parts = line.split(None, 3)  # samples, pid:comm, [k] or [.], symbol
        if len(parts) != 4 or not parts[0].isdigit() or ":" not in parts[1]:
            continue
        pid_s, comm = parts[1].split(":", 1)
        if comm.startswith("swapper"):  # idle
            continue
        kind = kind_of(int(pid_s), comm, pids)
        kinds[kind] += int(parts[0]) / FREQ
        if kind in (CRIU_KIND, SANDBOX_KIND):
            symbol, user = parts[3].strip(), parts[2] == "[.]"
            work[work_of(symbol, user)] += int(parts[0]) / FREQ
            if not user:
                functions[symbol] += int(parts[0]) / FREQ
    return kinds, work, functions


def perf_window(fn: Callable[[], object], sandbox_pids: Callable[[], set[int]], scratch: Path,
                meter: OpCpu) -> Window:
    """Run `fn` under `perf record -a` and account its window, which a restore's (`fn` returns the
    restored sandboxes) keeps open until their page daemons sent the last page."""
    data = scratch / "perf.data"
    perf = subprocess.Popen(["perf", "record", "-a", "-F", str(FREQ), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(PERF_START_S)
    before = sandbox_pids()
    cpu0, t0, token = host_cpu_seconds(), time.perf_counter(), meter.start()
    restored = fn()  # a restore returns its sandboxes: their cgroup CPU since the restore is charged too
    seconds = time.perf_counter() - t0
    for s in restored or []:
        page_fill(s)  # lazy pages: the daemon's work goes on after the call returned
    span = time.perf_counter() - t0
    charged = meter.stop(token, restored_cpu_s=sum(s.stats().cpu_seconds_since_start for s in restored or []))
    time.sleep(TAIL_S)
    host = host_cpu_seconds() - cpu0
    pids = before | sandbox_pids()
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=60)
    kinds, work, functions = split_samples(data, pids)
    return Window(kinds, host, charged, seconds, work, functions, span)


def measure(args: argparse.Namespace, bench: Bench, variant: Variant, scratch: Path) -> dict:
    """Every operation `args.reps` times on one sandbox of `variant` (call it inside its `use` block)."""
    sb, _ = bench.sandbox(args.mb, variant)
    rss = sb.stats().rss_bytes
    sb.pause()
    sb.resume()  # warm-up: images, page cache and the daemons' caches as in steady use

    forks: list = []

    def sandbox_pids() -> set[int]:
        """Host pids of the sandbox's processes and its forks' (none while paused)."""
        pids: set[int] = set()
        for s in (sb, *forks):
            info = bench.api.inspect_container(s.container_id)["State"]
            pids.update(cgroup_pids(int(info.get("Pid") or 0)))
        return pids

    def warm_start() -> list:
        forks.extend(sb.fork(1))
        return forks

    def resume() -> list:
        sb.resume()
        return [sb]

    meter = OpCpu()
    runs: dict[str, list[Window]] = {op: [] for op in OPS}
    for _ in range(args.reps):
        for op, fn, resume_after in (("pause", sb.pause, False), ("resume", resume, False),
                                     ("warm start (fork of 1)", warm_start, True)):
            if op == "warm start (fork of 1)":
                sb.pause()  # a fork restores a paused sandbox's checkpoint
            window = perf_window(fn, sandbox_pids, scratch, meter)
            idle = perf_window(lambda s=window.span: time.sleep(s), set, scratch, meter).kinds
            net = {k: max(0.0, v - idle.get(k, 0.0)) for k, v in window.kinds.items()}
            runs[op].append(window._replace(kinds=net))
            for f in forks:
                f.close()
            forks.clear()
            if resume_after:
                sb.resume()
    sb.close()
    return {"runs": runs, "rss": rss, "source": meter.source}


def thp_mode() -> str:
    """The host's transparent-huge-page mode: the bracketed word of `THP_ENABLED`."""
    text = THP_ENABLED.read_text()
    return text[text.index("[") + 1:text.index("]")]


@contextlib.contextmanager
def thp_enabled(mode: str) -> Iterator[None]:
    """The host's transparent-huge-page mode set to ``mode`` for the block, the previous one put back."""
    before = thp_mode()
    THP_ENABLED.write_text(mode)
    try:
        yield
    finally:
        THP_ENABLED.write_text(before)


def thp_table(results: dict[str, dict[str, dict]]) -> list[str]:
    """Each mode's host CPU, page-fault samples and wall time per backend and operation, with the kernel
    functions CRIU and the sandbox's processes spent most on."""
    lines = ["", "The same operations with the host's transparent huge pages (`enabled` in "
             f"`{THP_ENABLED}`) set to each mode for a whole run (set by this script, put back after):", "",
             f"| THP `enabled` | backend | operation | host busy CPU-s | CRIU + sandbox: {FAULTS} "
             "| wall seconds | kernel functions CRIU + the sandbox spent most on (CPU-s) |",
             "|---|---|---|---|---|---|---|"]
    for mode, by_backend in results.items():
        for backend, result in by_backend.items():
            for op in OPS:
                runs = result["runs"][op]
                names = {f for r in runs for f in r.functions}
                top = sorted(((statistics.median(r.functions.get(f, 0.0) for r in runs), f) for f in names),
                             reverse=True)
                lines.append(f"| {mode} | {backend} | {op} | {statistics.median(r.host for r in runs):.3f} | "
                             f"{statistics.median(r.work.get(FAULTS, 0.0) for r in runs):.3f} | "
                             f"{statistics.median(r.seconds for r in runs):.3f} | "
                             + ", ".join(f"`{f}` {v:.3f}" for v, f in top[:TOP_FUNCTIONS]) + " |")
    return lines


def cycle_cpu(result: dict) -> list[float]:
    """CPU-s of each repetition's pause + resume: every sampled kind, less the idle window."""
    pauses, resumes = result["runs"]["pause"], result["runs"]["resume"]
    return [sum(p.kinds.values()) + sum(r.kinds.values()) for p, r in zip(pauses, resumes, strict=True)]


def cycle_verdicts(by_backend: dict[str, dict], mb: int) -> list[str]:
    """The CPU target judged on each backend's repetitions (the warm backend's is the target's)."""
    target = CYCLE_CPU if mb == 200 else CYCLE_CPU.at(f"(measured at {mb} MiB)")
    return [judge(target.at(f"— {backend}"), cycle_cpu(result)).text()
            for backend, result in by_backend.items()]


def render(results: dict[str, dict[str, dict]], facts: dict, args: argparse.Namespace, cmd: str) -> str:
    mode, by_backend = next(iter(results.items()))
    columns = [(b, op) for b in by_backend for op in OPS]

    def p50(backend: str, op: str, pick: Callable[[Window], float]) -> float:
        return statistics.median(pick(r) for r in by_backend[backend]["runs"][op])

    def row(pick: Callable[[Window], float]) -> str:
        cells = []
        for b in by_backend:
            ops = [p50(b, op, pick) for op in OPS]
            cells += [f"{c:.3f}" for c in ops] + [f"{ops[0] + ops[1]:.3f}"]
        return " | ".join(cells)

    header = " | ".join(f"{b}: {op}" for b in by_backend for op in (*OPS, "pause + resume"))
    rule = "|---|" + "---|" * (len(columns) + len(by_backend))
    names = sorted({k for b, op in columns for r in by_backend[b]["runs"][op] for k in r.kinds},
                   key=lambda k: -sum(p50(b, op, lambda r, k=k: r.kinds.get(k, 0.0)) for b, op in columns))
    rss = ", ".join(f"{b} {r['rss'] / 2**20:.0f} MiB" for b, r in by_backend.items())
    lines = [
        f"Command: `{cmd}`. One sandbox of {args.mb} MiB touched memory per backend (RSS: {rss}), "
        f"{args.reps} repetitions of each operation after one uncounted pause + resume; medians. "
        + ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
        + f"; {os.cpu_count()} CPU cores; {other_load_text(facts['busy'])} "
        f"Transparent huge pages: `{mode}`" + (" (the host's setting)." if mode == facts["thp"] else
                                              f" (set for the run; the host's setting is `{facts['thp']}`)."),
        "",
        "CPU-s per operation by who spent them (`perf record -a`, every core sampled at "
        f"{FREQ} Hz, less an idle window of the same length right after; a lazy restore's window runs "
        "until its page daemon sent the last page):",
        "",
        f"| who | {header} |",
        rule,
    ]
    for name in names:
        lines.append(f"| {name} | " + row(lambda r, n=name: r.kinds.get(n, 0.0)) + " |")
    for label, pick in (("**all sampled**", lambda r: sum(r.kinds.values())),
                        ("host busy time (/proc/stat)", lambda r: r.host),
                        ("charged by the pool (`OpCpu`)", lambda r: r.charged),
                        ("wall seconds", lambda r: r.seconds),
                        ("seconds until the last page was in", lambda r: r.span)):
        lines.append(f"| {label} | " + row(pick) + " |")
    works = sorted({w for b, op in columns for r in by_backend[b]["runs"][op] for w in r.work},
                   key=lambda w: -sum(p50(b, op, lambda r, w=w: r.work.get(w, 0.0)) for b, op in columns))
    lines += ["", "What CRIU and the sandbox's processes (the two largest rows above) spent those CPU-s on, "
              "by the sampled function's name (kernel functions grouped by subsystem; user space is CRIU's "
              "own code; not less the idle window, in which neither runs):", "",
              f"| CRIU + the sandbox's processes, doing | {header} |", rule]
    for w in works:
        lines.append(f"| {w} | " + row(lambda r, w=w: r.work.get(w, 0.0)) + " |")
    source = next(iter(by_backend.values()))["source"]
    restored = "" if source == HOST else ", and on a resume or a fork the restored processes' cgroup"
    lines += ["", f"The pool's charge reads {cpu_source_words(source)}{restored}. The host's busy time runs "
              f"from the call to {TAIL_S} s after its last page was in, the sampled rows over perf's whole "
              "window; both include whatever else ran (see the load above).", "",
              "Target, on each repetition's pause + resume (all sampled, less the idle window):", ""]
    lines += [f"- {v}" for v in cycle_verdicts(by_backend, args.mb)]
    if len(results) > 1:
        lines += thp_table(results)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=None, help="touched memory of the sandbox (MiB; default 200, "
                                                         "quick 64)")
    ap.add_argument("--reps", type=int, default=None, help="counted repetitions of each operation "
                                                           "(default 4, quick 2)")
    ap.add_argument("--rows", type=int, default=400_000, help="SQLite rows the workload builds")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 repetitions, a small SQLite table")
    ap.add_argument("--thp", nargs="+", choices=THP_MODES, default=None,
                    help="transparent-huge-page modes to measure in turn, the first in the main tables "
                         "(default: the host's own, left as it is)")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    args.mb = args.mb if args.mb is not None else (64 if args.quick else 200)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 4)
    if args.quick:
        args.rows = min(args.rows, 20_000)
    if args.reps < 1 or args.mb < 1:
        raise SystemExit("--reps and --mb must be at least 1")
    if shutil.which("perf") is None:
        raise SystemExit("perf is not on PATH: this benchmark samples every core with it "
                         "(Debian/Ubuntu: apt-get install linux-perf)")
    cmd = ("python bench/state_move_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    from agentenv.backend import docker_client

    facts = {"versions": versions(docker_client.api()), "busy": busy_cores_before(), "thp": thp_mode()}
    modes = list(dict.fromkeys(args.thp or [facts["thp"]]))
    if modes != [facts["thp"]] and not os.access(THP_ENABLED, os.W_OK):
        raise SystemExit(f"--thp needs to write {THP_ENABLED} (root, a writable /sys)")
    results: dict[str, dict[str, dict]] = {}
    for mode in modes:
        root = Path(tempfile.mkdtemp(prefix="agentenv-bench-"))  # private registries: nobody else's touched
        bench = Bench(argparse.Namespace(rows=args.rows), root)
        try:
            with thp_enabled(mode) if mode != facts["thp"] else contextlib.nullcontext():
                results[mode] = {}
                for variant in (WARM, FASTPATH):
                    print(f"== THP {mode}: {variant.key}", flush=True)
                    with bench.backends.use(variant):
                        results[mode][variant.key] = measure(args, bench, variant, root)
        finally:
            try:
                bench.cleanup()
            finally:
                shutil.rmtree(root, ignore_errors=True)
    text = render(results, facts, args, cmd)
    print(text)
    if not args.no_write:
        write_section("state-move-cpu", text)


if __name__ == "__main__":
    main()
