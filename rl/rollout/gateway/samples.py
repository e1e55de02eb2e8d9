"""Training samples of an episode's calls, without re-tokenising anything.

The calls of one episode (`rl.rollout.gateway.capture.EpisodeRecord`) are walked in order. A call whose prompt
token ids begin with all the tokens of a sample built so far extends that sample (the longest such one):
the new part of its prompt (the tool results, user turns and template tokens since) is appended as
observation tokens, out of the loss, and its completion as action tokens with their sampling log-probs,
version and routes. A call that extends no sample (a conversation the agent compacted or rewrote, a
sub-agent, a second choice of ``n``) starts a new sample of the same episode. Each sample is an
`rl.episode.Episode`, so the learner trains it like a rollout's; the episode's reward sits on the last
action token of each of its samples.
"""

from __future__ import annotations

from rl.episode import Episode
from rl.rollout.gateway.capture import CallRecord, EpisodeRecord


def _extended(samples: list[Episode], prompt: list[int]) -> Episode | None:
    """The longest sample whose tokens are a prefix of ``prompt`` (None: none is)."""
    best = None
    for sample in samples:
        n = len(sample.tokens)
        if n <= len(prompt) and prompt[:n] == sample.tokens and (best is None or n > len(best.tokens)):
            best = sample
    return best


def _add_call(sample: Episode, call: CallRecord) -> None:
    sample.append(call.prompt_ids[len(sample.tokens) :], trained=False, version=call.version)
    sample.append(
        call.completion_ids, trained=True, logprobs=call.logprobs, version=call.version, routes=call.routes
    )
    sample.turns += 1


def episode_samples(
    record: EpisodeRecord, reward: float, env_id: str, seed: int, group: int
) -> list[Episode]:
    """The samples of one episode's calls (module docstring), in the order they started."""
    samples: list[Episode] = []
    for call in record.calls:
        sample = _extended(samples, call.prompt_ids)
        if sample is None:
            sample = Episode(env_id=env_id, seed=seed, group=group)
            samples.append(sample)
        _add_call(sample, call)
    for sample in samples:
        last_action = max(i for i, trained in enumerate(sample.action_mask) if trained)
        sample.step_rewards.append((last_action, float(reward)))
    return samples
