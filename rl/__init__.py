"""k3rl: rl package."""
