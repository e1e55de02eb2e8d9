"""The same cases against every kind of sandbox handle (`agentenv.api.SandboxHandle`): a local `Sandbox`, a
`SandboxPool` member and a `RemoteSandbox` of `agentenv serve` on loopback. Each case expects the same
results and the same exception types (exactly) on all three; one sandbox per kind for the whole module.
First, without Docker: every handle, session and factory class has the Protocols' members with the same
parameters."""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from agentenv_testutil import SMALL
from netns_hosts import loopback_server

from agentenv import Sandbox, SandboxConfig
from agentenv.api import SandboxFactory, SandboxHandle, ShellSession
from agentenv.errors import (
    ExecTimeout,
    FileNotFoundInSandbox,
    InvalidArgument,
    PathOutsideWorkspace,
    SandboxStateError,
    SessionError,
)
from agentenv.factory import LocalSandboxes, PooledSandboxes, RemoteSandboxes
from agentenv.pool import PooledSandbox, PooledSession, SandboxPool
from agentenv.remote import RemoteSandbox, RemoteSession, SandboxHost
from agentenv.session import Session

KINDS = ("local", "pooled", "remote")
LABELS = {"suite": "conformance"}


# ---- the Protocols, checked on the classes -----------------------------------------------------------
def _members(protocol: type) -> dict[str, Any]:
    skip = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__", "__protocol_attrs__",
            "__non_callable_proto_members__", "__annotations__", "__parameters__", "__abstractmethods__"}
    return {name: value for name, value in vars(protocol).items()
            if name not in skip and not (name.startswith("_") and not name.startswith("__"))
            and (callable(value) or isinstance(value, property))}


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol, classes", [
    (SandboxHandle, (Sandbox, PooledSandbox, RemoteSandbox)),
    (ShellSession, (Session, PooledSession, RemoteSession)),
    (SandboxFactory, (LocalSandboxes, PooledSandboxes, RemoteSandboxes)),
], ids=["handle", "session", "factory"])
def test_classes_implement_the_protocols_with_the_same_parameters(protocol, classes):
    members = _members(protocol)
    assert members, protocol
    for cls in classes:
        for name, spec in members.items():
            impl = getattr(cls, name, None)
            assert impl is not None, f"{cls.__name__} lacks {name}"
            if isinstance(spec, property):
                assert isinstance(impl, property), f"{cls.__name__}.{name} must be a property"
            else:
                assert _params(impl) == _params(spec), f"{cls.__name__}.{name}{inspect.signature(impl)}"


# ---- one sandbox of each kind --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_profile(base_image) -> SandboxConfig:
    return SandboxConfig.load(**SMALL)


@pytest.fixture(scope="module")
def remote_host(small_profile, tmp_path_factory) -> Iterator[SandboxHost]:
    """`agentenv serve` on loopback whose sandboxes have the small test profile."""
    folder = tmp_path_factory.mktemp("conformance-serve")
    profile = folder / "sandbox.yaml"
    profile.write_text(yaml.safe_dump(small_profile.to_dict()))
    with loopback_server(folder / "home", {"AGENTENV_CONFIG": str(profile)}) as server:
        host = SandboxHost(server.url, server.api_key)
        yield host
        host.close()


@pytest.fixture(scope="module")
def pool(small_profile) -> Iterator[SandboxPool]:
    p = SandboxPool(f"conformance-{uuid.uuid4().hex[:6]}", config=small_profile, warm_starts=False)
    yield p
    p.close()


@pytest.fixture(scope="module", params=KINDS)
def handle(request, small_profile) -> Iterator[SandboxHandle]:
    if request.param == "local":
        sb: SandboxHandle = Sandbox.create(config=small_profile, labels=LABELS)
    elif request.param == "pooled":
        sb = request.getfixturevalue("pool").create(labels=LABELS)
    else:
        sb = request.getfixturevalue("remote_host").create(image="base", labels=LABELS)
    yield sb
    sb.close()


def _session_run(sb: SandboxHandle, *args: Any, **kwargs: Any) -> Any:
    with sb.session() as s:
        return s.run(*args, **kwargs)


def _raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as e:
        return e
    raise AssertionError("no error raised")


# ---- the cases -----------------------------------------------------------------------------------------
def test_the_handle_and_its_session_satisfy_the_protocols(handle):
    assert isinstance(handle, SandboxHandle)
    with handle.session() as session:
        assert isinstance(session, ShellSession)
    assert handle.status == "running" and handle.reason is None
    assert handle.labels["suite"] == "conformance" and handle.user in ("agent", "root")
    assert handle.config.memory == SMALL["memory"]
    d, st = handle.describe(), handle.stats()
    assert d["id"] == st.id == handle.id and d["state"] == st.state == "running" and st.rss_bytes > 0


def test_exec_results(handle):
    r = handle.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (3, "out\n", "err\n", False, False)
    assert handle.exec(["printf", "%s|", "a b", "$HOME", "it's"]).stdout == "a b|$HOME|it's|"
    r = handle.exec(["sh", "-c", 'printf "%s|%s|" "$A" "$(pwd)"; cat'], stdin="in put", env={"A": "b c"},
                    workdir="/tmp")
    assert (r.exit_code, r.stdout) == (0, "b c|/tmp|in put")
    assert handle.exec("pwd").stdout == "/workspace\n"


def test_a_timeout_kills_the_command(handle):
    started = time.monotonic()
    r = handle.exec("sleep 30", timeout=1)
    assert (r.timed_out, r.exit_code) == (True, 124) and time.monotonic() - started < 10
    e = _raised(lambda: handle.exec("sleep 30", timeout=0.5, raise_on_timeout=True))
    assert type(e) is ExecTimeout and e.result.exit_code == 124


@pytest.mark.parametrize("call, names", [
    (lambda sb: sb.exec(""), "cmd"),
    (lambda sb: sb.exec([]), "cmd"),
    (lambda sb: sb.exec("echo a\0b"), "cmd"),
    (lambda sb: sb.exec("true", timeout=True), "timeout"),
    (lambda sb: sb.exec("true", timeout=0), "timeout"),
    (lambda sb: sb.exec("true", timeout=-1), "timeout"),
    (lambda sb: sb.exec("true", env={"A": 1}), "env"),
    (lambda sb: sb.exec("true", env={"A=B": "x"}), "env"),
    (lambda sb: sb.exec("true", workdir="relative"), "workdir"),
    (lambda sb: sb.exec("cat", stdin=3), "stdin"),
    (lambda sb: sb.fork(0), "fork count"),
    (lambda sb: sb.fork(65), "fork count"),
    (lambda sb: sb.fork(True), "fork count"),
    (lambda sb: sb.fork(1.5), "fork count"),
    (lambda sb: sb.fork(1, labels={"": "x"}), "labels"),
    (lambda sb: sb.fork(1, labels={"k": None}), "labels"),
    (lambda sb: sb.write_file("a.txt", 3), "data"),
    (lambda sb: sb.write_file("a.txt", "x", mode=True), "mode"),
    (lambda sb: _session_run(sb, ""), "cmd"),
    (lambda sb: _session_run(sb, "true", timeout=0), "timeout"),
    (lambda sb: _session_run(sb, "cat", stdin=["no"]), "stdin"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_are_refused_alike(handle, call, names):
    e = _raised(lambda: call(handle))
    assert type(e) is InvalidArgument and names in str(e), repr(e)


@pytest.mark.parametrize("call", [
    lambda sb: sb.write_file("../etc/x", "no"),
    lambda sb: sb.write_file("/etc/x", "no"),
    lambda sb: sb.read_file("a/../../etc/shadow"),
    lambda sb: sb.read_file(""),
])
def test_paths_outside_the_work_dir_are_refused_alike(handle, call):
    e = _raised(lambda: call(handle))
    assert type(e) is PathOutsideWorkspace and isinstance(e, InvalidArgument), repr(e)


def test_files(handle):
    data = bytes(range(256)) * 3
    handle.write_file("dir/blob.bin", data)
    assert handle.read_file("/workspace/dir/blob.bin") == data
    handle.write_file("dir/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert handle.exec("./dir/run.sh").stdout == "ran\n"
    e = _raised(lambda: handle.read_file("missing.txt"))
    assert type(e) is FileNotFoundInSandbox and isinstance(e, FileNotFoundError) and "missing.txt" in str(e)
    handle.exec("ln -sf /etc/hostname /workspace/host-link")
    e = _raised(lambda: handle.read_file("host-link"))
    assert type(e) is PathOutsideWorkspace and "resolves to /etc" in str(e)


def test_session_runs_like_exec(handle):
    with handle.session() as s:
        assert s.run("echo $((6 * 7))").stdout == "42\n"
        assert s.run(["printf", "%s", "a b"]).stdout == "a b"
        assert s.run("cat", stdin="in").stdout == "in"
        assert s.run("cd /tmp; x=1").exit_code == 0 and s.run("pwd; echo ${x:-unset}").stdout == \
            "/workspace\nunset\n"  # nothing carries over between commands
        r = s.run("echo before; sleep 30", timeout=1)
        assert (r.timed_out, r.exit_code, r.stdout) == (True, 124, "before\n")
        assert s.run("echo after").stdout == "after\n"
    assert s.closed
    assert type(_raised(lambda: s.run("true"))) is SessionError


def test_state_errors(handle):
    handle.pause()
    try:
        assert handle.status == "paused"
        for call in (handle.pause, lambda: handle.exec("true"), lambda: handle.read_file("dir/blob.bin"),
                     lambda: handle.write_file("x", "y")):
            e = _raised(call)
            assert type(e) is SandboxStateError and "paused" in str(e), repr(e)
    finally:
        handle.resume()
    assert handle.status == "running"
    e = _raised(handle.resume)
    assert type(e) is SandboxStateError and "already running" in str(e)
    assert handle.exec("echo back").stdout == "back\n"


def test_fork_with_labels_and_close_twice(handle):
    handle.write_file("who", "parent")
    forks = handle.fork(1, labels={"role": "fork"})
    assert len(forks) == 1 and type(forks[0]) is type(handle)
    fork = forks[0]
    try:
        assert isinstance(fork, SandboxHandle) and fork.id != handle.id
        assert fork.status == handle.status == "running" and fork.parent_id == handle.id
        assert fork.labels["role"] == "fork" and "role" not in handle.labels
        assert fork.read_file("who") == b"parent"
        fork.write_file("who", "fork")
        assert handle.read_file("who") == b"parent"
    finally:
        fork.close()
    fork.close()  # idempotent
    assert fork.status == "closed"
    for call in (lambda: fork.exec("true"), lambda: fork.read_file("who"), fork.pause):
        e = _raised(call)
        assert type(e) is SandboxStateError and "closed" in str(e), repr(e)
