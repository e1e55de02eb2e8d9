"""k3rl: agentenv package."""
