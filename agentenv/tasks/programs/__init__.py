"""Agent programs the example tasks run inside their sandboxes (`agentenv.tasks.agent_program`): plain
scripts for the sandbox's python3, written into it as files; the trainer never imports them."""
