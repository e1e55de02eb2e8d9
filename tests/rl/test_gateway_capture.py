"""Capture: calls made with an episode's key become training episodes, merged while each prompt extends
the tokens so far, with the sampled ids and log-probs exactly as the engine returned them."""

import math

import openai
import pytest
import torch
from gateway_testutil import MODEL, TOK, serving, settings
from rl_testutil import compose

from rl.episode import collate
from rl.learner.learner import Learner
from rl.policy import build_policy
from rl.rollout.gateway.capture import CallRecord, EpisodeRecord
from rl.rollout.gateway.samples import episode_samples
from rl.rollout.gateway.service import Gateway
from rl.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def call(prompt, completion, version=0):
    return CallRecord(prompt, completion, [-0.5] * len(completion), version, None, True)


def samples_of(*calls):
    return episode_samples(EpisodeRecord("k", list(calls)), reward=1.0, env_id="e", seed=0, group=0)


def test_calls_that_extend_the_history_merge_and_others_start_samples():
    first = call([1, 2, 3], [4, 5])
    second = call([1, 2, 3, 4, 5, 9, 9], [6], version=1)  # extends: 9 9 is the new observation
    compacted = call([1, 7], [8])  # a rewritten conversation
    off_by_one = call([1, 2, 3, 4, 0, 9], [6])  # differs from the history in one token
    merged, restarted, other = samples_of(first, second, compacted, off_by_one)
    assert merged.tokens == [1, 2, 3, 4, 5, 9, 9, 6]
    assert merged.action_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert merged.logprobs == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5]
    assert merged.versions == [0] * 5 + [1] * 3
    assert merged.step_rewards == [(7, 1.0)] and merged.turns == 2
    assert restarted.tokens == [1, 7, 8] and other.tokens == [1, 2, 3, 4, 0, 9, 6]


@pytest.fixture(scope="module")
def cfg():  # guess_number: actions of digits, so the sampled text re-encodes to the same ids
    return compose("algo.group_size=2", "algo.episodes_per_step=2", "algo.epochs=1", "algo.minibatches=1")


@pytest.fixture(scope="module")
def served(cfg):
    engine = TorchEngine(build_policy(cfg.model, seed=0), TOK, action_vocabulary=cfg.env.action_vocabulary)
    gateway = Gateway(engine, TOK, settings(max_tokens=6))
    with serving(gateway) as url:
        yield gateway, url


def chat(url, key, messages, **extra):
    with openai.OpenAI(api_key=key, base_url=url, max_retries=0) as client:
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, logprobs=True, **extra
        ).choices[0]


def test_a_conversation_becomes_one_sample_with_the_engine_tokens(served, cfg):
    gateway, url = served
    key = gateway.keys.open()
    turns = [{"role": "user", "content": "guess"}]
    replies = []
    for answer in ("higher", "lower"):
        reply = chat(url, key, turns, temperature=cfg.rollout.temperature)
        replies.append(reply)
        turns += [{"role": "assistant", "content": reply.message.content}]
        turns += [{"role": "user", "content": answer}]
    chat(url, key, [{"role": "user", "content": "summary: guess"}])
    edited = [*turns[:1], {"role": "assistant", "content": replies[0].message.content + "0"}, turns[2]]
    chat(url, key, edited)  # the history with one token more in the policy's answer
    record = gateway.keys.close(key)
    assert len(record.calls) == 4
    merged, restarted, branched = episode_samples(record, reward=1.0, env_id="e", seed=0, group=0)

    first, second = record.calls[:2]
    assert merged.tokens == second.prompt_ids + second.completion_ids
    actions = [t for t, m in zip(merged.tokens, merged.action_mask, strict=True) if m]
    assert actions == first.completion_ids + second.completion_ids
    action_logprobs = [lp for lp, m in zip(merged.logprobs, merged.action_mask, strict=True) if m]
    assert action_logprobs == first.logprobs + second.logprobs
    shown = [t.logprob for r in replies for t in r.logprobs.content]  # what the API returned
    sampled = [lp for c in (first, second) for t, lp in zip(c.completion_ids, c.logprobs, strict=True)
               if t != TOK.end_id]  # fmt: skip
    assert shown == sampled
    assert merged.routes is not None and len(merged.routes) == len(actions)
    assert restarted.tokens[-len(record.calls[2].completion_ids) :] == record.calls[2].completion_ids
    assert branched.tokens == record.calls[3].prompt_ids + record.calls[3].completion_ids

    # the learner recomputes the same log-probs from the sample (fp32, same weights, same mask)
    learner = Learner(cfg)
    batch = collate([merged], TOK.pad_id)
    logp = learner._forward(batch)[0].detach()
    where = batch.action_mask.bool()
    assert torch.allclose(logp[where], batch.rollout_logprobs[where], atol=1e-4), (
        (logp[where] - batch.rollout_logprobs[where]).abs().max()
    )

    # and trains them: the merged conversation and the edited branch as a group of two
    branched.step_rewards = [(branched.step_rewards[0][0], 0.0)]
    metrics = learner.train_step([merged, branched])
    assert all(math.isfinite(v) for v in metrics.values()), metrics
