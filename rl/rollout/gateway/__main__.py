"""``python -m rl.rollout.gateway --checkpoint DIR``: see `rl.rollout.gateway.serve`."""

from rl.rollout.gateway.serve import main

main()
