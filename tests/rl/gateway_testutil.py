"""Helpers of the gateway tests (imported by name): a gateway over the tiny policy, served by uvicorn on a
loopback port in a thread of the test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from rl.policy import build_policy
from rl.rollout.gateway.app import create_app
from rl.rollout.gateway.service import Gateway
from rl.rollout.gateway.settings import GatewaySettings
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

MODEL = "tiny-policy"
TOK = ByteTokenizer()


def settings(**changes) -> GatewaySettings:
    values = dict(
        model_name=MODEL, context_tokens=512, max_tokens=24, max_n=4, batch_window_s=0.05,
        max_batch_rows=16, open_access=False, seed=0,
    )  # fmt: skip
    return GatewaySettings(**{**values, **changes})


def tiny_gateway(model_cfg, **changes) -> Gateway:
    return Gateway(TorchEngine(build_policy(model_cfg, seed=0), TOK), TOK, settings(**changes))


@contextmanager
def serving(gateway: Gateway) -> Iterator[str]:
    """The gateway's API on a free loopback port for the block: its base URL (``.../v1``)."""
    config = uvicorn.Config(create_app(gateway), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
