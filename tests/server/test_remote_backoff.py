"""The remote client's waits between attempts (`agentenv.backoff`): full jitter, within the exponential
window and under the cap, drawn from the random source the client is given (no test sleeps for them)."""

from __future__ import annotations

import dataclasses
import random
import socket

import pytest

from agentenv.backoff import retry_delay
from agentenv.errors import HostUnavailable
from agentenv.remote import RemoteSettings, SandboxHost


def test_delays_vary_and_stay_within_the_window_and_the_cap():
    rng = random.Random(1234)
    base, cap = 0.5, 5.0
    for retry in range(1, 12):
        window = min(cap, base * 2 ** (retry - 1))
        delays = [retry_delay(retry, base, cap, rng) for _ in range(200)]
        assert all(0.0 <= d <= window for d in delays), (retry, max(delays))
        assert len(set(delays)) == len(delays)            # they vary: no two clients wait alike
        assert min(delays) < 0.2 * window < 0.8 * window < max(delays)  # spread over the whole window
    assert retry_delay(10_000, base, cap, rng) <= cap     # far retries: capped, no overflow
    assert retry_delay(3, 0.0, cap, rng) == 0.0           # no backoff configured: no wait
    # the same seed, the same delays (reproducible); another seed, others
    seq = [retry_delay(r, base, cap, random.Random(7)) for r in (1, 2, 3)]
    assert seq == [retry_delay(r, base, cap, random.Random(7)) for r in (1, 2, 3)]
    assert seq != [retry_delay(r, base, cap, random.Random(8)) for r in (1, 2, 3)]
    with pytest.raises(ValueError, match="start at 1"):
        retry_delay(0, base, cap, rng)
    with pytest.raises(ValueError, match=">= 0"):
        retry_delay(1, -1.0, cap, rng)


def test_the_client_draws_each_wait_from_the_random_source_it_is_given():
    """A host nobody listens on (loopback, connection refused): `retries` attempts, a jittered wait
    drawn from the given source before each retry."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    settings = dataclasses.replace(RemoteSettings.load(), retries=4, retry_backoff_s=0.001,
                                   retry_backoff_max_s=0.002)
    rng = random.Random(99)
    host = SandboxHost(f"http://127.0.0.1:{port}", "key", settings, rng=rng)
    try:
        with pytest.raises(HostUnavailable, match="after 4 attempt"):
            host.request("GET", "/host")
    finally:
        host.close()
    replay = random.Random(99)
    for _ in range(3):  # one draw per wait: 4 attempts, 3 waits
        replay.random()
    assert rng.random() == replay.random()
