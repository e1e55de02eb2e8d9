"""The built-in tasks: gymnasium compliance, determinism, and that success needs the sandbox.

Real sandboxes (Docker + the base image); each test creates one or two.
"""

import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from agentenv.tasks import TASKS
from agentenv.tasks.fix_code import problem_index

pytestmark = pytest.mark.docker


@pytest.mark.parametrize("env_id", sorted(TASKS))
def test_every_builtin_task_passes_gymnasiums_env_checker(make_task, env_id):
    """gymnasium's full `check_env` (spaces, reset seeding and determinism, step API) on each task, its
    warnings as errors (the checker reports most problems as warnings)."""
    env = make_task(env_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)
    assert env_id in gymnasium.registry


def test_guess_number_is_deterministic_given_the_seed(make_task):
    a, b = make_task("agentenv/GuessNumber-v0"), make_task("agentenv/GuessNumber-v0")
    for seed in (1, 2, 3):
        assert a.reset(seed=seed) == b.reset(seed=seed)
        assert [a.step(str(g))[0] for g in (3, 5, 1)] == [b.step(str(g))[0] for g in (3, 5, 1)]


def _play(env, seed, policy):
    obs, _ = env.reset(seed=seed)
    history = []
    while True:
        guess = policy(history)
        obs, reward, terminated, truncated, info = env.step(str(guess))
        history.append((guess, obs))
        if terminated or truncated:
            return info["success"], reward


def test_guess_number_needs_the_sandbox_answers(make_task):
    """Ignoring the answers (a fixed list of guesses) wins max_turns/num_values = half the games;
    binary search on the sandbox's answers wins all of them."""
    env = make_task("agentenv/GuessNumber-v0")
    assert env.max_turns / env.num_values == 0.5

    def fixed(history):
        return len(history)  # 0, 1, 2, ... whatever the answers

    def binary_search(history):
        low, high = 0, env.num_values - 1
        for guess, answer in history:
            low, high = (guess + 1, high) if answer.startswith("higher") else (low, guess - 1)
        return (low + high) // 2

    seeds = range(60)
    blind = sum(_play(env, s, fixed)[0] for s in seeds) / len(seeds)
    searching = sum(_play(env, s, binary_search)[0] for s in seeds) / len(seeds)
    assert 0.35 <= blind <= 0.65  # expectation 0.5
    assert searching == 1.0


def test_guess_number_penalises_actions_that_are_not_numbers(make_task):
    env = make_task("agentenv/GuessNumber-v0")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("hello")
    assert (obs, reward, terminated, info["valid"]) == ("invalid", -0.1, False, False)


def test_guess_number_reads_a_guess_with_leading_zeros_as_decimal(make_task):
    """A free-form policy writes "08": the game's shell arithmetic would read it as (bad) octal."""
    env = make_task("agentenv/GuessNumber-v0", num_values=32, max_turns=6)
    env.reset(seed=0)
    plain = env.step("8")[0]
    env.reset(seed=0)
    assert env.step("08")[0] == plain and plain.split(" ")[0] in ("higher", "lower", "correct")


def test_guess_number_with_execs_answers_like_the_session(make_task):
    fast, slow = make_task("agentenv/GuessNumber-v0"), make_task("agentenv/GuessNumber-v0", session=False)
    assert fast.reset(seed=11)[0] == slow.reset(seed=11)[0]
    assert [fast.step(str(g))[0] for g in range(4)] == [slow.step(str(g))[0] for g in range(4)]


def test_find_value_is_solved_by_reading_the_files(make_task):
    env = make_task("agentenv/FindValue-v0")
    env.reset(seed=5)
    listing, *_ = env.step("grep -r value .")
    value = listing.split("value: ")[1].split()[0]
    _, wrong, terminated, _, _ = env.step("submit 0")
    assert terminated and wrong == 0.0
    env.reset(seed=5)
    _, reward, terminated, _, info = env.step(f"submit {value}")
    assert terminated and reward == 1.0 and info["success"]


@pytest.mark.parametrize("task_id", ["agentenv/FindValue-v0", "agentenv/FixCode-v0"])
def test_a_command_no_shell_can_run_is_the_agents_observation_not_a_failure(make_task, task_id):
    """An untrained policy samples any byte: a NUL in its command line (no argv string can hold one)
    is told back to it as the observation, the episode goes on, and the next command runs."""
    env = make_task(task_id)
    env.reset(seed=3)
    observation, reward, terminated, truncated, _ = env.step("ls\x00 -la")
    assert "NUL" in observation and not (terminated or truncated) and reward == 0.0
    listing, *_ = env.step("echo still here")
    assert listing.strip() == "still here"
    # a command that kills every process it can, the session's shell included: an observation too
    observation, reward, terminated, truncated, _ = env.step("echo before; kill -9 -1")
    assert observation.strip() == "before" and not (terminated or truncated)
    listing, *_ = env.step("echo still here")
    assert listing.strip() == "still here"


def test_fix_code_reward_is_the_fraction_of_tests_passed(make_task):
    env = make_task("agentenv/FixCode-v0")
    seed = next(s for s in range(100) if problem_index(s) == 0)  # the `add` problem
    env.reset(seed=seed)
    source, *_ = env.step("cat mod.py")
    assert "a - b" in source
    _, reward, terminated, _, _ = env.step("submit")
    assert terminated and reward == pytest.approx(1 / 4)  # only add(0, 0) == 0 passes
    env.reset(seed=seed)
    env.step("sed -i 's/a - b/a + b/' mod.py")
    _, reward, terminated, _, info = env.step("submit")
    assert terminated and reward == 1.0 and info["success"]


def test_a_forked_task_continues_from_the_same_hidden_state(make_task):
    env = make_task("agentenv/GuessNumber-v0")
    first, _ = env.reset(seed=21)
    forks = env.fork(2)
    try:
        answers = [[e.step(str(g))[0] for g in range(8)] for e in (env, *forks)]
        assert answers[0] == answers[1] == answers[2]
    finally:
        for f in forks:
            f.close()


def test_guess_number_can_penalise_guesses_the_answers_ruled_out(make_task):
    env = make_task("agentenv/GuessNumber-v0", ruled_out_penalty=0.2)
    seed = next(s for s in range(50) if env.reset(seed=s) and env.step("0")[0].startswith("higher"))
    env.reset(seed=seed)
    assert env.step("0")[:2] == ("higher 1-5", 0.0)  # 0 is now ruled out; the sandbox says what is left
    obs, reward, _, _, info = env.step("0")
    assert (obs, reward, info["ruled_out"]) == ("higher 1-5", -0.2, True)


def test_guess_number_answers_narrow_the_range(make_task):
    env = make_task("agentenv/GuessNumber-v0", num_values=8, max_turns=4)
    seed = next(s for s in range(50) if env.reset(seed=s) and env.step("3")[0].startswith("higher"))
    env.reset(seed=seed)
    assert env.step("3")[0] == "higher 4-7"
    assert env.step("6")[0] in ("lower 4-5", "higher 7-7", "correct")
    words = make_task("agentenv/GuessNumber-v0", show_range=False)
    words.reset(seed=seed)
    assert words.step("0")[0] in ("higher", "correct")
