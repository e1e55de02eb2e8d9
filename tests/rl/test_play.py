"""`rl.rollout.play`: the one turn loop. Each turn records the generated action (trained), the end token
the policy did not emit (not trained), the step's reward on the action's last token and the weights
version of that turn; a step error fails only its episode; `after_turn` decides who plays on."""

from rl.episode import Episode
from rl.rollout.play import play, record_action
from rl.rollout.torch_engine import Generation
from rl.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _gen(text: str, ended: bool) -> Generation:
    ids = [*TOK.encode(text), *([TOK.end_id] if ended else [])]
    return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), ended=ended)


def test_an_action_cut_at_max_new_tokens_gets_an_untrained_end_token():
    episode = Episode("t", 1, 0)
    episode.begin("hi", TOK)
    start = len(episode.tokens)
    action, reward_at = record_action(episode, _gen("ab", ended=False), TOK, version=3)
    assert action == "ab" and reward_at == start + 1
    assert episode.tokens[start:] == [*TOK.encode("ab"), TOK.end_id]
    assert episode.action_mask[start:] == [1, 1, 0] and episode.versions[start:] == [3, 3, 3]
    assert episode.logprobs[start:] == [-0.5, -0.5, 0.0]


def test_turns_record_versions_rewards_and_errors_and_after_turn_decides_who_plays_on():
    episodes = [Episode("t", seed, 0) for seed in range(3)]
    for e in episodes:
        e.begin("start", TOK)
    versions, turns, steps = iter([7, 8, 9]), [], []

    def generate(active):
        turns.append(list(active))
        return [_gen(f"a{i}", ended=True) for i in active]

    def step(jobs):
        steps.append(jobs)
        out = {}
        for i, _action in jobs:
            if i == 2:
                out[i] = (None, RuntimeError("sandbox died"))
            else:  # episode 0 ends on its second turn, episode 1 would go on
                done = i == 0 and len(steps) == 2
                out[i] = (("obs", 1.0 if done else 0.0, done, False, {"success": done}), None)
        return out

    play(episodes, [0, 1, 2], generate, step, TOK, room=10_000, version=lambda: next(versions),
         after_turn=lambda active: [i for i in active if len(steps) < 2 or i == 0])
    assert turns == [[0, 1, 2], [0, 1]]  # 2 failed in turn 1
    assert steps[0] == [(i, TOK.decode(_gen(f"a{i}", ended=True).token_ids)) for i in range(3)]
    assert episodes[2].error is not None and "sandbox died" in episodes[2].error
    assert episodes[0].success and episodes[0].turns == 2 and episodes[1].turns == 2
    assert episodes[0].step_rewards[-1][1] == 1.0
    trained_versions = {v for v, m in zip(episodes[0].versions, episodes[0].action_mask, strict=True) if m}
    assert trained_versions == {7, 8}
