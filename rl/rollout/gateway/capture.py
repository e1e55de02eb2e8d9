"""Capture: every call made with an episode's API key, recorded token for token.

`EpisodeKeys.open` gives an episode its own key (the agent program uses it as its OpenAI API key);
each completion the gateway samples under that key is a `CallRecord`: the prompt token ids after the
chat template, the sampled ids and their log-probs, the policy version that sampled them and the
experts of each sampled token (`rl.rollout.torch_engine.Generation.routes`). `EpisodeKeys.close` ends the
episode
and hands back its calls in order; `rl.rollout.gateway.samples` turns them into training episodes.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

import torch

KEY_PREFIX = "sk-episode-"


@dataclass(frozen=True)
class CallRecord:
    """One sampled completion (one choice of a call with ``n`` > 1)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    routes: torch.Tensor | None  # [len(completion_ids), n_moe_layers, top_k], or None: none recorded
    ended: bool  # the policy ended its turn (end token or a stop sequence), not cut by max_tokens


@dataclass
class EpisodeRecord:
    key: str
    calls: list[CallRecord] = field(default_factory=list)


class EpisodeKeys:
    """The open episodes by API key (thread-safe: the app records from its event loop, a trainer opens
    and closes episodes from its own threads)."""

    def __init__(self) -> None:
        self._open: dict[str, EpisodeRecord] = {}
        self._lock = threading.Lock()

    def open(self) -> str:
        """A new episode; returns its API key."""
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        with self._lock:
            self._open[key] = EpisodeRecord(key)
        return key

    def known(self, key: str) -> bool:
        with self._lock:
            return key in self._open

    def record(self, key: str, calls: list[CallRecord]) -> None:
        """Append ``calls`` to the episode of ``key`` (ignored once the episode is closed: a call that
        finishes after its episode ended is not part of it)."""
        with self._lock:
            episode = self._open.get(key)
            if episode is not None:
                episode.calls.extend(calls)

    def close(self, key: str) -> EpisodeRecord:
        """End the episode of ``key``: its key stops working and its record is returned."""
        with self._lock:
            try:
                return self._open.pop(key)
            except KeyError:
                raise KeyError(f"no open episode has the key {key[: len(KEY_PREFIX) + 4]}...") from None
