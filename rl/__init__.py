"""k3rl's RL trainer: Hydra entry point (`rl.train`), Ray actors (`rl.actors`), rollout (`rl.rollout`,
`rl.generation`), learner (`rl.learner`), algorithms (`rl.algos`), metrics and checkpoints.

Run it with `python -m rl.train` (or `k3rl-train`, `make train`); see docs/training.md.
"""
