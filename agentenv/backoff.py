"""Retry delays with full jitter: before retry n (n = 1, 2, ...) wait a uniformly random time in
[0, min(cap, base * 2**(n-1))]. Clients that failed together (a host restarting under many rollout
workers) then spread their retries over the window instead of all coming back at the same instants,
and no wait exceeds the cap."""

from __future__ import annotations

import random


def retry_delay(retry: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Seconds to wait before retry number `retry` (1 for the first), drawn from `rng`."""
    if retry < 1:
        raise ValueError(f"retry numbers start at 1, got {retry}")
    if base_s < 0 or cap_s < 0:
        raise ValueError(f"backoff base and cap must be >= 0 seconds, got base {base_s}, cap {cap_s}")
    window = min(cap_s, base_s * 2.0 ** min(retry - 1, 64))  # the exponent bounded: no float overflow
    return rng.uniform(0.0, window)
