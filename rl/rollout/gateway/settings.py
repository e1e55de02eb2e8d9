"""`GatewaySettings`: what a policy gateway serves and how it batches. The standalone server
(``python -m rl.rollout.gateway``) fills them from its command line, where their defaults are."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    model_name: str  # the model id clients name (``GET /v1/models``)
    context_tokens: int  # prompt plus completion may not exceed it
    max_tokens: int  # the most tokens one completion may sample (and the default of chat calls)
    max_n: int  # the largest ``n`` a call may ask for
    batch_window_s: float  # the quiet gap that closes a gathering of an idle engine (`batcher`)
    max_batch_rows: int  # the most completions one engine call samples
    open_access: bool  # serve calls without an episode key too (not recorded); else they get 401
    seed: int  # of the sampling generator
