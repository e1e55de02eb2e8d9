"""The file-transfer script protocol (`agentenv.files`): each exit code is one typed error, the codes and the
prologue live in that module alone, and in a real sandbox the scripts exit with them, so that
`Sandbox.read_file` and the server's filesystem calls (`agentenv.server.fsops`) raise the same errors."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from agentenv import files
from agentenv.errors import (
    AgentEnvError,
    FileExistsInSandbox,
    FileNotFoundInSandbox,
    InvalidArgument,
    NotADirectoryInSandbox,
    PathOutsideWorkspace,
)

ROOT = Path(__file__).resolve().parents[2]
CODES = {files.EXIT_REFUSED: PathOutsideWorkspace, files.EXIT_TOO_BIG: InvalidArgument,
         files.EXIT_MISSING: FileNotFoundInSandbox, files.EXIT_EXISTS: FileExistsInSandbox,
         files.EXIT_NOT_DIR: NotADirectoryInSandbox}


def error(code: int, stderr: str = "", timed_out: bool = False) -> AgentEnvError | None:
    return files.file_error(code, stderr, what="read 'a.txt'", path="/workspace/a.txt", sandbox_id="sb1",
                            limit=10, timed_out=timed_out)


def test_each_exit_code_is_its_own_typed_error():
    assert len(CODES) == 5  # five distinct codes
    for code, kind in CODES.items():
        got = error(code, "why it failed")
        assert type(got) is kind, (code, got)
        assert str(got).startswith("read 'a.txt'"), got
    assert "refused: why it failed" in str(error(files.EXIT_REFUSED, "why it failed\n"))
    assert "bigger than file_limit_bytes=10" in str(error(files.EXIT_TOO_BIG))
    assert error(0) is None
    other = error(2, "/workspace/a.txt is not a regular file\n")
    assert type(other) is AgentEnvError
    assert str(other) == "could not read 'a.txt' in sandbox sb1: /workspace/a.txt is not a regular file"
    slow = "could not read 'a.txt' in sandbox sb1: it took longer than the sandbox's exec_timeout_s"
    assert str(error(137, timed_out=True)) == slow + ", which bounds file calls too"
    assert str(error(137)) == "could not read 'a.txt' in sandbox sb1: exit 137"  # killed, not by its timeout
    assert type(error(0, timed_out=True)) is AgentEnvError  # a timed-out script never succeeded


def test_the_exit_codes_are_defined_in_the_protocol_module_alone():
    """No other module of agentenv names its own file-script exit code (they were spread over three)."""
    name = re.compile(r"_?EXIT_(REFUSED|TOO_BIG|MISSING|EXISTS|NOT_DIR)$")
    defined = []
    for path in sorted((ROOT / "agentenv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            defined += [f"{path.relative_to(ROOT)}:{t.id}" for t in targets
                        if isinstance(t, ast.Name) and name.match(t.id)]
    assert defined == [f"agentenv/files.py:EXIT_{n}" for n in ("REFUSED", "TOO_BIG", "MISSING", "EXISTS",
                                                               "NOT_DIR")]


@pytest.mark.docker
def test_the_scripts_exit_with_the_protocol_codes_in_a_sandbox(sandbox):
    from agentenv.server import fsops

    sandbox.exec("printf 0123456789A > /workspace/eleven && ln -s /etc/hostname /workspace/out && "
                 "mkdir /workspace/dir")

    def run(script: str, path: str) -> int:
        return sandbox.exec(["sh", "-c", script, "sh", path]).exit_code

    read = files.read_script("/workspace", 10)
    assert run(read, "/workspace/eleven") == files.EXIT_TOO_BIG
    assert run(files.read_script("/workspace", 11), "/workspace/eleven") == 0
    assert run(read, "/workspace/none") == files.EXIT_MISSING
    assert run(read, "/workspace/out") == files.EXIT_REFUSED
    assert run(files.confine("/workspace"), "/workspace") == files.EXIT_REFUSED
    assert run(files.confine("/workspace", workdir_too=True) + 'test "$p" = /workspace', "/workspace") == 0
    assert run(files.confine("/workspace", workdir_too=True), "/workspace/../etc") == files.EXIT_REFUSED

    # the two callers of the protocol see the same errors for the same outcomes
    for path, kind in (("none", FileNotFoundInSandbox), ("out", PathOutsideWorkspace)):
        with pytest.raises(kind):
            sandbox.read_file(path)
        with pytest.raises(kind):
            fsops.stat(sandbox, path)
    with pytest.raises(FileExistsInSandbox, match="exists already"):
        fsops.make_dir(sandbox, "dir")
    with pytest.raises(NotADirectoryInSandbox, match="is not a directory"):
        fsops.list_dir(sandbox, "eleven", 1)
