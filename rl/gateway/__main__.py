"""``python -m rl.gateway --checkpoint DIR``: see `rl.gateway.serve`."""

from rl.gateway.serve import main

main()
