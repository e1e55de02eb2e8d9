"""The E2B compatibility table of docs/agentenv.md is what `scripts/e2b_compat.py` renders from the last
recorded run of tests/server/test_server_e2b.py: one row per public method of the installed SDK, a `yes`
only where a passing test called that method, `untested` where none did; and a recorded run that does not
fit the installed SDK is refused, naming what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib.metadata import version

import e2b
import pytest

from scripts.e2b_compat import (
    RECORD_ENV,
    RUN_FILE,
    Run,
    check,
    load_run,
    save_run,
    sdk_methods,
    status,
    table,
)

NODE = "tests/server/test_server_e2b.py::"


def test_the_committed_table_is_what_the_recorded_run_renders():
    run = load_run()
    diff = check(run)
    assert not diff, (f"docs/agentenv.md's E2B table is not what {RUN_FILE.name} renders; record a run "
                      f"({RECORD_ENV}=1, see scripts/e2b_compat.py) and run the script:\n{diff}")
    fewer = replace(run, tests=dict(list(run.tests.items())[1:]))  # a run without one of its tests
    assert check(fewer), "a different recorded run renders the same table"


def test_rows_are_the_public_methods_of_the_installed_sdk():
    rows = sdk_methods()
    of_sandbox = {f"Sandbox.{name}" for name in dir(e2b.Sandbox)
                  if not name.startswith("_") and not isinstance(getattr(e2b.Sandbox, name, None), property)
                  and callable(getattr(e2b.Sandbox, name))}
    assert of_sandbox <= set(rows) and "Sandbox.get_host" in rows and "Sandbox.sandbox_id" not in rows
    handles = {"Filesystem.write_files", "Commands.kill", "Pty.resize", "CommandHandle.wait",
               "WatchHandle.get_new_events", "SandboxPaginator.next_items", "Git.clone"}
    assert handles <= set(rows)
    assert rows["Sandbox.beta_pause"] == {"sync": "sync Sandbox.beta_pause",
                                          "async": "async Sandbox.beta_pause"}
    assert rows["CommandInputHandle.send"] == {"async": "async CommandInputHandle.send"}  # async only


def _run(**tests: tuple[str, set[str]]) -> Run:
    return Run(version("e2b"), {NODE + name: (outcome, frozenset(calls)) for name, (outcome, calls) in
                                tests.items()})


def test_a_method_no_test_calls_is_untested():
    run = _run(test_nothing=("passed", set()))
    assert status("Sandbox.get_host", "sync Sandbox.get_host", run) == "untested"
    body = [line for line in table(run).splitlines() if line.startswith("| `")]
    assert len(body) == len(sdk_methods())
    for line in body:
        sync, async_ = line.split(" | ")[2:4]
        assert {sync, async_} <= {"untested", "—"}, line


def test_the_status_follows_the_outcomes_of_the_callers():
    run = _run(test_a=("passed", {"sync Sandbox.kill", "sync Sandbox.update_network"}),
               test_b=("failed", {"sync Sandbox.kill", "sync Sandbox.pause"}),
               test_c=("skipped", {"sync Filesystem.read"}),
               test_d=("passed", {"sync Sandbox.kill"}), test_e=("passed", {"sync Sandbox.kill"}),
               test_f=("passed", {"sync Sandbox.kill"}))
    assert status("Sandbox.kill", "sync Sandbox.kill", run) == "yes (test_a, test_d, test_e and 1 more)"
    assert status("Sandbox.pause", "sync Sandbox.pause", run) == "fails (test_b)"
    assert status("Filesystem.read", "sync Filesystem.read", run) == "untested"  # only a skipped caller
    assert status("Sandbox.update_network", "sync Sandbox.update_network", run) == "refused (test_a)"
    assert status("Sandbox.kill", "async Sandbox.kill", run) == "untested"  # the other flavour
    assert status("CommandInputHandle.send", None, run) == "—"


def test_a_run_that_does_not_fit_the_installed_sdk_is_refused(tmp_path):
    path = tmp_path / "run.json"
    with pytest.raises(SystemExit, match="does not exist: record a run"):
        load_run(path)
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="is not a recorded run"):
        load_run(path)
    save_run(_run(test_a=("passed", {"sync Sandbox.kill"})), path)
    assert load_run(path) == _run(test_a=("passed", {"sync Sandbox.kill"}))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "e2b": "0.0.1"}))
    with pytest.raises(SystemExit, match=f"recorded against e2b 0.0.1, e2b {version('e2b')} is installed"):
        load_run(path)
    data["tests"][NODE + "test_a"]["calls"].append("sync Sandbox.teleport")
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="calls the installed SDK lacks: sync Sandbox.teleport"):
        load_run(path)
