"""k3rl: kernels package."""
