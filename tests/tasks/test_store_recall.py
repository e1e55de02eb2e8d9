"""StoreRecall: the state the agent builds in the early turns is what the late turns read and score.

Real sandboxes (Docker + the base image); a test creates one, the fork test three. (gymnasium's env checker
runs on it with every registered task: tests/tasks/test_tasks.py.)
"""

from __future__ import annotations

import random

import pytest

from agentenv.tasks.store_recall import StoreRecall, copy_then_bisect, copy_then_linear
from rl.sft.experts import expert_for

pytestmark = pytest.mark.docker
ENV_ID = "agentenv/StoreRecall-v0"


def play(env, seed: int, policy) -> tuple[bool, float, list[str]]:
    """One episode: ``policy(observation) -> action``; (success, total reward, observations)."""
    observation, _ = env.reset(seed=seed)
    seen, total = [observation], 0.0
    while True:
        observation, reward, terminated, truncated, info = env.step(policy(observation))
        seen.append(observation)
        total += reward
        if terminated or truncated:
            return info["success"], total, seen


def recall(env):
    """Store as instructed, then answer the instructed value of the asked box (never reads the answers)."""
    return lambda obs: str(env.plan[env.query]) if "find box" in obs else copy_then_bisect(obs)


def test_the_scripted_policy_wins_every_game_and_a_random_one_almost_none(make_task):
    env = make_task(ENV_ID, ruled_out_penalty=0.2)
    expert = expert_for(ENV_ID)  # the config's env.expert, as demonstrations play it
    results = [play(env, seed, expert.act) for seed in range(12)]
    assert all(won and reward == 1.0 for won, reward, _ in results)
    first = results[0][2]
    env.reset(seed=0)  # the plan of the first game
    assert first[0] == f"store {env.plan[0]} {env.plan[1]}"
    assert first[1] == f"box 0={env.plan[0]}, store {env.plan[1]}"
    assert first[2] == f"box 1={env.plan[1]}, find box {env.query}: 0-5"
    assert all(play(env, seed, recall(env))[0] for seed in range(12, 16))
    rng = random.Random(0)
    random_wins = sum(play(env, seed, lambda _: str(rng.randrange(10)))[0] for seed in range(60))
    assert random_wins <= 3  # expectation 0.6 (1 % set up right, then ~50 % of those answered)


def test_the_weaker_expert_stores_right_and_wins_only_when_the_value_is_among_its_first_guesses(make_task):
    env = make_task(ENV_ID)
    linear = expert_for("agentenv.tasks.store_recall:copy_then_linear")  # as env.expert=... names it
    assert linear.quality == "copy_then_linear"
    outcomes = []
    for seed in range(12):
        won, _, seen = play(env, seed, linear.act)
        asked = env.plan[env.query]
        assert won == (asked <= 2), (seed, asked, seen)  # 2 stores + 3 answers: guesses 0, 1, 2
        assert seen[2].endswith("0-5") and "wrong" not in " ".join(seen)
        outcomes.append(won)
    assert 0 < sum(outcomes) < 12


def test_the_answer_is_read_from_the_store_a_planted_wrong_state_scores_zero(make_task):
    env = make_task(ENV_ID)
    for seed in range(40):  # a game whose asked box holds neither 0 nor the largest value
        env.reset(seed=seed)
        if 0 < env.plan[env.query] < env.num_values - 1:
            break
    asked, value = env.query, env.plan[env.query]
    env.reset(seed=seed)
    for digit in env.plan:
        env.step(str(digit))
    stored = env.run("cat /workspace/store/boxes/*").output.split()
    assert stored == [str(d) for d in env.plan]  # what the agent stored lives in the sandbox
    env.run(f"echo {value - 1} > /workspace/store/boxes/{asked}")  # plant a wrong state
    observation, reward, terminated, _, info = env.step(str(value))  # the instructed answer
    assert (observation, reward, terminated) == (f"lower 0-{value - 1}", 0.0, False)
    observation, reward, terminated, _, info = env.step(str(value - 1))  # what the store holds now
    assert observation == f"wrong store: box {asked}={value - 1}, should be {value}"
    assert terminated and reward == 0.0 and not info["success"]
    env.reset(seed=seed)  # the same game without the planted state: the instructed answer wins
    for digit in env.plan:
        env.step(str(digit))
    assert env.step(str(value))[:3] == ("correct", 1.0, True)


def test_a_wrong_setup_ends_the_episode_with_no_reward(make_task):
    env = make_task(ENV_ID)
    env.reset(seed=3)
    wrong = (env.plan[0] + 1) % env.num_values
    observation, reward, terminated, _, info = env.step(str(wrong))
    assert observation == f"wrong: box 0={wrong}, store {env.plan[0]} {env.plan[1]}"
    assert terminated and reward == 0.0 and not info["success"] and info["stored"] == 0
    env.reset(seed=3)
    assert env.step("go")[:3] == ("invalid", -0.1, False)  # a non-number costs the turn, stores nothing
    assert env.step(str(env.plan[0]))[0] == f"box 0={env.plan[0]}, store {env.plan[1]}"


def test_branches_forked_after_the_setup_share_the_built_store(make_task):
    """Tree rollouts: the setup turns are played once, the branches answer differently in copies of it."""
    env = make_task(ENV_ID)
    env.reset(seed=7)
    for digit in env.plan:
        env.step(str(digit))
    value = env.plan[env.query]
    branches = env.fork(2)
    try:
        right = branches[0].step(str(value))
        wrong = branches[1].step(str((value + 1) % env.num_values))
        env.run(f"echo {(value + 1) % env.num_values} > /workspace/store/boxes/{env.query}")
        planted = env.step(str(value))
    finally:
        for branch in branches:
            branch.close()
    assert right[:3] == ("correct", 1.0, True)
    assert wrong[0].split(" ")[0] in ("higher", "lower") and wrong[1] == 0.0
    assert planted[0] != "correct" and planted[1] <= 0.0  # the other branches' stores are their own


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_keys": 0}, r"^num_keys must be an integer in 1\.\.9 \(boxes to store\), got 0$"),
    ({"num_keys": "2"}, r"^num_keys must be an integer in 1\.\.9 .*got '2'$"),
    ({"num_values": 11}, r"^num_values must be an integer in 2\.\.10 .*got 11$"),
    ({"num_keys": 3, "max_turns": 3}, r"^max_turns must be an integer >= num_keys \+ 1 = 4 .*got 3$"),
    ({"ruled_out_penalty": -1}, r"^ruled_out_penalty must be a number >= 0, got -1$"),
])
def test_bad_config_is_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StoreRecall(**kwargs)


def test_the_expert_refuses_an_observation_it_cannot_read():
    assert copy_then_bisect("store 3 5") == "3" and copy_then_bisect("higher 3-5") == "4"
    assert copy_then_linear("box 0=3, store 5") == "5" and copy_then_linear("higher 3-5") == "3"
    for expert in (copy_then_bisect, copy_then_linear):
        with pytest.raises(ValueError, match="cannot read the observation 'correct'"):
            expert("correct")
