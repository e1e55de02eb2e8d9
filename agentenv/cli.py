"""The `agentenv` command line: images, sandboxes, pause/resume/fork, files, stats, gc.

With `--server URL` the sandbox verbs act on an `agentenv serve` host. Human tables by default, `--json` for
scripts; every error is one line on stderr and a non-zero exit (1 refused or failed, 2 bad usage).

Design: docs/design/sandboxes.md#agentenv-cli.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from agentenv.errors import AgentEnvError, BackendUnavailable, ConfigError
from agentenv.paths import SERVER_ENV

if TYPE_CHECKING:
    from agentenv.remote import SandboxHost
    from agentenv.sandbox import Sandbox

# Each verb imports what it needs when it runs: the sandbox runtime (the Docker SDK, the CRIU backend),
# the image recipes and agentenv.remote (the HTTP client, the e2b protocol) are tenths of a second of
# start-up that `--help`, `ls` and every other verb would otherwise pay (bench/cli_startup.py).

PROG = "agentenv"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _emit(args: argparse.Namespace, data: Any, human: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(data, indent=None, default=str))
    else:
        human()


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)).rstrip())


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _kv_pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _sandboxes(args: argparse.Namespace) -> type[Sandbox] | SandboxHost:
    """Where the sandbox verbs act: this machine's sandboxes, or the `--server` host's (same methods:
    create, get, list)."""
    if not args.server:
        from agentenv.sandbox import Sandbox

        return Sandbox
    from agentenv.remote import SandboxHost

    return SandboxHost(args.server)


def _local_only(fn: Callable[[argparse.Namespace], int], verb: str) -> Callable[[argparse.Namespace], int]:
    """`fn`, refused with `--server`: it works on this machine's Docker engine, not through the API."""
    def run(args: argparse.Namespace) -> int:
        if args.server:
            raise ConfigError(f"`{PROG} {verb}` works on the Docker engine of the machine it runs on and has "
                              f"no remote form: run it on the sandbox host {args.server} itself (without "
                              f"--server / ${SERVER_ENV})")
        return fn(args)
    return run


# ---- commands -------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    """The backend in use and why it was chosen (or why none can run), the daemon, the sandbox user."""
    if args.server:
        from agentenv.remote import SandboxHost

        host = SandboxHost(args.server)
        data = {"server": host.url, **host.info()}
        _emit(args, data, lambda: [print(f"{k:26} {v}") for k, v in data.items()])
        return 0
    from agentenv.backend import images
    from agentenv.runtime import runtime

    try:
        rt = runtime()
    except BackendUnavailable as e:
        why = str(e)
        _emit(args, {"backend": None, "backend_error": why}, lambda: print(f"{'backend':26} none: {why}"))
        return 1
    base = images.info("base") if "base" in images.recipe_names() else None
    probe = rt.backend.probe(base.tag) if base and base.built else None
    data = {
        "home": str(rt.home),
        "backend": rt.backend.name,
        **rt.backend.describe(),
        "sandbox_user": probe.auto_user if probe else None,
        "can_checkpoint_other_uids": probe.can_checkpoint_other_uids if probe else None,
        "probe": probe.detail if probe else "not probed: build the base image first (agentenv images build)",
    }

    def human() -> None:
        for k, v in data.items():
            print(f"{k:26} {v}")

    _emit(args, data, human)
    return 0


def cmd_images_build(args: argparse.Namespace) -> int:
    from agentenv.backend import images

    names = [args.name] if args.name else images.recipe_names()
    built = [images.build(n, force=args.force, quiet=args.quiet or args.json).to_dict() for n in names]
    _emit(args, built, lambda: [print(b["tag"]) for b in built])
    return 0


def cmd_images_ls(args: argparse.Namespace) -> int:
    from agentenv.backend import images

    rows = [i.to_dict() for i in images.list_images()]
    _emit(args, rows, lambda: _table(
        [[r["name"], r["tag"], "yes" if r["built"] else "no", _mib(r["size_bytes"]) if r["built"] else "-",
          r["parent"] or "-"] for r in rows], ["NAME", "TAG", "BUILT", "SIZE", "PARENT"]))
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    if args.server and args.set:
        raise ConfigError("--set changes this machine's sandbox config; a remote sandbox takes its host's "
                          "config (conf/sandbox/default.yaml on the host)")
    from agentenv.config import SandboxConfig

    cfg = SandboxConfig.load().with_assignments(args.set or [])
    sb = _sandboxes(args).create(image=args.image, memory=args.memory, cpus=args.cpus, config=cfg,
                        labels=_kv_pairs(args.label, "--label"))
    data = sb.describe()

    def human() -> None:
        print(sb.id)
        if sb.user == "root":
            print(f"{PROG}: sandbox {sb.id} runs as root without capabilities (this host's CRIU cannot "
                  "checkpoint other uids; see `agentenv info`)", file=sys.stderr)

    _emit(args, data, human)
    return 0


def _ls_filter(args: argparse.Namespace) -> Callable[[dict[str, Any]], bool]:
    """`ls --label KEY[=VALUE]` (each must match) and `--owner PID|gone` (`agentenv.owner`'s label: the
    sandboxes a process owns, or those whose owner process is gone, which `agentenv gc` closes)."""
    from agentenv.owner import OWNER_LABEL, owner_alive

    wanted = [item.partition("=") for item in args.label or ()]
    owner = args.owner
    if owner is not None and owner != "gone" and not owner.isdigit():
        raise ConfigError(f"--owner expects a process id or `gone`, got {owner!r}")

    def keep(row: dict[str, Any]) -> bool:
        labels = row.get("labels") or {}
        if any(key not in labels or (sep and labels[key] != value) for key, sep, value in wanted):
            return False
        if owner is None:
            return True
        value = labels.get(OWNER_LABEL)
        if value is None:
            return False
        return not owner_alive(value) if owner == "gone" else value.split(":")[1:2] == [owner]

    return keep


def cmd_ls(args: argparse.Namespace) -> int:
    if args.server:
        rows = [s.describe() for s in _sandboxes(args).list(include_closed=args.all)]
    else:  # the registry alone: listing needs neither Docker nor the backend
        from agentenv.paths import agentenv_home
        from agentenv.registry import Registry

        rows = [r.describe() for r in Registry(agentenv_home().resolve()).list_sandboxes(args.all)
                if args.all or r.state != "spare"]  # spare shells: made ahead for forks (agentenv.spares)
    rows = [r for r in rows if _ls_filter(args)(r)]
    _emit(args, rows, lambda: _table(
        [[r["id"], r["state"], r["image"], r["user"], r["parent"] or "-"] for r in rows],
        ["ID", "STATE", "IMAGE", "USER", "PARENT"]))
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    cmd = args.cmd
    if not cmd:
        raise ConfigError("exec needs a command after the id, e.g. `agentenv exec ID -- ls -l`")
    stdin = sys.stdin.buffer.read() if args.stdin else None
    r = _sandboxes(args).get(args.id).exec(cmd, timeout=args.timeout, stdin=stdin,
                                  env=_kv_pairs(args.env, "--env") or None, workdir=args.workdir)
    if args.json:
        print(json.dumps(r.to_dict()))
    else:
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        if r.truncated:
            print(f"{PROG}: output truncated to the sandbox's output_limit_bytes", file=sys.stderr)
        if r.timed_out:
            print(f"{PROG}: command timed out; its process group was killed", file=sys.stderr)
        if r.oom_killed:
            print(f"{PROG}: the OOM killer fired; the sandbox is now broken", file=sys.stderr)
    return 124 if r.timed_out else (r.exit_code if 0 <= r.exit_code < 256 else 1)


def cmd_put(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read() if args.src == "-" else _read_local(args.src)
    _sandboxes(args).get(args.id).write_file(args.dest, data, mode=int(args.mode, 8))
    _emit(args, {"id": args.id, "path": args.dest, "bytes": len(data)}, lambda: None)
    return 0


def _read_local(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise AgentEnvError(f"cannot read local file {path}: {e.strerror}") from None


def cmd_get(args: argparse.Namespace) -> int:
    data = _sandboxes(args).get(args.id).read_file(args.src)
    if args.dest in (None, "-"):
        sys.stdout.buffer.write(data)
    else:
        try:
            Path(args.dest).write_bytes(data)
        except OSError as e:
            raise AgentEnvError(f"cannot write local file {args.dest}: {e.strerror}") from None
    return 0


def _each(args: argparse.Namespace, action: str) -> int:
    """Call method `action` of every id's sandbox; report each failure on its own line and go on."""
    results, failed = [], 0
    for sid in args.ids:
        try:
            sb = _sandboxes(args).get(sid)
            getattr(sb, action)()
            results.append({"id": sb.id, "state": sb.status})
        except AgentEnvError as e:
            failed += 1
            results.append({"id": sid, "error": str(e)})
            print(f"{PROG}: error: {e}", file=sys.stderr)
    _emit(args, results, lambda: [print(f"{r['id']} {r['state']}") for r in results if "state" in r])
    return 1 if failed else 0


def cmd_fork(args: argparse.Namespace) -> int:
    forks = _sandboxes(args).get(args.id).fork(args.n)
    data = [f.describe() for f in forks]
    _emit(args, data, lambda: [print(f.id) for f in forks])
    return 0


def cmd_move(args: argparse.Namespace) -> int:
    """A paused sandbox (of this machine, or of the `--server` host) to the host `--to`, resumed there."""
    sb = _sandboxes(args).get(args.id)
    moved = sb.move(args.to, timeout=args.timeout)
    data = {"id": moved.id, "state": moved.status, "host": moved.host.url}
    _emit(args, data, lambda: print(f"{data['id']} {data['state']} on {data['host']}"))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    stats = [_sandboxes(args).get(sid).stats().to_dict() for sid in args.ids]
    _emit(args, stats[0] if len(stats) == 1 else stats, lambda: _table(
        [[s["id"], s["state"], _mib(s["rss_bytes"]), f"{s['cpu_seconds']:.2f}", _mib(s["checkpoint_bytes"]),
          str(s["pids"])] for s in stats], ["ID", "STATE", "RSS", "CPU_S", "CHECKPOINT", "PIDS"]))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from agentenv.gc import collect_garbage

    report = collect_garbage(dry_run=args.dry_run).to_dict()
    _emit(args, report, lambda: [print(f"{k}: {', '.join(v) if v else '-'}") for k, v in report.items()])
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    """A settings file's values, checked as its loader checks them (`--file`: another file), or its JSON
    Schema (`--schema`)."""
    import dataclasses

    from agentenv.settings import settings_class, settings_schema

    cls = settings_class(args.name)
    if args.schema:
        print(json.dumps(settings_schema(cls), indent=2))
        return 0
    values = dataclasses.asdict(cls.load(args.file))
    _emit(args, values, lambda: [print(f"{k:26} {v}") for k, v in values.items()])
    return 0


def cmd_tasks_new(args: argparse.Namespace) -> int:
    """Write a new task's module, config and test from the template (`agentenv.scaffold`)."""
    from agentenv.scaffold import new_task

    written = new_task(args.name, args.dir, force=args.force)
    _emit(args, [str(p) for p in written], lambda: [print(p) for p in written])
    return 0


def cmd_tasks_check(args: argparse.Namespace) -> int:
    """gymnasium's env checker on a task (its config file or its env id), in sandboxes closed at the end."""
    import yaml

    from agentenv.tasks.check import check_task, config_target

    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # the task's module, from the working directory
    if args.target.endswith((".yaml", ".yml")):
        env_id, kwargs, action = config_target(args.target)
    else:
        env_id, kwargs, action = args.target, {}, None
    kwargs |= {k: yaml.safe_load(v) for k, v in _kv_pairs(args.set, "--set").items()}
    done = check_task(env_id, kwargs, seed=args.seed, action=args.action or action)
    _emit(args, {"env_id": env_id, "passed": True, "steps": done}, lambda: [print(line) for line in done])
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from agentenv.server.serve import serve

    return serve(host=args.host, port=args.port)


# ---- parser ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable output")
    common.add_argument("--server", metavar="URL", default=argparse.SUPPRESS,
                        help=f"act on the sandboxes of this `agentenv serve` host (default: ${SERVER_ENV}; "
                             "API key: $AGENTENV_API_KEY)")
    p = _Parser(prog=PROG, description="AgentENV sandboxes: create, exec, pause, resume, fork.",
                parents=[common])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[common])
        sp.set_defaults(fn=fn)
        return sp

    add("info", cmd_info, "show the backend, the Docker daemon and which user sandboxes run as")
    img = sub.add_parser("images", help="build or list sandbox images", parents=[common])
    img_sub = img.add_subparsers(dest="images_command", required=True, parser_class=_Parser)
    b = img_sub.add_parser("build", help="build an image (all when no NAME) unless its content hash is built",
                           parents=[common])
    b.add_argument("name", nargs="?")
    b.add_argument("--force", action="store_true", help="rebuild even when the tag exists")
    b.add_argument("--quiet", "-q", action="store_true", help="no build output")
    b.set_defaults(fn=_local_only(cmd_images_build, "images build"))
    img_sub.add_parser("ls", help="list image recipes and their tags", parents=[common]).set_defaults(
        fn=_local_only(cmd_images_ls, "images ls"))

    c = add("create", cmd_create, "create a running sandbox; prints its id")
    c.add_argument("--image", help="image name or Docker tag (default: config `image`)")
    c.add_argument("--memory", help="memory limit, e.g. 512m")
    c.add_argument("--cpus", type=float, help="CPU quota in cores")
    c.add_argument("--label", action="append", metavar="KEY=VALUE")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any config key (conf/sandbox/default.yaml), e.g. --set read_only=false")
    a = add("ls", cmd_ls, "list sandboxes")
    a.add_argument("--all", action="store_true", help="include closed sandboxes")
    a.add_argument("--label", action="append", metavar="KEY[=VALUE]",
                   help="only sandboxes with this label (and value); repeat to require several")
    a.add_argument("--owner", metavar="PID|gone",
                   help="only sandboxes owned by this process (a trainer's workers, a task check), or whose "
                        "owner is gone (what `agentenv gc` closes)")

    e = add("exec", cmd_exec, "run a command in a sandbox; exits with its exit code")
    e.add_argument("id")
    e.add_argument("--timeout", type=float, help="seconds (default: config exec_timeout_s)")
    e.add_argument("--workdir", "-w")
    e.add_argument("--env", "-e", action="append", metavar="KEY=VALUE")
    e.add_argument("--stdin", "-i", action="store_true", help="pass this process's stdin to the command")
    e.add_argument("cmd", nargs="*", help="-- COMMAND [ARG...] (everything after `--` is the command)")

    pu = add("put", cmd_put, "copy a local file (or - for stdin) into the sandbox work dir")
    pu.add_argument("id")
    pu.add_argument("src")
    pu.add_argument("dest")
    pu.add_argument("--mode", default="644", help="octal permissions (default 644)")
    g = add("get", cmd_get, "copy a file out of the sandbox work dir (to stdout by default)")
    g.add_argument("id")
    g.add_argument("src")
    g.add_argument("dest", nargs="?")

    for name, method, help in (("pause", "pause", "checkpoint sandboxes to disk (no memory, no CPU)"),
                               ("resume", "resume", "restore paused sandboxes"),
                               ("rm", "close", "remove sandboxes (container, files, checkpoints)")):
        sp = add(name, lambda args, m=method: _each(args, m), help)
        sp.add_argument("ids", nargs="+", metavar="ID")
    f = add("fork", cmd_fork, "restore a sandbox's checkpoint into N new sandboxes")
    f.add_argument("id")
    f.add_argument("-n", type=int, required=True, help="number of forks")
    mv = add("move", cmd_move, "move a paused sandbox to another `agentenv serve` host, which resumes it")
    mv.add_argument("id")
    mv.add_argument("--to", required=True, metavar="URL", help="the destination host's URL (its API key: "
                    "$AGENTENV_API_KEY)")
    mv.add_argument("--timeout", type=int, help="its time to live there in seconds (default: the host's)")
    s = add("stats", cmd_stats, "memory, CPU and checkpoint size")
    s.add_argument("ids", nargs="+", metavar="ID")
    tasks = sub.add_parser("tasks", help="write a new task from a template, or check one", parents=[common])
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True, parser_class=_Parser)
    tn = tasks_sub.add_parser("new", parents=[common], help="write NAME.py, conf/env/NAME.yaml and "
                              "test_NAME.py: a task that passes the checks and trains, to edit")
    tn.add_argument("name", help="the task's module name (lower case, e.g. word_hunt): env=NAME to train it")
    tn.add_argument("--dir", default=".", help="the folder to write into (default: the working directory)")
    tn.add_argument("--force", action="store_true", help="overwrite files that exist")
    tn.set_defaults(fn=_local_only(cmd_tasks_new, "tasks new"))
    tc = tasks_sub.add_parser("check", parents=[common], help="gymnasium's env checker on a task in real "
                              "sandboxes (all closed at the end), then one reset and step")
    tc.add_argument("target", help="a task config (conf/env/NAME.yaml: its id and kwargs) or an env id "
                    "(module:ns/Name-v0)")
    tc.add_argument("--set", action="append", metavar="KEY=VALUE", help="a task option (YAML value)")
    tc.add_argument("--seed", type=int, default=0, help="the seed of the extra reset (default 0)")
    tc.add_argument("--action", help="the action of the extra step (default: a sampled one)")
    tc.set_defaults(fn=_local_only(cmd_tasks_check, "tasks check"))
    gc = add("gc", _local_only(cmd_gc, "gc"),
             "reconcile the registry with Docker (remove orphans, close lost sandboxes)")
    gc.add_argument("--dry-run", action="store_true")
    st = add("settings", _local_only(cmd_settings, "settings"),
             "check a settings file and show its values, or print its JSON Schema")
    st.add_argument("name", help="sandbox, backend, pool, server or remote")
    st.add_argument("--file", type=Path, help="check this file instead of the one in use")
    st.add_argument("--schema", action="store_true", help="print the file's JSON Schema")
    sv = add("serve", _local_only(cmd_serve, "serve"),
             "serve sandboxes over E2B's API (control plane + envd) for the E2B SDKs")
    sv.add_argument("--host", help="listen address (default: conf/agentenv/server.yaml, 127.0.0.1)")
    sv.add_argument("--port", type=int, help="listen port (default: conf/agentenv/server.yaml, 3000)")
    return p


def _docker_errors() -> tuple[type[BaseException], ...]:
    """The Docker SDK's error class when a verb loaded the SDK (only then can it raise one), else none."""
    docker = sys.modules.get("docker")
    return (docker.errors.DockerException,) if docker is not None else ()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `exec ID [options] -- CMD...`: everything after the first `--` is the command, never options.
    command: list[str] | None = None
    if "exec" in argv and "--" in argv[argv.index("exec"):]:
        cut = argv.index("--", argv.index("exec"))
        argv, command = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if command is not None:
        args.cmd = [*args.cmd, *command]
    args.json = getattr(args, "json", False)
    args.server = getattr(args, "server", None) or os.environ.get(SERVER_ENV) or None
    try:
        return int(args.fn(args) or 0)
    except AgentEnvError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except _docker_errors() as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{PROG}: error: Docker: {first}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
