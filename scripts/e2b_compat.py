"""Regenerate the E2B compatibility table of docs/agentenv.md from a run of our own server tests.

Every public call of the SDK's `Sandbox` (and of `sandbox.files`, `.commands`, `.pty`) must have a row
in `ROWS` (the script stops, naming the call, when the installed SDK has one that is missing); a row
says which of our tests exercise the call, or checks its refusal. The script runs those tests (pytest,
JUnit XML) and writes each row as `yes` / `refused: <reason>` when all its tests passed, `FAILING`
otherwise, into the section between `<!-- bench:e2b-compat:start -->` and `<!-- bench:e2b-compat:end -->`.

    .venv/bin/python scripts/e2b_compat.py            # runs the tests (about 2 min), rewrites the table
    .venv/bin/python scripts/e2b_compat.py --junit F  # from a JUnit XML file of an earlier run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bench_report import write_section  # noqa: E402

DOC = ROOT / "docs" / "agentenv.md"
E2B = "tests/server/test_server_e2b.py"
T_CMD = f"{E2B}::test_commands_through_the_sdk"
T_FILES = f"{E2B}::test_files_through_the_sdk"
T_LIFE = f"{E2B}::test_pause_connect_fork_kill"
T_ERR = f"{E2B}::test_auth_and_error_shapes"
T_ASYNC = f"{E2B}::test_async_sdk"
T_SNAP = f"{E2B}::test_snapshots"
T_TTL = f"{E2B}::test_ttl_kills_or_pauses"


@dataclass(frozen=True)
class Row:
    calls: tuple[str, ...]   # SDK calls (Class.method) this row covers
    wire: str                # HTTP route or Connect RPC
    tests: tuple[str, ...]   # our tests that exercise it (or check its refusal)
    refused: str = ""        # why it is refused ("" = supported)
    note: str = ""


ROWS = (
    Row(("Sandbox.create",), "`POST /v2/sandboxes`", (T_CMD, T_ERR),
        note="templates are `agentenv images` names; `allow_internet_access=True`, `network`, `mcp`, "
             "`volume_mounts`, `auto_resume`, `autoPauseMemory=false` are refused with a 400 naming them"),
    Row(("Sandbox.list",), "`GET /v2/sandboxes`", (T_LIFE,),
        note="newest first, paginated, `metadata`/`state`/`started_after`/`template` filters"),
    Row(("Sandbox.get_info", "Sandbox.is_running"), "`GET /sandboxes/{id}`, `GET /health`", (T_LIFE,)),
    Row(("Sandbox.kill",), "`DELETE /sandboxes/{id}`", (T_LIFE, T_ASYNC)),
    Row(("Sandbox.pause", "Sandbox.beta_pause"), "`POST /sandboxes/{id}/pause`", (T_LIFE,),
        note="CRIU to disk, memory kept; `keep_memory=False` / `mode=\"filesystem\"` is refused (400): a "
             "paused sandbox always keeps its processes"),
    Row(("Sandbox.connect",), "`POST /v2/sandboxes/{id}/connect`", (T_LIFE, T_ERR),
        note="resumes a paused sandbox; never shortens a running one's TTL; `memory=false` refused (400)"),
    Row(("Sandbox.set_timeout",), "`POST /sandboxes/{id}/timeout`", (T_TTL,)),
    Row(("Sandbox.fork",), "`POST /sandboxes/{id}/fork`", (T_LIFE,)),
    Row(("Sandbox.create_snapshot", "Sandbox.list_snapshots", "Sandbox.delete_snapshot"),
        "`POST /sandboxes/{id}/snapshots`, `GET /snapshots`, `DELETE /templates/{id}`", (T_SNAP,),
        note="memory and files; filesystem-only snapshots refused (400)"),
    Row(("Sandbox.get_metrics",), "`GET /sandboxes/{id}/metrics`", (T_LIFE,),
        note="one sample taken at the call (cgroup and work dir), no history"),
    Row(("Sandbox.download_url", "Sandbox.upload_url"), "`GET/POST /files?signature=`", (T_FILES,),
        note="signed with the sandbox's envd token, expiry checked"),
    Row(("Sandbox.get_host",), "(client side)", (), note="a URL the SDK composes; nothing listens: "
        "sandboxes have no network"),
    Row(("Sandbox.update_network",), "`PUT /sandboxes/{id}/network`", (T_ERR,),
        refused="501: sandboxes have no network"),
    Row(("Sandbox.get_mcp_token", "Sandbox.get_mcp_url"), "(MCP gateway)", (T_ERR,),
        refused="no MCP gateway (create with `mcp` is a 400)"),
    Row(("Commands.run", "Commands.connect", "Commands.list", "Commands.kill", "Commands.send_stdin",
         "Commands.close_stdin"), "`process.Process/Start`, `Connect`, `List`, `SendSignal`, `SendInput`, "
        "`CloseStdin`", (T_CMD, T_FILES),
        note="start in `/home/user` (relative `cwd` from there); `user` other than `user` refused"),
    Row(("Commands.stream_input", "Pty.stream_input"), "`process.Process/StreamInput`", (),
        refused="client streaming over HTTP/1.1: Connect `unimplemented` (use `send_stdin`)"),
    Row(("Pty.create", "Pty.connect", "Pty.send_stdin", "Pty.resize", "Pty.kill"),
        "`Start` with `pty`, `Connect`, `SendInput`, `Update`, `SendSignal`", (T_LIFE, T_FILES),
        note="the terminal lives in the sandbox and survives pause/connect"),
    Row(("Filesystem.read", "Filesystem.write", "Filesystem.write_files"), "`GET/POST /files`",
        (T_FILES, T_ASYNC), note="`/home/user` (= `/workspace`) and below; metadata as `user.e2b.*` xattrs"),
    Row(("Filesystem.list", "Filesystem.exists", "Filesystem.get_info", "Filesystem.make_dir",
         "Filesystem.rename", "Filesystem.remove"), "`filesystem.Filesystem/*`", (T_FILES,)),
    Row(("Filesystem.watch_dir",), "`CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher`, `WatchDir`",
        (T_FILES, T_ASYNC), note="inotify on the work dir's volume, recursive too"),
)


def sdk_calls() -> set[str]:
    from e2b import Sandbox
    from e2b.sandbox_sync.commands.command import Commands
    from e2b.sandbox_sync.commands.pty import Pty
    from e2b.sandbox_sync.filesystem.filesystem import Filesystem
    return {f"{cls.__name__}.{name}" for cls in (Sandbox, Filesystem, Commands, Pty) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))}


def outcomes(junit: Path) -> dict[str, bool]:
    """{test node id (path::name): passed} of a JUnit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        out[f"{path}::{case.get('name')}"] = not failed
    return out


def table(results: dict[str, bool]) -> str:
    from importlib.metadata import version
    lines = [f"Generated by `scripts/e2b_compat.py` from a run of our tests against e2b {version('e2b')}"
             " (`AsyncSandbox` makes the same calls).", "",
             "| SDK call | HTTP / RPC | status | tests |", "|---|---|---|---|"]
    for row in ROWS:
        ok = all(results.get(t) is True for t in row.tests)
        status = (f"refused: {row.refused}" if row.refused else "yes") if ok else "FAILING"
        if row.note:
            status += f"; {row.note}"
        tests = ", ".join(t.split("::")[1] for t in row.tests) or "none"
        calls = ", ".join(f"`{c}`" for c in row.calls)
        lines.append(f"| {calls} | {row.wire} | {status} | {tests} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", type=Path, help="use this JUnit XML report instead of running the tests")
    args = ap.parse_args()
    covered = {c for row in ROWS for c in row.calls}
    missing = sorted(sdk_calls() - covered)
    if missing:
        raise SystemExit(f"SDK calls without a row in ROWS: {', '.join(missing)}; add them")
    junit = args.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "e2b.xml"
        tests = sorted({t for row in ROWS for t in row.tests})
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", *tests], cwd=ROOT)
    results = outcomes(junit)
    write_section("e2b-compat", table(results), DOC)
    failing = [t for row in ROWS for t in row.tests if results.get(t) is not True]
    if failing:
        print("failing or not run: " + ", ".join(sorted(set(failing))), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
