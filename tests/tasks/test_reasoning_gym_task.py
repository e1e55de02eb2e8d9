"""agentenv/ReasoningGym-v0: reasoning-gym's datasets through the full gymnasium path (make, reset,
step), scored by reasoning-gym's own ``score_answer``; single and multi-turn. No sandbox is involved."""

from pathlib import Path

import gymnasium
import pytest
import reasoning_gym
import yaml
from gymnasium.utils.env_checker import check_env

import agentenv.tasks  # noqa: F401  (registers the task)
from agentenv.tasks.reasoning_gym_task import ReasoningGym

ROOT = Path(__file__).resolve().parents[2]
ENV_ID = "agentenv/ReasoningGym-v0"
DATASETS = ("basic_arithmetic", "leg_counting", "spell_backward")
DATASET_KWARGS = {"seed": 7, "size": 50}
WRONG = "#"  # contains no gold answer of these datasets: scores 0, not partial credit


def make(dataset: str, **kwargs):
    kwargs.setdefault("dataset_kwargs", DATASET_KWARGS)
    return gymnasium.make(ENV_ID, dataset=dataset, **kwargs)


def gold(dataset: str, seed: int) -> str:
    """The right answer of episode ``seed``, from reasoning-gym directly (not from the env)."""
    return reasoning_gym.create_dataset(dataset, **DATASET_KWARGS)[seed % DATASET_KWARGS["size"]]["answer"]


@pytest.mark.parametrize("dataset", DATASETS)
def test_single_turn_gold_answers_score_one_and_wrong_ones_zero(dataset):
    env = make(dataset, max_turns=1)
    for seed in (0, 3, 61):  # 61: problem 11 (seed modulo the dataset's size)
        question, info = env.reset(seed=seed)
        assert question == reasoning_gym.create_dataset(dataset, **DATASET_KWARGS)[seed % 50]["question"]
        obs, reward, terminated, truncated, info = env.step(gold(dataset, seed))
        assert (obs, reward, terminated, truncated, info["success"]) == ("correct", 1.0, True, False, True)
        env.reset(seed=seed)
        obs, reward, terminated, truncated, info = env.step(WRONG)
        assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
        assert obs == "wrong answer (score 0.00)"


@pytest.mark.parametrize("dataset", DATASETS[:2])
def test_multi_turn_wrong_answers_get_feedback_and_another_try(dataset):
    env = make(dataset, max_turns=3)
    env.reset(seed=5)
    obs, reward, terminated, truncated, info = env.step(WRONG)
    assert (obs, reward, terminated, truncated) == (
        "wrong answer (score 0.00); 2 tries left",
        0.0,
        False,
        False,
    )
    obs, *_ = env.step("also wrong")
    assert obs == "wrong answer (score 0.00); 1 try left"
    obs, reward, terminated, truncated, info = env.step(
        f"  {gold(dataset, 5)}\n"
    )  # whitespace is not the answer
    assert (obs, reward, terminated, truncated, info["turn"]) == ("correct", 1.0, True, False, 3)
    env.reset(seed=5)
    rewards = [env.step(WRONG)[1:4] for _ in range(3)]
    assert rewards == [(0.0, False, False), (0.0, False, False), (0.0, True, False)]  # out of tries


def test_partial_credit_is_the_scorers_and_counts_only_on_the_last_try():
    env = make("basic_arithmetic", max_turns=2)
    env.reset(seed=1)
    answer = gold("basic_arithmetic", 1)
    partial = f"{answer} {answer}"  # reasoning-gym's default scorer: len(gold) / len(answer)
    expected = len(answer) / len(partial)
    obs, reward, *_, info = env.step(partial)
    assert reward == 0.0 and info["score"] == pytest.approx(expected) and obs.endswith("1 try left")
    _, reward, terminated, truncated, _ = env.step(partial)
    assert reward == pytest.approx(expected) and terminated and not truncated


def test_answer_tag_reads_the_last_tagged_answer():
    env = make("leg_counting", answer_tag="answer")
    env.reset(seed=2)
    _, reward, *_ = env.step(f"Counting legs... <answer>{gold('leg_counting', 2)}</answer>")
    assert reward == 1.0
    env.reset(seed=2)
    _, reward, *_ = env.step(gold("leg_counting", 2))  # the right number, but not in the tag
    assert reward == 0.0


@pytest.mark.parametrize("max_turns", [1, 3])
def test_gymnasium_env_checker_passes(max_turns):
    check_env(make("leg_counting", max_turns=max_turns).unwrapped, skip_render_check=True)


def test_unicode_questions_are_kept_as_they_are():
    env = make("propositional_logic")
    for seed in range(20):
        question, _ = env.reset(seed=seed)
        if any(c in question for c in "∧∨¬→↔"):
            break
    else:
        pytest.fail("no propositional_logic question with logic symbols in 20 seeds")
    assert question == reasoning_gym.create_dataset("propositional_logic", **DATASET_KWARGS)[seed]["question"]
    assert env.observation_space.contains(question)


def test_fork_continues_from_the_same_problem_and_turn():
    env = make("basic_arithmetic", max_turns=3).unwrapped
    env.reset(seed=4)
    env.step(WRONG)
    (fork,) = env.fork(1)
    answer = gold("basic_arithmetic", 4)
    assert fork.step(answer)[:3] == env.step(answer)[:3] == ("correct", 1.0, True)
    assert fork.sandbox is None and env.sandbox is None  # no container was ever made


def test_bad_configuration_gets_clear_errors():
    with pytest.raises(
        ValueError, match=r"dataset='leg_countin' is not a reasoning-gym dataset; did you mean"
    ):
        make("leg_countin")
    with pytest.raises(ValueError, match=r"'leg_counting' refused dataset_kwargs=.*no_such_key"):
        make("leg_counting", dataset_kwargs={"no_such_key": 1})
    env = make("leg_counting", max_observation_chars=20)
    with pytest.raises(ValueError, match="more than max_observation_chars=20"):
        env.reset(seed=0)


def test_the_hydra_config_makes_the_env():
    cfg = yaml.safe_load((ROOT / "conf" / "env" / "reasoning_gym.yaml").read_text())
    assert cfg["id"] == ENV_ID and cfg["group_start"] == "seed"  # deterministic given the seed
    env = gymnasium.make(cfg["id"], **cfg["kwargs"]).unwrapped
    assert isinstance(env, ReasoningGym) and env.dataset_name == cfg["kwargs"]["dataset"]
    first, _ = env.reset(seed=9)
    assert first == env.reset(seed=9)[0]


def test_another_generator_plugs_in_through_reasoning_gyms_registry():
    """docs/tasks.md's recipe: a `ProceduralDataset` registered with reasoning-gym is served as is."""
    from dataclasses import dataclass
    from random import Random

    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS, register_dataset

    @dataclass
    class DoubleConfig:
        seed: int | None = None
        size: int = 100
        max_value: int = 50

    class Double(ProceduralDataset):
        def __init__(self, config: DoubleConfig):
            super().__init__(config=config, seed=config.seed, size=config.size)

        def __getitem__(self, idx: int) -> dict:
            n = Random(self.seed + idx).randint(1, self.config.max_value)
            return {"question": f"What is twice {n}?", "answer": str(2 * n), "metadata": {"n": n}}

    if "k3rl_test_double" not in DATASETS:
        register_dataset("k3rl_test_double", Double, DoubleConfig)
    env = gymnasium.make(ENV_ID, dataset="k3rl_test_double", dataset_kwargs={"max_value": 9}, max_turns=2)
    question, _ = env.reset(seed=3)
    n = int(question.split()[-1].rstrip("?"))
    assert 1 <= n <= 9
    assert env.step(str(2 * n + 1))[1:3] == (0.0, False)
    assert env.step(str(2 * n))[:3] == ("correct", 1.0, True)
