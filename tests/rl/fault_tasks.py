"""Tasks that misbehave on purpose, for the fault-handling tests (registered as ``faults/<Name>-v0``)."""

from __future__ import annotations

import gymnasium

from agentenv.backend import docker_client
from agentenv.tasks.base import Outcome
from agentenv.tasks.guess_number import GuessNumber
from agentenv.tasks.reasoning_gym_task import ReasoningGym


class RaisesOnOddSeeds(GuessNumber):
    """GuessNumber whose step raises for odd seeds (a bug in a user's task)."""

    def act(self, action: str) -> Outcome:
        if self.episode_seed % 2:
            raise ValueError("task bug on purpose")
        return super().act(action)


class KillsItsSandbox(GuessNumber):
    """GuessNumber whose sandbox container is killed from outside during the first step."""

    def act(self, action: str) -> Outcome:
        sandbox = getattr(self.sandbox, "sandbox", self.sandbox)  # a pool member wraps its Sandbox
        docker_client.api().kill(sandbox.container_id)
        return super().act(action)


class HangsOnOddSeeds(GuessNumber):
    """GuessNumber whose step, for odd seeds, runs a command past the platform's command timeout (a hung
    sandbox: an infrastructure failure); for even seeds a command ends by its own ``timeout`` (exit 124,
    an ordinary result that is part of the game)."""

    def act(self, action: str) -> Outcome:
        if self.episode_seed % 2:
            self.run("sleep 30", timeout=1.0)
        elif self.run("timeout 0.2 sleep 30", timeout=10.0).exit_code != 124:
            raise RuntimeError("the command's own timeout did not end it")
        return super().act(action)


class NoSandboxOnOddSeeds(GuessNumber):
    """GuessNumber whose reset, for odd seeds, fails before it has a sandbox (a create that failed)."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        if seed is not None and seed % 2 and self.sandbox is None:
            raise RuntimeError("no sandbox on purpose")
        return super().reset(seed=seed, options=options)


class CloseFails(ReasoningGym):
    """A task (no sandbox) whose ``close`` raises, as a sandbox that cannot be removed would; it takes
    (and ignores) GuessNumber's kwargs, so that the same env config makes it."""

    def __init__(self, num_values: int = 6, invalid_penalty: float = 0.0, ruled_out_penalty: float = 0.0,
                 **kwargs) -> None:
        super().__init__(**kwargs)

    def setup(self, seed: int) -> str:
        return "say 0"  # short: the policy's generation is the cost of an episode here

    def act(self, action: str) -> Outcome:
        return Outcome("ok", done=True, success=action.strip() == "0", info={"score": 0.0})

    def close(self) -> None:
        raise RuntimeError("close failed on purpose")


class RandomStart(GuessNumber):
    """The start state is random *inside the sandbox* (not derived from the seed): only a fork of one
    reset sandbox gives a group identical starts. Each step reports that state."""

    def setup(self, seed: int) -> str:
        super().setup(seed)
        return self.run("od -An -N6 -tx1 /dev/urandom | tr -d ' \\n' | tee /workspace/start").output

    def act(self, action: str) -> Outcome:
        return Outcome(self.run("cat /workspace/start").output, done=True)

    def reward(self, outcome: Outcome) -> float:
        return 0.0


for _name, _cls in {
    "RaisesOnOddSeeds": RaisesOnOddSeeds,
    "KillsItsSandbox": KillsItsSandbox,
    "HangsOnOddSeeds": HangsOnOddSeeds,
    "NoSandboxOnOddSeeds": NoSandboxOnOddSeeds,
    "CloseFails": CloseFails,
    "RandomStart": RandomStart,
}.items():
    if f"faults/{_name}-v0" not in gymnasium.registry:
        gymnasium.register(f"faults/{_name}-v0", entry_point=_cls, disable_env_checker=True)
