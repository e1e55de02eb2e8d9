"""Fixtures for `agentenv serve` tests: a real Docker daemon and base image, a private $AGENTENV_HOME, and
the server itself started as `agentenv serve` in a subprocess on a free loopback port, with the
unmodified `e2b` SDK pointed at it through E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY.

With E2B_COMPAT_RECORD=1 in the environment, the run records which public SDK methods each test of this
directory calls itself (in its setup and body; fixture teardown is cleanup and does not count) and how
the test ended, into the file `scripts/e2b_compat.py` renders the compatibility table from."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from netns_hosts import Server, loopback_server

from scripts.e2b_compat import RECORD_ENV, RUN_FILE, Run, recording, save_run


class CallRecorder:
    """Per test node id: the recorded keys of the SDK methods it called, and its outcome."""

    def __init__(self) -> None:
        self.node: str | None = None
        self.calls: dict[str, set[str]] = {}
        self.outcomes: dict[str, str] = {}
        self.saved = False

    def start(self, node: str | None) -> None:
        self.node = node
        if node is not None:
            self.calls.setdefault(node, set())

    def call(self, key: str) -> None:
        if self.node is not None:
            self.calls[self.node].add(key)

    def report(self, report: pytest.TestReport) -> None:
        """Fold one phase's report into its test's outcome: failed if any phase failed, else skipped if
        one was skipped, else passed once its body passed."""
        if report.nodeid not in self.calls or self.outcomes.get(report.nodeid) == "failed":
            return
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped:
            self.outcomes[report.nodeid] = "skipped"
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, "passed")

    def run(self) -> Run:
        from importlib.metadata import version
        return Run(version("e2b"), {node: (self.outcomes.get(node, "failed"), frozenset(calls))
                                    for node, calls in self.calls.items()})


_recorder: CallRecorder | None = None
_unwrap = contextlib.ExitStack()


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    if os.environ.get(RECORD_ENV, "0") in ("", "0"):
        return
    if os.environ.get("PYTEST_XDIST_WORKER") or config.getoption("numprocesses", None):
        raise pytest.UsageError(f"{RECORD_ENV}=1 records in one process: run pytest without -n")
    _recorder = CallRecorder()
    _unwrap.enter_context(recording(_recorder.call))


def pytest_unconfigure(config: pytest.Config) -> None:
    _unwrap.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _recorder is not None:
        _recorder.start(item.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _recorder is not None:
        _recorder.start(None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _recorder is not None:
        _recorder.report(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _recorder is not None and _recorder.calls and exitstatus in (0, 1):  # not an interrupted run
        save_run(_recorder.run())
        _recorder.saved = True


def pytest_terminal_summary(terminalreporter) -> None:
    if _recorder is not None and _recorder.saved:
        terminalreporter.write_line(f"{RECORD_ENV}: the SDK calls of {len(_recorder.calls)} tests are in "
                                    f"{RUN_FILE}; `python scripts/e2b_compat.py` renders the table")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """`agentenv serve` on a free port with a private home (`netns_hosts.loopback_server`), with the
    E2B SDK's environment pointed at it; its sandboxes are removed at the end."""
    with loopback_server(tmp_path_factory.mktemp("agentenv-serve-home")) as srv:
        old = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.api_key)
        os.environ.pop("E2B_DOMAIN", None)
        try:
            yield srv
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture
def sdk_sandbox(server) -> Iterator:
    """Factory of SDK sandboxes (`e2b.Sandbox.create` keyword arguments), killed after the test."""
    from e2b import Sandbox

    made = []

    def make(template: str = "base", **kw):
        sb = Sandbox.create(template, **kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        try:
            sb.kill()
        except Exception:
            pass
