"""A session answers every command line, whatever its bytes, with its output and exit code (or a clear
refusal), and keeps serving afterwards: every control byte, random byte strings (decoded as a byte-level
policy's are), and commands that end the session's own shell (the shell's result, then a new shell)."""

from __future__ import annotations

import shlex
import time

import pytest
from agentenv_testutil import SMALL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv import Sandbox, SandboxConfig
from agentenv.errors import InvalidArgument

pytestmark = pytest.mark.docker

CONTROL_BYTES = [*range(0x00, 0x20), 0x7F]
# A byte-level policy samples any byte: its text is the UTF-8 decoding with replacement (rl/tokenizer.py).
RANDOM_COMMANDS = st.binary(min_size=1, max_size=200).map(lambda b: b.decode("utf-8", "replace"))


@pytest.fixture(scope="module")
def served(base_image):
    """One sandbox and one session for the module, with a file written before the fuzz."""
    sb = Sandbox.create(config=SandboxConfig.load(**SMALL))
    s = sb.session()
    s.run("echo kept > /workspace/state")
    yield sb, s
    s.close()
    sb.close()


def _still_serving(s, opens: int) -> None:
    """The same shell answers, and what earlier commands made is still there."""
    r = s.run("echo ok; cat /workspace/state")
    assert (r.exit_code, r.stdout) == (0, "ok\nkept\n")
    assert s.opens == opens and not s.reopened


def _agent_line(cmd: str) -> str:
    """How a task runs an agent's command line (SandboxTask.run_agent_command, SandboxTask.run)."""
    return f"( cd /workspace && timeout 5 sh -c {shlex.quote(cmd)} ) 2>&1"


def test_every_control_byte_is_run_or_refused_and_the_shell_serves_on(served):
    _sb, s = served
    opens = s.opens
    for b in CONTROL_BYTES:
        c = chr(b)
        if b == 0:
            for cmd in (f"echo a{c}b", ["printf", f"{c}"]):
                with pytest.raises(InvalidArgument, match="NUL"):
                    s.run(cmd)
        else:
            r = s.run(["printf", "%s", f"a{c}b"])
            assert (r.exit_code, r.stdout.encode()) == (0, b"a" + bytes([b]) + b"b"), hex(b)
            r = s.run(f"printf '%s' '{c}'; echo \"[{c}]\" >&2")
            assert (r.exit_code, r.stdout, r.stderr) == (0, c, f"[{c}]\n"), hex(b)
            r = s.run(_agent_line(c))  # the byte alone as a command line
            assert r.exit_code in (0, 127) and not r.timed_out, (hex(b), r)
            r = s.run("cat", stdin=bytes([b]) * 3 + b"\n")
            assert r.stdout.encode() == bytes([b]) * 3 + b"\n", hex(b)
        _still_serving(s, opens)
    # a line of bytes that only look blank to Python (\r, \v, \f, \x1c-\x1f) is a command to sh, not empty
    assert s.run("\x1c").exit_code == 127 and s.run("\r").exit_code == 127
    with pytest.raises(InvalidArgument, match="empty command"):
        s.run(" \t\n")
    with pytest.raises(InvalidArgument, match="lone surrogate"):
        s.run("echo \udc80")
    with pytest.raises(InvalidArgument, match="stdin is not valid Unicode"):
        s.run("cat", stdin="\ud800")
    _still_serving(s, opens)


@settings(max_examples=100, deadline=10_000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cmd=RANDOM_COMMANDS)
def test_random_byte_commands_get_an_answer_and_the_shell_serves_on(served, cmd):
    _sb, s = served
    opens = s.opens
    if "\0" in cmd:  # no argv string can hold a NUL: refused, the shell untouched
        with pytest.raises(InvalidArgument, match="cmd must not contain NUL bytes"):
            s.run(_agent_line(cmd))
    else:
        r = s.run(_agent_line(cmd), timeout=15)
        assert 0 <= r.exit_code <= 255 and not r.timed_out
        assert s.run(["printf", "%s", cmd]).stdout == cmd  # the same bytes arrive intact as an argument
    _still_serving(s, opens)


@pytest.mark.parametrize("cmd, code", [
    ("kill -9 -1", 137),                               # kills every process of the user: the shell too
    ("kill -9 $(pgrep -f agentenv-session)", 137),
    ("sleep 0.2; kill -TERM -1", 143),
])
def test_a_command_that_ends_the_shell_gets_the_shells_result_and_the_session_goes_on(sandbox, cmd, code):
    with sandbox.session() as s:
        s.run("echo kept > /workspace/state")
        t0 = time.monotonic()
        r = s.run(f"echo before; {cmd}")
        assert (r.exit_code, r.stdout, r.timed_out) == (code, "before\n", False)
        assert not r.oom_killed and time.monotonic() - t0 < 10
        assert sandbox.status == "running"
        after = s.run("echo ok; cat /workspace/state")
        assert (after.exit_code, after.stdout, s.reopened, s.opens) == (0, "ok\nkept\n", True, 2)
