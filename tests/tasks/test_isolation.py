"""Episode isolation (issue 26, item 3), for every shipped task (conf/env/*.yaml): episode k plants a file
and a background process (and, through the shell session, an environment variable); episode k+1, reset in
the same env, sees none of them and starts from the same first observation.

A task that restores its template (the default) is planted into through its action channel *and* from
outside, by commands in its own session; a task that declares ``in_place_reset`` is planted into through
its action channel, the only way an episode reaches its sandbox (for an agent program: the command it
hands the policy's text, `PROGRAM_CHANNELS`), and the check that nothing landed even in episode k is what
its declaration claims. An environment variable cannot outlive its command: each
command of a task's session is its own ``sh -c`` (checked in episode k), so what could carry an
environment change to the next episode is a file, and files are checked. The tasks' sandboxes are
members of one pool without warm starts, as the trainer's (conf/rollout/torch.yaml): a restore is a new
sandbox and ``install()``, the cheaper path for these tasks (bench/reset_cost.py)."""

from __future__ import annotations

import shlex
import uuid
from pathlib import Path

import gymnasium
import pytest
import yaml

import agentenv.tasks  # noqa: F401  (registers the built-in tasks)
from agentenv.factory import PooledSandboxes
from agentenv.pool import SandboxPool

pytestmark = pytest.mark.docker
CONF = Path(__file__).resolve().parents[2] / "conf" / "env"
SHIPPED = sorted(p.stem for p in CONF.glob("*.yaml"))
SMALLER = {"kv_lookup": {"data_mib": 1}}  # the isolation does not depend on the size of the table
# the agent's best try: files in the work dir and in /tmp, a detached process, a variable of its shell
PLANT = "touch /workspace/planted /tmp/planted; setsid sleep 3600 >/dev/null 2>&1 & export PLANTED=1"
# A program task that reuses its sandbox: the one command through which its program hands the sandbox
# text the policy wrote (the example's program hands play.sh a guess; here the whole plant instead).
PROGRAM_CHANNELS = {"agent_guess_number": "/workspace/play.sh {}"}
LOOK = ("ls /workspace/planted /tmp/planted /workspace/planted-outside 2>/dev/null; "
        "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -o 'sleep 360[01]'; "
        "echo \"var=${PLANTED:-}${OUTSIDE:-}\"")


@pytest.fixture(scope="module")
def pool(sandbox_config):
    from agentenv import SandboxConfig

    pool = SandboxPool(f"isolation-{uuid.uuid4().hex[:6]}", config=SandboxConfig.from_dict(sandbox_config),
                       warm_starts=False)
    yield pool
    pool.close()


def seen(env) -> str:
    """What of the plants the sandbox holds now (files, processes, variables of the session's shell)."""
    return env.run(LOOK).output.strip()


@pytest.mark.parametrize("name", SHIPPED)
def test_an_episode_sees_nothing_an_earlier_episode_left(name, pool, sandbox_config):
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    kwargs = {**cfg["kwargs"], **SMALLER.get(name, {}), "sandbox": {"config": sandbox_config}}
    env = gymnasium.make(cfg["id"], sandboxes=PooledSandboxes(pool), **kwargs).unwrapped
    try:
        first, _ = env.reset(seed=7)
        if getattr(env, "runs_program", False) and env.in_place_reset:
            channel = PROGRAM_CHANNELS.get(name)
            assert channel, f"{name} reuses its sandbox: name the command its program hands the policy's text"
            env.run(channel.format(shlex.quote(PLANT)))  # the policy's worst text, where its program puts it
        elif getattr(env, "runs_program", False):  # its agent program may run any command in the sandbox
            env.run(PLANT)
        else:
            env.step(PLANT)
        if env.sandbox is None:  # no sandbox (ReasoningGym): nothing outlives the episode but the env
            assert env.in_place_reset and env.reset(seed=7)[0] == first and env.turn == 0
            with pytest.raises(RuntimeError, match="no sandbox"):
                env.run("true")
            return
        env.hold_sandbox()
        if env.in_place_reset:
            assert seen(env) == "var=", "the action channel planted something"
        else:
            env.run("touch /workspace/planted-outside; (setsid sleep 3601 >/dev/null 2>&1 &); "
                    "export OUTSIDE=1")
            planted = seen(env)
            assert "/workspace/planted-outside" in planted and "sleep 3601" in planted, planted
            # each command of the session is its own `sh -c`: a variable dies with it, even in episode k
            assert planted.endswith("var="), planted
            assert "/workspace/planted\n" in planted and "sleep 3600" in planted, planted  # the agent's too
        old = env.sandbox.id
        again, _ = env.reset(seed=7)
        assert again == first and seen(env) == "var="
        assert (env.sandbox.id == old) == bool(env.in_place_reset)  # restored: a new sandbox
    finally:
        env.close()
