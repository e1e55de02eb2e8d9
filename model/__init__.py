"""k3rl: model package."""
