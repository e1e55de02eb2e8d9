"""`agentenv serve` under load: N concurrent clients of the real `e2b` SDK (`AsyncSandbox`), then a crash.

Latency, throughput, errors, RSS and what is left over under load; then `kill -9` of the server and a
restart. Writes section `server-load` of docs/benchmarks.md unless `--no-write`.
Usage: python bench/sandbox_server_load.py [--clients 8,32,64] [--duration 180] [--crash 50] [--quick]

Design: docs/design/benchmarks.md#bench-sandbox-server-load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported by a test: after the checkout, so that
    sys.path.append(str(Path(__file__).resolve().parent))  # bench/model.py never shadows model/
from bench_report import busy_cores_before, other_load_text, write_section  # noqa: E402
from bench_stats import quantile  # noqa: E402
from sandbox_server import Server, close_all, private_home, rss_mib  # noqa: E402
from state_targets import SERVER_RUN_P99, judge  # noqa: E402

OP_TIMEOUT_S = 60.0    # one SDK call; past it the call counts as an error of kind `timeout`
SANDBOX_TTL_S = 900    # TTL given at create: longer than any run, so the reaper never acts mid-loop
OPS = ("create", "run", "write", "read", "pause", "connect", "run_resumed", "kill")
TARGETS = {"clients": 32, "duration_s": 180, "rss_mib": 300}  # and SERVER_RUN_P99 (state_targets)
# Connect codes an RPC error carries when the server itself failed (the 5xx of the data plane)
SERVER_CODES = ("INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED")


def error_kind(e: BaseException) -> tuple[str, bool]:
    """(a short kind for the table, whether it is a server failure: 5xx or its Connect equivalent)."""
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not str(e):
        return "timeout (bench limit)", False
    status = getattr(e, "status_code", None)
    text = str(e)
    code = re.match(r"Code\.([A-Z_]+)", text)
    where = f"HTTP {status}" if status else (code.group(1).lower() if code else "")
    kind = f"{type(e).__name__}" + (f" ({where})" if where else "")
    five = bool(status and status >= 500) or bool(code and code.group(1) in SERVER_CODES)
    return kind, five


@dataclass
class LoadResult:
    clients: int
    duration_s: float
    run: int = 1  # which run of this client count (the target's is repeated: `--rounds`)
    loops: int = 0
    lat: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    five_xx: int = 0
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t, RSS MiB, fds)
    leftover: dict[str, int] = field(default_factory=dict)
    tracebacks: int = 0
    fds_end: Counter = field(default_factory=Counter)


class Sampler:
    """The server process's RSS and open fds once a second, in a thread, until `stop()`."""

    def __init__(self, pid: int, every_s: float = 1.0) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                fds = len(os.listdir(f"/proc/{self.pid}/fd"))
                self.samples.append((time.monotonic() - self._t0, rss_mib(self.pid), fds))
            except (FileNotFoundError, ProcessLookupError):
                return
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> list[tuple[float, float, int]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.samples


async def _timed(res: LoadResult, op: str, coro):
    t = time.perf_counter()
    out = await asyncio.wait_for(coro, OP_TIMEOUT_S)
    res.lat[op].append(time.perf_counter() - t)
    return out


async def client_loop(res: LoadResult, idx: int, deadline: float, max_loops: int) -> None:
    """One client's loops until `deadline` (each loop bounded: every call by OP_TIMEOUT_S)."""
    from e2b import AsyncSandbox

    for n in range(max_loops):
        if time.monotonic() >= deadline:
            return
        sbx = None
        try:
            sbx = await _timed(res, "create", AsyncSandbox.create("base", timeout=SANDBOX_TTL_S))
            out = await _timed(res, "run", sbx.commands.run(f"echo client-{idx}"))
            assert out.stdout == f"client-{idx}\n", out.stdout
            payload = f"loop {n} of client {idx}\n"
            await _timed(res, "write", sbx.files.write("load.txt", payload))
            got = await _timed(res, "read", sbx.files.read("load.txt"))
            assert got == payload, got
            await _timed(res, "pause", sbx.pause())
            sbx = await _timed(res, "connect", AsyncSandbox.connect(sbx.sandbox_id, timeout=SANDBOX_TTL_S))
            out = await _timed(res, "run_resumed", sbx.commands.run("cat load.txt"))
            assert out.stdout == payload, out.stdout
            await _timed(res, "kill", sbx.kill())
            sbx = None
            res.loops += 1
        except Exception as e:  # noqa: BLE001 - counted by kind; the loop goes on
            kind, five = error_kind(e)
            res.errors[kind] += 1
            res.five_xx += five
            res.examples.setdefault(kind, str(e).splitlines()[0][:200] if str(e) else repr(e))
        finally:
            if sbx is not None:
                try:
                    await asyncio.wait_for(AsyncSandbox.kill(sbx.sandbox_id), OP_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001
                    res.errors[f"cleanup kill: {error_kind(e)[0]}"] += 1


def fd_kinds(pid: int) -> Counter:
    """The server's open file descriptors by kind: the SQLite files (one connection per worker thread,
    kept while the thread lives), sockets, pipes, other files."""
    kinds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        kinds["sqlite" if ".sqlite3" in target else target.split(":")[0] if ":[" in target else "file"] += 1
    return kinds


def leftovers(home: Path) -> dict[str, int]:
    """What the runs left: live registry sandboxes, containers labelled with `home`, checkpoint folders
    (in the store) of any container this home ever had."""
    from agentenv import Sandbox
    from agentenv.backend.base import LABEL_HOME
    from agentenv.sandbox import runtime

    rt = runtime()
    live = Sandbox.list()
    ps = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL_HOME}={home.resolve()}"],
                        capture_output=True, text=True, timeout=60).stdout.split()
    store = Path(rt.backend.describe()["checkpoint_store"])
    containers = {r.container for r in rt.registry.list_sandboxes(include_closed=True) if r.container}
    checkpoints = sum(1 for c in containers if (store / c).is_dir() and any((store / c).iterdir()))
    return {"sandboxes": len(live), "containers": len(ps), "checkpoints": checkpoints}


async def load_phase(server: Server, clients: int, duration_s: float, max_loops: int) -> LoadResult:
    res = LoadResult(clients, duration_s)
    sampler = Sampler(server.proc.pid)
    t0 = time.monotonic()
    deadline = t0 + duration_s
    tasks = [asyncio.create_task(client_loop(res, i, deadline, max_loops)) for i in range(clients)]
    # bounded: the last loop may start just before the deadline and take at most 8 calls' limits
    await asyncio.wait_for(asyncio.gather(*tasks), duration_s + 10 * OP_TIMEOUT_S)
    res.duration_s = time.monotonic() - t0
    res.samples = sampler.stop()
    res.fds_end = fd_kinds(server.proc.pid)
    res.leftover = leftovers(server.home)
    return res


async def crash_phase(server: Server, n: int) -> tuple[Server, dict[str, object]]:
    """n sandboxes (half paused), kill -9, restart: listed again with their state, then usable?"""
    from e2b import AsyncSandbox

    sem = asyncio.Semaphore(8)

    async def make(i: int) -> tuple[str, str]:
        async with sem:
            sbx = await asyncio.wait_for(AsyncSandbox.create("base", timeout=SANDBOX_TTL_S), OP_TIMEOUT_S)
            await asyncio.wait_for(sbx.files.write("mark.txt", f"sandbox {i}\n"), OP_TIMEOUT_S)
            if i % 2:
                await asyncio.wait_for(sbx.pause(), OP_TIMEOUT_S)
            return sbx.sandbox_id, "paused" if i % 2 else "running"

    t = time.perf_counter()
    made = dict(await asyncio.gather(*(make(i) for i in range(n))))
    populate_s = time.perf_counter() - t
    server.kill9()
    t = time.perf_counter()
    server = server.restart()
    restart_s = time.perf_counter() - t
    listed: dict[str, str] = {}
    pages = AsyncSandbox.list(limit=100)  # running and paused
    for _ in range(20):  # bounded: 20 pages of 100
        for info in await pages.next_items():
            listed[info.sandbox_id] = str(getattr(info.state, "value", info.state))
        if not pages.has_next:
            break
    same_state = sum(1 for sid, st in made.items() if listed.get(sid) == st)

    async def usable(i: int, sid: str) -> bool:
        async with sem:
            try:
                sbx = await asyncio.wait_for(AsyncSandbox.connect(sid, timeout=SANDBOX_TTL_S), OP_TIMEOUT_S)
                out = await asyncio.wait_for(sbx.commands.run("cat mark.txt"), OP_TIMEOUT_S)
                await asyncio.wait_for(sbx.kill(), OP_TIMEOUT_S)
                return out.stdout == f"sandbox {i}\n"
            except Exception as e:  # noqa: BLE001 - counted as not usable
                print(f"crash phase: {sid}: {error_kind(e)[0]}: {e}", file=sys.stderr)
                return False

    t = time.perf_counter()
    ok = await asyncio.gather(*(usable(i, sid) for i, sid in enumerate(made)))
    return server, {"n": n, "paused": sum(1 for s in made.values() if s == "paused"),
                    "populate_s": populate_s, "restart_s": restart_s, "listed": len(listed),
                    "same_state": same_state, "usable": sum(ok), "reach_s": time.perf_counter() - t,
                    "leftover": leftovers(server.home)}


def served_backend(home: Path) -> str:
    """The backend `agentenv serve` runs on this home: the one this process selects with the same
    configuration, checked on a container the server made (only the warm backend's run its init)."""
    from e2b import Sandbox as E2BSandbox

    from agentenv.backend.docker_client import api
    from agentenv.backend.warm import INIT_PATH
    from agentenv.sandbox import runtime

    rt = runtime()
    sbx = E2BSandbox.create("base", timeout=SANDBOX_TTL_S)
    try:
        rec = rt.registry.get_sandbox(sbx.sandbox_id)
        if rec is None or not rec.container:
            raise SystemExit(f"the server's sandbox {sbx.sandbox_id} is not in the registry at {home}")
        warm_init = api().inspect_container(rec.container)["Path"] == INIT_PATH
    finally:
        sbx.kill()
    if warm_init != (rt.backend.name == "warm"):
        raise SystemExit(f"the server's containers {'run' if warm_init else 'do not run'} the warm backend's "
                         f"init, but this configuration selects {rt.backend.name!r} ({rt.backend.reason})")
    return rt.backend.name


def run(args: argparse.Namespace) -> tuple[list[LoadResult], dict[str, object] | None, str]:
    """Every phase on one server in a private home (`private_home`), on `args.backend`; everything closed
    at the end. Returns the runs, the crash phase and the backend the server ran."""
    server = None
    results: list[LoadResult] = []
    crash = None
    saved = os.environ.get("AGENTENV_BACKEND")
    os.environ["AGENTENV_BACKEND"] = args.backend  # the server inherits it
    try:
        with private_home("load") as home:
            try:
                server = Server(home)
                backend = served_backend(home)
                print(f"== the server runs the {backend} backend", flush=True)
                for n in args.clients:
                    runs = args.rounds if n == TARGETS["clients"] else 1
                    for i in range(1, runs + 1):
                        print(f"== {n} clients for {args.duration:g} s (run {i} of {runs})", flush=True)
                        res = asyncio.run(load_phase(server, n, args.duration, args.max_loops))
                        res.run = i
                        res.tracebacks = server.log.read_text(errors="replace").count("Traceback")
                        print(summary(res), flush=True)
                        results.append(res)
                        if any(res.leftover.values()):
                            print(f"cleanup after {n} clients: closed {close_all()} sandboxes", flush=True)
                if args.crash:
                    print(f"== kill -9 with {args.crash} sandboxes (half paused)", flush=True)
                    server, crash = asyncio.run(crash_phase(server, args.crash))
                    print(crash, flush=True)
            finally:
                if server is not None:
                    server.stop()
    finally:
        if saved is None:
            os.environ.pop("AGENTENV_BACKEND", None)
        else:
            os.environ["AGENTENV_BACKEND"] = saved
    return results, crash, backend


def run_p99(r: LoadResult) -> float:
    """p99 of one run's `commands.run` calls (on a fresh sandbox and on a resumed one)."""
    return quantile(r.lat.get("run", []) + r.lat.get("run_resumed", []), 0.99)


def summary(r: LoadResult) -> str:
    rss = max((s[1] for s in r.samples), default=0.0)
    return (f"{r.clients} clients: {r.loops} loops, run p99 {run_p99(r) * 1e3:.0f} ms, errors "
            f"{dict(r.errors)}, 5xx {r.five_xx}, RSS max {rss:.0f} MiB, leftover {r.leftover}")


def _ms(v: float) -> str:
    return f"{v * 1e3:.0f}" if v == v else "–"


def verdict(good: bool) -> str:
    return "met" if good else "**missed**"


def target_lines(results: list[LoadResult]) -> list[str]:
    """The targets at `TARGETS["clients"]` clients, on every run of that count: the p99 of
    `commands.run` judged on the median of the runs' p99s (with their spread), 5xx and leaks summed, the
    server's RSS at its largest; nothing when no run had that many clients."""
    runs = [r for r in results if r.clients == TARGETS["clients"]]
    if not runs:
        return []
    five_xx = sum(r.five_xx for r in runs)
    leaks = sum(sum(r.leftover.values()) for r in runs)
    rss = max((s[1] for r in runs for s in r.samples), default=0.0)
    shortest = min(r.duration_s for r in runs)
    full = shortest >= TARGETS["duration_s"]
    return ["", f"Targets at {TARGETS['clients']} clients, {len(runs)} run(s) of at least {shortest:.0f} s"
            + ("" if full else f" (shorter than the target's {TARGETS['duration_s']} s)") + ":", "",
            f"- {judge(SERVER_RUN_P99, [run_p99(r) for r in runs]).text()}",
            f"- zero 5xx ({five_xx}: {verdict(five_xx == 0)}), zero leaks ({leaks}: {verdict(leaks == 0)}), "
            f"server RSS ≤ {TARGETS['rss_mib']} MiB ({rss:.0f} MiB: {verdict(rss <= TARGETS['rss_mib'])})."]


def render(results: list[LoadResult], crash: dict[str, object] | None, cmd: str, busy: float,
           backend: str) -> str:
    from importlib.metadata import version

    lines = [
        f"Command: `{cmd}`  ",
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}, e2b SDK {version('e2b')}, "
        f"uvicorn {version('uvicorn')}; {other_load_text(busy)} Load average at the end "
        f"{os.getloadavg()[0]:.2f}. The clients (one asyncio process) and `agentenv serve` share these "
        f"cores with dockerd, containerd and CRIU. Backend `{backend}` (checked on a container the server "
        "made). Sandbox profile: memory 64m, pids 32, image `base`.",
        "",
        "Each client loops create → `commands.run` → `files.write` + `files.read` → `pause` → `connect` "
        "(a resume) → `commands.run` → `kill`; p50 / p99 in ms, per operation.",
        "",
        "| clients | s | loops | ops/s | " + " | ".join(OPS) + " | errors | 5xx "
        "| server RSS MiB (start → max → end) | fds (start → max → end) "
        "| left over (sandboxes / containers / checkpoints) |",
        "|---" * (len(OPS) + 9) + "|",
    ]
    for r in results:
        ops = sum(len(v) for v in r.lat.values())
        rss = [s[1] for s in r.samples] or [0.0]
        fds = [s[2] for s in r.samples] or [0]
        cells = [f"{_ms(quantile(r.lat.get(op, []), 0.5))} / {_ms(quantile(r.lat.get(op, []), 0.99))}"
                 for op in OPS]
        errs = sum(r.errors.values())
        lo = r.leftover
        label = f"{r.clients}" + (f" (run {r.run})" if r.clients == TARGETS["clients"] else "")
        lines.append(f"| {label} | {r.duration_s:.0f} | {r.loops} | {ops / r.duration_s:.1f} | "
                     + " | ".join(cells) + f" | {errs} | {r.five_xx} | {rss[0]:.0f} → {max(rss):.0f} → "
                     f"{rss[-1]:.0f} | {fds[0]} → {max(fds)} → {fds[-1]} | {lo['sandboxes']} / "
                     f"{lo['containers']} / {lo['checkpoints']} |")
    lines.append("")
    for r in results:
        if r.errors:
            kinds = "; ".join(f"{k}: {v} (e.g. “{r.examples.get(k, '')}”)" for k, v in r.errors.most_common())
            lines.append(f"Errors at {r.clients} clients: {kinds}.  ")
        if r.fds_end:
            lines.append(f"Open fds of the server after the {r.clients}-client run, by kind: "
                         + ", ".join(f"{k} {v}" for k, v in r.fds_end.most_common()) + ".  ")
        if r.tracebacks:
            lines.append(f"The server logged {r.tracebacks} tracebacks by the end of the {r.clients}-client "
                         "run.  ")
    lines += target_lines(results)
    if crash is not None:
        lo = crash["leftover"]
        lines += ["", f"`kill -9` of the server holding {crash['n']} sandboxes ({crash['paused']} paused; "
                  f"made in {crash['populate_s']:.0f} s), restarted on the same home and port "
                  f"(healthy after {crash['restart_s']:.1f} s): {crash['listed']} listed, "
                  f"{crash['same_state']} of {crash['n']} with the state they had, {crash['usable']} of "
                  f"{crash['n']} usable (`connect` + `commands.run` read the file each was given before the "
                  f"crash; {crash['reach_s']:.0f} s for all, 8 at a time), then killed: left over "
                  f"{lo['sandboxes']} / {lo['containers']} / {lo['checkpoints']} (target {crash['n']} of "
                  f"{crash['n']}: {verdict(crash['usable'] == crash['n'])})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="8,32,64", help="comma-separated client counts, one run each "
                                                         f"({TARGETS['clients']}: --rounds runs)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load per run")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"runs at {TARGETS['clients']} clients, the target's (default 3, quick 1)")
    ap.add_argument("--backend", default="warm", help="the server's backend ($AGENTENV_BACKEND)")
    ap.add_argument("--max-loops", type=int, default=10_000, help="loops per client at most")
    ap.add_argument("--crash", type=int, default=50, help="sandboxes held at the kill -9 (0 = skip)")
    ap.add_argument("--quick", action="store_true",
                    help=f"{TARGETS['clients']} clients once for 20 s, crash with 6")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.duration, args.crash = str(TARGETS["clients"]), 20.0, 6
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--clients takes comma-separated counts, e.g. 8,32 (got {args.clients!r})") \
            from None
    if not args.clients or min(args.clients) < 1 or args.rounds < 1 or args.duration <= 0:
        raise SystemExit("--clients needs positive counts, --rounds at least 1, --duration above 0")
    from agentenv.backend.settings import BACKENDS

    if args.backend not in BACKENDS:
        raise SystemExit(f"--backend must be one of {', '.join(BACKENDS)} (got {args.backend!r})")
    given = argv if argv is not None else sys.argv[1:]
    cmd = ("python bench/sandbox_server_load.py " + " ".join(given)).strip()
    busy = busy_cores_before()
    results, crash, backend = run(args)
    text = render(results, crash, cmd, busy, backend)
    print(text)
    if not args.no_write:
        write_section("server-load", text)


if __name__ == "__main__":
    main()
