"""The `server` part of bench/sandbox.py: `agentenv serve` through the real e2b SDK against local sandboxes.

Command latency, create to first command, and density (>= 200 paused sandboxes, the server's own RSS);
every sandbox lives in the bench's private $AGENTENV_HOME and is closed at the end, also on failure.

Design: docs/design/benchmarks.md#bench-sandbox-server.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml
from bench_stats import quantile

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
PROFILE = {"memory": "64m", "cpus": 1.0, "pids_limit": 32, "tmpfs": {"/tmp": "size=8m,mode=1777"}}
TARGETS = {"run": 2.0, "create": 1.5, "rss_mib": 200, "paused": 200}


def fmt(values: list[float]) -> str:
    """Median / p90 in ms."""
    return f"{statistics.median(values) * 1e3:.1f} / {quantile(values, 0.9) * 1e3:.1f} ms"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`agentenv serve` on a free loopback port, with this process's $AGENTENV_HOME and config."""

    def __init__(self, home: Path, key: str | None = None, port: int | None = None) -> None:
        """A new server; `key` and `port` given: the same server started again (after `kill9`)."""
        self.home = home
        self.key = key or "e2b_" + secrets.token_hex(20)
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / "server.log"
        env = {**os.environ, "AGENTENV_API_KEY": self.key}
        env.pop("AGENTENV_SERVER", None)
        with open(self.log, "ab") as out:
            argv = [sys.executable, "-m", "agentenv.cli", "serve", "--port", str(self.port)]
            self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 204:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"agentenv serve did not come up: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        os.environ.update(E2B_API_URL=self.url, E2B_SANDBOX_URL=self.url, E2B_API_KEY=self.key)
        os.environ.pop("E2B_DOMAIN", None)

    def kill9(self) -> None:
        """SIGKILL the server (no shutdown of any kind), as a crash would."""
        self.proc.kill()
        self.proc.wait(timeout=20)

    def restart(self) -> Server:
        """The same server (home, key, port) started again."""
        return Server(self.home, self.key, self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


def close_all() -> int:
    """Close every sandbox of this home's registry (4 at a time); returns how many."""
    from agentenv import Sandbox

    sandboxes = Sandbox.list()

    def close(sb) -> None:
        try:
            sb.close()
        except Exception as e:  # noqa: BLE001 - report and go on cleaning
            print(f"cleanup: {sb.id}: {e}", file=sys.stderr)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(close, sandboxes))
    return len(sandboxes)


def measure(n_paused: int, reps: int) -> dict[str, object]:
    """The figures of the module docstring (the caller owns $AGENTENV_HOME; see `run`)."""
    from e2b import Sandbox as E2BSandbox

    from agentenv import Sandbox
    from agentenv.remote import SandboxHost

    home = Path(os.environ["AGENTENV_HOME"])
    server = Server(home)
    out: dict[str, object] = {"n_paused": n_paused}
    try:
        out["rss_idle"] = rss_mib(server.proc.pid)
        # Warm commands: one sandbox on each side, a few untimed calls first.
        local, sdk = Sandbox.create(), E2BSandbox.create("base", timeout=600)
        for _ in range(3):
            local.exec(["true"])
            sdk.commands.run("true")
        out["run_local"] = [_timed(lambda: local.exec(["true"])) for _ in range(reps)]
        out["run_sdk"] = [_timed(lambda: sdk.commands.run("true")) for _ in range(reps)]
        local.close()
        sdk.kill()
        # Create -> first command, then the sandbox is removed (untimed).
        out["create_local"], out["create_sdk"] = [], []
        for _ in range(max(3, reps // 6)):
            t = time.perf_counter()
            sb = Sandbox.create()
            sb.exec(["true"])
            out["create_local"].append(time.perf_counter() - t)
            sb.close()
            t = time.perf_counter()
            s = E2BSandbox.create("base", timeout=600)
            s.commands.run("true")
            out["create_sdk"].append(time.perf_counter() - t)
            s.kill()
        # Density: n_paused paused sandboxes on the server (forks of one, paused in batches).
        host = SandboxHost(server.url, server.key)
        t0 = time.perf_counter()
        origin = host.create()
        origin.pause()
        paused = [origin]
        with ThreadPoolExecutor(2) as pool:
            while len(paused) < n_paused:
                batch = origin.fork(min(8, n_paused - len(paused)))
                list(pool.map(lambda sb: sb.pause(), batch))
                paused += batch
        out["populate_s"] = time.perf_counter() - t0
        info = host.info()
        out["host_paused"], out["host_running"] = info["paused"], info["running"]
        out["rss_paused"] = rss_mib(server.proc.pid)
        # Reach random ones: connect (one resume) + a command, then pause it again.
        reach = []
        for sb in random.Random(7).sample(paused, min(reps // 3, len(paused))):
            t = time.perf_counter()
            s = E2BSandbox.connect(sb.id, timeout=600)
            s.commands.run("true")
            reach.append(time.perf_counter() - t)
            s.pause()
        out["reach"] = reach
        out["rss_after"] = rss_mib(server.proc.pid)
        out["host_paused_end"] = host.info()["paused"]
        host.close()
    finally:
        server.stop()
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@contextlib.contextmanager
def private_home(name: str) -> Iterator[Path]:
    """A private $AGENTENV_HOME and $AGENTENV_CONFIG (`PROFILE`) for a server bench; on the way out, also
    on failure, every sandbox in it is closed, the previous environment restored and the home removed."""
    from agentenv import SandboxConfig

    saved = {k: os.environ.get(k) for k in ("AGENTENV_HOME", "AGENTENV_CONFIG", "E2B_API_URL",
                                            "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    home = Path(tempfile.mkdtemp(prefix=f"agentenv-bench-{name}-"))
    config = home / "sandbox.yaml"
    config.write_text(yaml.safe_dump(SandboxConfig.load(**PROFILE).to_dict()))
    os.environ.update(AGENTENV_HOME=str(home), AGENTENV_CONFIG=str(config))
    try:
        yield home
    finally:
        print(f"{name} bench: closed {close_all()} sandboxes", flush=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        subprocess.run(["rm", "-rf", str(home)], check=False)


def run(n_paused: int, reps: int) -> dict[str, object]:
    """`measure` in a private home (`private_home`)."""
    with private_home("server"):
        return measure(n_paused, reps)


def render(r: dict[str, object], cmd: str, sdk_version: str) -> str:
    """The `server` section of docs/benchmarks.md."""
    run_ratio = statistics.median(r["run_sdk"]) / statistics.median(r["run_local"])
    create_ratio = statistics.median(r["create_sdk"]) / statistics.median(r["create_local"])
    rss_peak = max(r["rss_paused"], r["rss_after"])

    def verdict(good: bool) -> str:
        return "met" if good else "**missed**"

    run_row = (f"| `exec([\"true\"])` / `commands.run(\"true\")`, warm ({len(r['run_sdk'])} runs) | "
               f"{fmt(r['run_local'])} | {fmt(r['run_sdk'])} | {run_ratio:.2f}× | "
               f"≤ {TARGETS['run']}× ({verdict(run_ratio <= TARGETS['run'])}) |")
    create_row = (f"| create → first command ({len(r['create_sdk'])} runs) | {fmt(r['create_local'])} | "
                  f"{fmt(r['create_sdk'])} | {create_ratio:.2f}× | "
                  f"≤ {TARGETS['create']}× ({verdict(create_ratio <= TARGETS['create'])}) |")
    lines = [
        f"Command: `{cmd}`  ",
        f"Machine: {os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.2f}. `agentenv serve`"
        " "
        f"on a loopback port of the same machine, driven by the unmodified `e2b` SDK {sdk_version} "
        "(E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY pointed at it). Both sides use one sandbox profile "
        "(memory 64m, pids 32, /tmp 8m; image `base`). Times: median / p90.",
        "",
        "| | local `Sandbox` | e2b SDK → `agentenv serve` | ratio | target |",
        "|---|---|---|---|---|",
        run_row,
        create_row,
        "",
        f"Density: the server held {r['host_paused']} paused sandboxes ({r['host_running']} running), made"
        " in "
        f"{r['populate_s']:.0f} s as forks of one, each paused at once. The server process's own RSS: "
        f"{r['rss_idle']:.0f} MiB idle, {r['rss_paused']:.0f} MiB holding them, {r['rss_after']:.0f} MiB "
        f"after the reaches (target ≤ {TARGETS['rss_mib']} MiB: {verdict(rss_peak <= TARGETS['rss_mib'])}). "
        f"Reaching a random paused one (`Sandbox.connect`: one resume, then `commands.run(\"true\")`): "
        f"{fmt(r['reach'])} over {len(r['reach'])} sandboxes; {r['host_paused_end']} were paused again "
        "at the end (each reached one is paused back).",
    ]
    return "\n".join(lines) + "\n"
