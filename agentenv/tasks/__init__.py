"""Built-in agent tasks: gymnasium envs over AgentENV sandboxes, registered as ``agentenv/<Name>-v0``.

- ``agentenv/GuessNumber-v0`` (default): find a hidden number with higher/lower answers (multi-turn).
- ``agentenv/FindValue-v0``: find a value hidden in a file tree with shell commands and submit it.
- ``agentenv/FixCode-v0``: edit a Python module until its unit tests pass (reward = fraction passed).
- ``agentenv/StoreRecall-v0``: store instructed digits in the sandbox, then answer a question about them.
- ``agentenv/AgentProgram-v0``: an agent program of your own plays the episode in the sandbox, calling the
  policy through an OpenAI-compatible API; a verifier scores the final state (`agentenv.tasks.agent_program`).

Write your own by subclassing :class:`SandboxTask` (see docs/tasks.md) and registering it the same way;
``agentenv tasks new NAME`` writes a working one to start from (`agentenv.scaffold`), ``agentenv tasks check``
runs gymnasium's env checker on it (`agentenv.tasks.check`).
"""

import gymnasium

from agentenv.tasks.base import CommandResult, Outcome, SandboxTask

TASKS = {
    "agentenv/GuessNumber-v0": "agentenv.tasks.guess_number:GuessNumber",
    "agentenv/FindValue-v0": "agentenv.tasks.find_value:FindValue",
    "agentenv/FixCode-v0": "agentenv.tasks.fix_code:FixCode",
    "agentenv/ReasoningGym-v0": "agentenv.tasks.reasoning_gym_task:ReasoningGym",
    "agentenv/KVLookup-v0": "agentenv.tasks.kv_lookup:KVLookup",
    "agentenv/StoreRecall-v0": "agentenv.tasks.store_recall:StoreRecall",
}
# Tasks whose episode an agent program plays (``runs_program``): one step, whose action is the program's
# environment (`agentenv.tasks.agent_program`), so not turn-by-turn text envs for gymnasium's checker.
PROGRAM_TASKS = {
    "agentenv/AgentProgram-v0": "agentenv.tasks.agent_program:AgentProgram",
}

for _env_id, _entry_point in {**TASKS, **PROGRAM_TASKS}.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(id=_env_id, entry_point=_entry_point, disable_env_checker=True)

__all__ = ["PROGRAM_TASKS", "TASKS", "CommandResult", "Outcome", "SandboxTask"]
