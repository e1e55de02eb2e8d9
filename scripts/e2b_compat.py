"""The E2B compatibility table of docs/agentenv.md, rendered from the last recorded run of our SDK tests.

One row per public method of the installed `e2b` SDK (found by introspection, so a new method is a new
row), each cell read from which passing tests called it. Usage: python scripts/e2b_compat.py [--check]

Design: docs/design/tooling.md#scripts-e2b-compat.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import inspect
import io
import json
import shutil
import sys
import tempfile
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.bench_report import write_section  # noqa: E402

DOC = ROOT / "docs" / "agentenv.md"
SECTION = "e2b-compat"
RUN_FILE = ROOT / "docs" / "data" / "e2b_compat_run.json"
RECORD_ENV = "E2B_COMPAT_RECORD"
FLAVOURS = ("sync", "async")
_SDK_MODULES = ("e2b.sandbox_sync.", "e2b.sandbox_async.")

# Row (`Class.method`, the sync class's name; async-only classes without their `Async` prefix), or every
# method of a class (`Class.*`) -> (HTTP route or Connect RPC it uses, note). A key that names no method of
# the installed SDK is an error.
NOTES: dict[str, tuple[str, str]] = {
    "Sandbox.create": ("`POST /v2/sandboxes`", "templates are `agentenv images` names; "
                       "`allow_internet_access=True`, `network`, `mcp`, `volume_mounts`, `auto_resume`, "
                       "`autoPauseMemory=false` are refused with a 400 naming them"),
    "Sandbox.list": ("`GET /v2/sandboxes`", "newest first, paginated, `metadata`/`state`/`started_after`/"
                     "`template` filters"),
    "SandboxPaginator.next_items": ("`GET /v2/sandboxes?nextToken=`", ""),
    "Sandbox.get_info": ("`GET /sandboxes/{id}`", ""),
    "Sandbox.is_running": ("`GET /health`", ""),
    "Sandbox.kill": ("`DELETE /sandboxes/{id}`", ""),
    "Sandbox.pause": ("`POST /sandboxes/{id}/pause`", "CRIU to disk, memory kept; `keep_memory=False` / "
                      "`mode=\"filesystem\"` is refused (400): a paused sandbox always keeps its processes"),
    "Sandbox.beta_pause": ("`POST /sandboxes/{id}/pause`", "as `pause`"),
    "Sandbox.connect": ("`POST /v2/sandboxes/{id}/connect`", "resumes a paused sandbox; never shortens a "
                        "running one's TTL; `memory=false` refused (400)"),
    "Sandbox.set_timeout": ("`POST /sandboxes/{id}/timeout`", ""),
    "Sandbox.fork": ("`POST /sandboxes/{id}/fork`", ""),
    "Sandbox.create_snapshot": ("`POST /sandboxes/{id}/snapshots`", "memory and files; filesystem-only "
                                "snapshots refused (400)"),
    "Sandbox.list_snapshots": ("`GET /snapshots`", ""),
    "SnapshotPaginator.next_items": ("`GET /snapshots?nextToken=`", ""),
    "Sandbox.delete_snapshot": ("`DELETE /templates/{id}`", ""),
    "Sandbox.get_metrics": ("`GET /sandboxes/{id}/metrics`", "one sample taken at the call (cgroup and "
                            "work dir), no history"),
    "Sandbox.download_url": ("`GET /files?signature=`", "signed with the sandbox's envd token, expiry "
                             "checked"),
    "Sandbox.upload_url": ("`POST /files?signature=`", "signed with the sandbox's envd token, expiry "
                           "checked"),
    "Sandbox.get_host": ("(client side)", "a URL the SDK composes; nothing listens: sandboxes have no "
                         "network"),
    "Sandbox.update_network": ("`PUT /sandboxes/{id}/network`", "501: sandboxes have no network"),
    "Sandbox.get_mcp_token": ("(MCP gateway)", "no MCP gateway (create with `mcp` is a 400)"),
    "Sandbox.get_mcp_url": ("(MCP gateway)", "no MCP gateway (create with `mcp` is a 400)"),
    "Commands.run": ("`process.Process/Start`", "starts in `/home/user` (relative `cwd` from there); "
                     "`user` other than `user` refused"),
    "Commands.connect": ("`process.Process/Connect`", ""),
    "Commands.list": ("`process.Process/List`", ""),
    "Commands.kill": ("`process.Process/SendSignal`", ""),
    "Commands.send_stdin": ("`process.Process/SendInput`", ""),
    "Commands.close_stdin": ("`process.Process/CloseStdin`", ""),
    "Commands.stream_input": ("`process.Process/StreamInput`", "client streaming over HTTP/1.1: Connect "
                              "`unimplemented` (use `send_stdin`)"),
    "CommandHandle.wait": ("(the `Start`/`Connect` stream)", ""),
    "CommandHandle.kill": ("`process.Process/SendSignal`", ""),
    "CommandHandle.send_stdin": ("`process.Process/SendInput`", ""),
    "CommandHandle.close_stdin": ("`process.Process/CloseStdin`", ""),
    "CommandHandle.disconnect": ("(closes the stream)", "the command goes on"),
    "CommandInputHandle.send": ("`process.Process/StreamInput`", ""),
    "CommandInputHandle.close": ("`process.Process/StreamInput`", ""),
    "Pty.create": ("`process.Process/Start` with `pty`", "the terminal lives in the sandbox and survives "
                   "pause/connect"),
    "Pty.connect": ("`process.Process/Connect`", ""),
    "Pty.send_stdin": ("`process.Process/SendInput`", ""),
    "Pty.resize": ("`process.Process/Update`", ""),
    "Pty.kill": ("`process.Process/SendSignal`", ""),
    "Pty.stream_input": ("`process.Process/StreamInput`", "as `Commands.stream_input`"),
    "Filesystem.read": ("`GET /files`", "`/home/user` (= `/workspace`) and below"),
    "Filesystem.write": ("`POST /files`", "metadata as `user.e2b.*` xattrs"),
    "Filesystem.write_files": ("`POST /files`", "several files in one upload"),
    "Filesystem.list": ("`filesystem.Filesystem/ListDir`", ""),
    "Filesystem.exists": ("`filesystem.Filesystem/Stat`", ""),
    "Filesystem.get_info": ("`filesystem.Filesystem/Stat`", ""),
    "Filesystem.make_dir": ("`filesystem.Filesystem/MakeDir`", ""),
    "Filesystem.rename": ("`filesystem.Filesystem/Move`", ""),
    "Filesystem.remove": ("`filesystem.Filesystem/Remove`", ""),
    "Filesystem.watch_dir": ("`CreateWatcher` (sync), `WatchDir` (async)", "inotify on the work dir's "
                             "volume, recursive too"),
    "WatchHandle.get_new_events": ("`filesystem.Filesystem/GetWatcherEvents`", ""),
    "WatchHandle.stop": ("`RemoveWatcher` (sync), end of the `WatchDir` stream (async)", ""),
    "Git.*": ("`process.Process/Start`", "runs `git` in the sandbox (the base image has none)"),
}
# Calls this server refuses by design: a passing test that calls one checks the refusal.
REFUSED = frozenset({"Sandbox.update_network", "Sandbox.get_mcp_token", "Sandbox.get_mcp_url",
                     "Commands.stream_input", "Pty.stream_input"})


def _flavour(cls: type) -> str:
    return "async" if cls.__module__.startswith("e2b.sandbox_async.") else "sync"


def _label(cls: type) -> str:
    return cls.__name__.removeprefix("Async")


def _functions(raw: object) -> list[Callable]:
    """The functions behind a class attribute (a property's getter, a classmethod's function, the method
    of the SDK's `class_method_variant`), with their `typing.overload` signatures."""
    if isinstance(raw, _Recorded):
        raw = raw.raw
    fn = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", None) or getattr(raw, "method",
                                                                                             raw)
    return [fn, *typing.get_overloads(fn)] if callable(fn) else []


def _classes_in(hint: object) -> Iterator[type]:
    if isinstance(hint, type):
        yield hint
    for arg in typing.get_args(hint):
        yield from _classes_in(arg)


def public_methods(cls: type) -> list[str]:
    """Names of `cls`'s public methods (properties and constants left out)."""
    names = []
    for name in dir(cls):
        raw = inspect.getattr_static(cls, name)
        if not name.startswith("_") and not isinstance(raw, property | type) and callable(getattr(cls, name)):
            names.append(name)
    return names


@functools.cache
def sdk_classes() -> dict[str, type]:
    """{"sync Sandbox": e2b.Sandbox, "async Filesystem": ..., ...}: `Sandbox`, `AsyncSandbox`, and each
    class of the SDK's sandbox modules that their public properties and methods return, transitively."""
    from e2b import AsyncSandbox, Sandbox

    found: dict[str, type] = {}
    todo: list[type] = [Sandbox, AsyncSandbox]
    while todo:
        cls = todo.pop()
        key = f"{_flavour(cls)} {_label(cls)}"
        if key in found:
            if found[key] is not cls:
                raise SystemExit(f"two SDK classes are both {key!r}: {found[key]} and {cls}; name the rows "
                                 "apart in scripts/e2b_compat.py")
            continue
        found[key] = cls
        for name in dir(cls):
            if name.startswith("_"):
                continue
            for fn in _functions(inspect.getattr_static(cls, name)):
                try:
                    returns = typing.get_type_hints(fn).get("return")
                except Exception as e:  # an annotation that does not resolve: say whose
                    raise SystemExit(f"cannot read the annotations of {cls.__qualname__}.{name}: {e}") from e
                todo += [c for c in _classes_in(returns) if c.__module__.startswith(_SDK_MODULES)]
    return found


def sdk_methods() -> dict[str, dict[str, str]]:
    """{row ("Class.method"): {flavour: recorded key ("sync Class.method")}} of the installed SDK."""
    rows: dict[str, dict[str, str]] = {}
    for key, cls in sdk_classes().items():
        flavour, label = key.split(" ")
        for name in public_methods(cls):
            rows.setdefault(f"{label}.{name}", {})[flavour] = f"{flavour} {label}.{name}"
    return rows


def _caller_module(frame) -> str:
    """The module of the first frame at or above `frame` that is not this module's (a wrapper)."""
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return "" if frame is None else frame.f_globals.get("__name__", "")


class _Recorded:
    """A class attribute that behaves as the SDK's `raw` one and reports `key` to `record` on each call
    made from outside the SDK."""

    def __init__(self, raw: object, key: str, record: Callable[[str], None]) -> None:
        self.raw, self.key, self.record = raw, key, record

    def __get__(self, obj: object, objtype: type | None = None) -> Callable:
        bound = self.raw.__get__(obj, objtype) if hasattr(self.raw, "__get__") else self.raw
        key, record = self.key, self.record

        @functools.wraps(bound)
        def call(*args, **kwargs):
            caller = _caller_module(sys._getframe(1))
            if caller != "e2b" and not caller.startswith("e2b."):
                record(key)
            return bound(*args, **kwargs)
        return call


@contextlib.contextmanager
def recording(record: Callable[[str], None]) -> Iterator[None]:
    """While inside, every public method of `sdk_classes()` reports its recorded key ("sync
    Filesystem.write") to `record` when code outside the SDK calls it; the classes are restored after."""
    undo: list[tuple[type, str, object]] = []
    try:
        for key, cls in sdk_classes().items():
            for name in public_methods(cls):
                undo.append((cls, name, cls.__dict__.get(name, _ABSENT)))
                setattr(cls, name, _Recorded(inspect.getattr_static(cls, name), f"{key}.{name}", record))
        yield
    finally:
        for cls, name, old in reversed(undo):
            if old is _ABSENT:
                delattr(cls, name)
            else:
                setattr(cls, name, old)


_ABSENT = object()


@dataclass(frozen=True)
class Run:
    """A recorded run: the e2b version it ran against and, per test node id, its outcome ("passed",
    "failed", "skipped") and the recorded keys of the SDK methods it called."""
    e2b: str
    tests: dict[str, tuple[str, frozenset[str]]]


def load_run(path: Path = RUN_FILE) -> Run:
    """The recorded run in `path`, checked against the installed SDK."""
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: record a run ({RECORD_ENV}=1, see scripts/e2b_compat.py)")
    try:
        data = json.loads(path.read_text())
        tests = {node: (t["outcome"], frozenset(t["calls"])) for node, t in data["tests"].items()}
        run = Run(data["e2b"], tests)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"{path} is not a recorded run ({type(e).__name__}: {e}); record it again") from e
    if run.e2b != version("e2b"):
        raise SystemExit(f"{path} was recorded against e2b {run.e2b}, e2b {version('e2b')} is installed: "
                         "record it again")
    known = {key for flavours in sdk_methods().values() for key in flavours.values()}
    unknown = sorted({c for _, calls in run.tests.values() for c in calls} - known)
    if unknown:
        raise SystemExit(f"{path} names calls the installed SDK lacks: {', '.join(unknown)}; record it again")
    return run


def save_run(run: Run, path: Path = RUN_FILE) -> None:
    data = {"e2b": run.e2b, "tests": {node: {"outcome": outcome, "calls": sorted(calls)}
                                      for node, (outcome, calls) in sorted(run.tests.items())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def status(row: str, key: str | None, run: Run) -> str:
    """The cell of one flavour of a row: yes / refused / fails / untested with (up to `SHOWN` of) the
    tests, or `—` when the flavour lacks the method."""
    if key is None:
        return "—"
    callers = {node.split("::", 1)[-1]: outcome for node, (outcome, calls) in run.tests.items()
               if key in calls}
    passed = sorted(name for name, outcome in callers.items() if outcome == "passed")
    failed = sorted(name for name, outcome in callers.items() if outcome == "failed")
    if passed:
        return f"{'refused' if row in REFUSED else 'yes'} ({_names(passed)})"
    return f"fails ({_names(failed)})" if failed else "untested"


SHOWN = 3  # tests named in a cell; the recorded run has them all


def _names(tests: list[str]) -> str:
    more = f" and {len(tests) - SHOWN} more" if len(tests) > SHOWN else ""
    return ", ".join(tests[:SHOWN]) + more


def table(run: Run) -> str:
    rows = sdk_methods()
    classes = {row.split(".")[0] + ".*" for row in rows}
    stale = sorted((set(NOTES) | REFUSED) - set(rows) - classes)
    if stale:
        raise SystemExit(f"NOTES/REFUSED of scripts/e2b_compat.py name calls the installed SDK lacks: "
                         f"{', '.join(stale)}")
    files = ", ".join(sorted({node.split("::", 1)[0] for node in run.tests})) or "no tests"
    lines = [f"Generated by `scripts/e2b_compat.py` from the last recorded run of {files} against "
             f"e2b {run.e2b}: `yes`/`refused` names the passing "
             "tests that call the method themselves (`refused`: what they check is the refusal), `fails` "
             "the failing ones (skipped tests do not count), `untested` says no test calls it. Re-record "
             f"with `{RECORD_ENV}=1 .venv/bin/pytest tests/server/test_server_e2b.py`, then run the script.",
             "",
             "| SDK call | HTTP / RPC | sync SDK | async SDK | notes |", "|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (r.split(".")[0] != "Sandbox", r)):
        wire, note = NOTES.get(row) or NOTES.get(row.split(".")[0] + ".*", ("", ""))
        cells = [status(row, rows[row].get(f), run) for f in FLAVOURS]
        lines.append(f"| `{row}` | {wire} | {cells[0]} | {cells[1]} | {note} |")
    return "\n".join(lines)


def check(run: Run, doc: Path = DOC) -> str:
    """The unified diff from `doc` to `doc` with its table rendered from `run` ("" when they agree)."""
    with tempfile.TemporaryDirectory() as tmp:
        rendered = Path(tmp) / doc.name
        shutil.copyfile(doc, rendered)
        with contextlib.redirect_stdout(io.StringIO()):  # write_section says what it wrote
            write_section(SECTION, table(run), rendered)
        return "".join(difflib.unified_diff(doc.read_text().splitlines(True),
                                            rendered.read_text().splitlines(True), str(doc),
                                            f"{doc} with the table rendered from the recorded run"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=RUN_FILE, help="the recorded run to render from")
    ap.add_argument("--check", action="store_true", help="compare, do not write: exit 1 with the diff")
    args = ap.parse_args()
    run = load_run(args.run)
    if args.check:
        diff = check(run)
        print(diff or f"{DOC.relative_to(ROOT)}: the table is what the recorded run renders")
        return 1 if diff else 0
    write_section(SECTION, table(run), DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
