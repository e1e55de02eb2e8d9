"""What training shows about a task, on hand-made episodes (no sandbox, no Ray): the episodes cut by the
token limit or by ``max_turns``, the task's own ``Outcome.info`` numbers under its name, a failed
episode's frames in the task's file, the sample text of an episode, the run table, and pluggable
experts."""

from __future__ import annotations

import json

import pytest

from agentenv.tracebacks import describe, frames_text, is_task_file
from rl.driver.samples import actions_of, format_episode, pick
from rl.driver.trainer import failure_summary
from rl.episode import Episode, EpisodeSummary
from rl.metrics import run_table
from rl.sft.experts import ExpertError, FunctionExpert, GuessNumberExpert, expert_for, qualities
from rl.task_metrics import cut_metrics, cut_warning, info_metrics, task_name
from rl.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def outcome(cut=None, info=(), failed=False) -> EpisodeSummary:
    return EpisodeSummary(success=False, reward=0.0, turns=1, tokens=10, failed=failed, cut=cut,
                          task_info=info)


def test_task_names_come_from_the_env_id():
    assert task_name("my_tasks:my/CountFiles-v0") == "CountFiles"
    assert task_name("agentenv/GuessNumber-v0") == "GuessNumber"
    assert task_name("Plain") == "Plain"


def test_cut_episodes_are_counted_by_what_cut_them_and_failed_ones_are_left_out():
    outcomes = [outcome("tokens"), outcome("tokens"), outcome("max_turns"), outcome(),
                outcome("tokens", failed=True)]
    assert cut_metrics(outcomes) == {"episodes_cut_by_max_turns": 1.0, "episodes_cut_by_tokens": 2.0}
    assert cut_warning(outcomes, 64).startswith("2 of 4 episodes were cut by env.max_episode_tokens=64")
    assert cut_warning([outcome()], 64) is None


def test_an_episode_keeps_the_numeric_info_of_its_steps_and_the_iteration_averages_them():
    episode = Episode("x", seed=1, group=0)
    episode.record_info({"turn": 1, "success": False, "looked": True, "note": "text", "cost": 0.5})
    episode.record_info({"turn": 2, "success": True, "looked": False, "looks": 3, "bad": float("nan")})
    assert episode.task_info == {"looked": [1.0, 0.0], "cost": [0.5], "looks": [3.0]}
    first = EpisodeSummary.of(episode)
    assert dict(first.task_info) == {"cost": 0.5, "looked": 0.5, "looks": 3.0}  # per episode: mean of steps
    other = outcome(info=(("looked", 1.0),))
    failed = outcome(info=(("looked", 0.0),), failed=True)
    assert info_metrics([first, other, failed], "WordHunt") == {
        "WordHunt/cost": 0.5, "WordHunt/looked": 0.75, "WordHunt/looks": 3.0}


def _buggy_act():
    return {}["wrod"]  # a task's bug, in a file outside the platform: its frame is kept


def test_a_failed_episode_keeps_the_frames_of_the_tasks_file_and_the_summary_shows_them():
    try:
        _buggy_act()
    except KeyError as exc:
        error = exc
    assert is_task_file(__file__) and not is_task_file(json.__file__)
    assert not is_task_file(describe.__code__.co_filename)  # the platform's own files
    episode = Episode("x", seed=7, group=0)
    episode.fail(error)
    assert episode.error == "KeyError: 'wrod'" and episode.failure == "runtime_error"
    assert "test_task_metrics.py" in episode.trace and "in _buggy_act" in episode.trace
    assert 'return {}["wrod"]' in episode.trace
    assert frames_text(ValueError("no traceback")) is None
    errors = [f"seed {s}: {episode.error}\n{episode.trace}" for s in (1, 2)] + ["seed 3: OSError: gone"]
    summary = failure_summary(errors)
    assert summary.splitlines()[:2] == ["most common errors:", "  2 x KeyError: 'wrod'"]
    assert "      File " in summary and "in _buggy_act" in summary and "  1 x OSError: gone" in summary


def played() -> Episode:
    """Two turns of a GuessNumber-like game, laid out as the runner does, cut by the token limit."""
    e = Episode("agentenv/GuessNumber-v0", seed=5, group=2)
    e.observations.append("guess 0-5")
    e.append([TOK.bos_id, TOK.observation_id, *TOK.encode("guess 0-5"), TOK.end_id, TOK.action_id], False)
    e.append(TOK.encode("3"), True)
    e.append([TOK.end_id], True)
    e.step_rewards.append((len(e.tokens) - 1, 0.0))
    e.observations.append("higher 4-5")
    e.append([TOK.observation_id, *TOK.encode("higher 4-5"), TOK.end_id, TOK.action_id], False)
    e.append(TOK.encode(" 4"), True)
    e.step_rewards.append((len(e.tokens) - 1, -0.2))
    e.observations.append("lower 4-4")
    e.turns, e.cut = 2, "tokens"
    return e


def test_a_sample_shows_what_the_policy_read_and_typed_turn_by_turn():
    episode = played()
    assert actions_of(episode, TOK) == ["3", " 4"]
    text = format_episode(episode, TOK, "episode 1")
    assert text.splitlines() == [
        "--- episode 1: seed 5, group 2, reward -0.200, 2 turns, 30 tokens",
        "observation 0:", "    guess 0-5", "action 1: '3'   reward 0.000",
        "observation 1:", "    higher 4-5", "action 2: ' 4'   reward -0.200",
        "observation 2:", "    lower 4-4",
        "ended: no success, cut by env.max_episode_tokens",
    ]
    groups = [[played(), played()], [played()]]
    assert [id(e) for e in pick(groups, 3)] == [id(groups[0][0]), id(groups[1][0]), id(groups[0][1])]


def test_the_run_table_shows_the_tasks_own_metrics(tmp_path):
    (tmp_path / "resolved_config.yaml").write_text("env:\n  id: word_hunt:user/WordHunt-v0\n")
    records = [{"iteration": i, "success": 0.5, "eval_success": 0.25, "episodes_cut_by_tokens": 1.0,
                "WordHunt/looked": 0.4, "Other/x": 1.0} for i in range(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    header, *rows = run_table(tmp_path).splitlines()
    assert header.split() == ["iteration", "success", "eval_success", "episodes_cut_by_tokens",
                              "WordHunt/looked"]
    assert rows[1].split() == ["1", "0.5", "0.25", "1", "0.4"]


def look_then_answer(observation: str) -> str:
    return "1!" if observation.startswith("file") else "1"


def test_a_config_names_its_expert_a_function_or_a_class():
    expert = expert_for(f"{__name__}:look_then_answer")
    assert isinstance(expert, FunctionExpert) and expert.quality == "look_then_answer"
    expert.start("which file?")
    assert expert.act("which file?") == "1" and expert.act("file 1: gold") == "1!"
    assert qualities("rl.sft.experts:GuessNumberExpert") == ("bisection", "linear", "random_split")
    assert isinstance(expert_for("rl.sft.experts:GuessNumberExpert", "linear"), GuessNumberExpert)
    # a built-in task's env id: its expert is read from its shipped config (conf/env/*.yaml)
    assert type(expert_for("agentenv/KVLookup-v0")) is GuessNumberExpert
    with pytest.raises(ExpertError, match="env.expert: module 'rl.sft.experts' has no 'Nobody'"):
        expert_for("rl.sft.experts:Nobody")
    with pytest.raises(ExpertError, match="is neither an rl.sft.experts.Expert subclass nor a function"):
        expert_for("rl.sft.experts:KNOWN_BUGS")
    with pytest.raises(ExpertError, match="expert.quality='best' is unknown"):
        expert_for(f"{__name__}:look_then_answer", "best")
