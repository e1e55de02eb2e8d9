"""k3rl's RL trainer: the entry point (`rl.train`) over four wings and a core. Wings: `rl.driver` (the
training loop), `rl.rollout` (workers, runner, engines), `rl.learner` (learner, sharding, checkpoints of
ranks), `rl.sft` (cold start, demonstrations); `rl.rollout.gateway` serves the policy over HTTP. The core
(config,
algorithms, episodes, tokenizer, seeds, checkpoints, metrics, device, policy) imports no wing.

Run it with `python -m rl.train` (or `k3rl-train`, `make train`); map: docs/map.md.
"""
