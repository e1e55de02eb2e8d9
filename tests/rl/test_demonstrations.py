"""Scripted experts and `rl.sft.demonstrations`: episodes played in real sandboxes, written to JSONL in the
RL loop's token layout, read back, and the experts' skill (bisection always wins GuessNumber)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from agentenv.tasks.fix_code import PROBLEMS, problem_index
from rl.config import ConfigError
from rl.sft.demonstrations import Demonstration, DemonstrationError, read_demonstrations, run_demonstrations
from rl.sft.experts import ExpertError, expert_for, qualities
from rl.tokenizer import ByteTokenizer, Tokenizer

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
SMALL_SANDBOX = ("sandbox.memory=128m", "sandbox.pids_limit=64")


def demonstrations(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, dict]:
    """Run the command's code on conf/demonstrations.yaml with ``overrides``; (file, summary)."""
    out = tmp_path / f"{name}.jsonl"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("demonstrations", overrides=[*SMALL_SANDBOX, f"out={out}", *overrides])
    return run_demonstrations(cfg)


def assert_rl_layout(demo: Demonstration, tok: Tokenizer) -> None:
    """``demo``'s tokens and mask are exactly what rl.rollout.runner writes for its observations and actions:
    turn tokens and observations with mask 0, each action and its closing end token with mask 1."""
    ep = demo.episode
    tokens, mask = [tok.bos_id], [0]
    rewards_at = []
    for turn, observation in enumerate(ep.observations[:-1]):
        head = [tok.observation_id, *tok.encode(observation), tok.end_id, tok.action_id]
        action = [*tok.encode(demo.actions[turn]), tok.end_id]
        tokens += head + action
        mask += [0] * len(head) + [1] * len(action)
        rewards_at.append(len(tokens) - 1)
    assert ep.tokens == tokens and ep.action_mask == mask
    assert [i for i, _ in ep.step_rewards] == rewards_at and len(ep.logprobs) == len(tokens)
    # decoding the masked runs gives back the actions, the unmasked runs the observations
    runs, current, trained = [], [], None
    for token, m in zip(ep.tokens, ep.action_mask, strict=True):
        if m != trained and current:
            runs.append((trained, tok.decode(current)))
            current = []
        trained = m
        current.append(token)
    runs.append((trained, tok.decode(current)))
    assert [text for m, text in runs if m] == demo.actions
    assert [text for m, text in runs if not m] == ep.observations[:-1]


def test_bisection_writes_rl_episodes_that_always_win(task_home, tmp_path):
    out, summary = demonstrations(tmp_path, "bisection", "expert.quality=bisection", "num_episodes=12")
    demos = read_demonstrations(out)
    assert len(demos) == 12 and summary["success_rate"] == 1.0
    tok = ByteTokenizer()
    for demo in demos:
        assert demo.expert == "bisection" and demo.tokenizer == "bytes"
        assert demo.episode.success and demo.reward == 1.0 and demo.episode.error is None
        assert demo.episode.observations[-1] == "correct" and 1 <= demo.episode.turns <= 3
        assert_rl_layout(demo, tok)
        assert demo.episode.versions == [0] * len(demo.episode.tokens)  # an expert's play: no policy version
    assert len({d.episode.seed for d in demos}) == 12


@pytest.mark.parametrize("quality", ["linear", "random_split"])
def test_weaker_experts_win_less_often(task_home, tmp_path, quality):
    out, summary = demonstrations(tmp_path, quality, f"expert.quality={quality}", "num_episodes=16")
    assert 0.0 < summary["success_rate"] < 1.0
    for demo in read_demonstrations(out):
        assert_rl_layout(demo, ByteTokenizer())
    if quality == "random_split":  # the expert's own randomness is seeded too: same seed, same file
        again, _ = demonstrations(tmp_path, "again", f"expert.quality={quality}", "num_episodes=16")
        assert out.read_text() == again.read_text()


def test_actions_the_policy_could_not_generate_are_refused(task_home, tmp_path):
    """32 numbers need two-digit actions: 3 tokens with the end token, over max_new_tokens=2."""
    with pytest.raises(
        DemonstrationError, match="more than env.max_new_tokens=2; raise env.max_new_tokens to 3"
    ):
        demonstrations(
            tmp_path, "wide", "env.kwargs.num_values=32", "env.kwargs.max_turns=6", "num_episodes=4"
        )
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_an_existing_file_is_kept_unless_overwrite(task_home, tmp_path):
    out = tmp_path / "kept.jsonl"
    out.write_text("precious\n")
    with pytest.raises(DemonstrationError, match="exists; choose another path or pass overwrite=true"):
        demonstrations(tmp_path, "kept", "num_episodes=2")
    assert out.read_text() == "precious\n"
    demonstrations(tmp_path, "kept", "num_episodes=2", "overwrite=true")
    assert len(read_demonstrations(out)) == 2


def test_no_sandbox_backend_stops_the_command_without_a_file(tmp_path):
    """With no Docker daemon at $DOCKER_HOST the command fails naming it, instead of writing a file of
    episodes that all failed."""
    out = tmp_path / "none.jsonl"
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/none.sock"}
    proc = subprocess.run(
        [sys.executable, "-m", "rl.sft.demonstrations", *SMALL_SANDBOX, "num_episodes=3", f"out={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "k3rl-demonstrations: no sandbox could be started: no Docker daemon answers" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_unknown_quality_is_a_config_error_naming_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"expert.quality='optimal' is unknown .*\['bisection', 'linear'"):
        demonstrations(tmp_path, "x", "expert.quality=optimal")
    with pytest.raises(ExpertError, match="no scripted expert for task 'agentenv/ReasoningGym-v0'"):
        expert_for("agentenv/ReasoningGym-v0")


def play(env, expert, seed: int) -> tuple[float, bool]:
    observation, _ = env.reset(seed=seed)
    expert.start(observation)
    total = 0.0
    while True:
        observation, reward, terminated, truncated, info = env.step(expert.act(observation))
        total += reward
        if terminated or truncated:
            return total, info["success"]


def test_find_value_experts(make_task):
    env = make_task("agentenv/FindValue-v0")
    assert qualities("agentenv/FindValue-v0") == ("grep", "wasteful")
    grep = [play(env, expert_for("agentenv/FindValue-v0", "grep"), seed) for seed in range(4)]
    assert grep == [(1.0, True)] * 4
    wasteful = [play(env, expert_for("agentenv/FindValue-v0", "wasteful"), seed) for seed in range(6)]
    assert 0 < sum(won for _, won in wasteful) < 6  # out of turns when the value sits in a late file


def test_fix_code_experts_on_every_problem(make_task):
    env = make_task("agentenv/FixCode-v0")
    for p in range(len(PROBLEMS)):
        seed = next(s for s in range(200) if problem_index(s) == p)
        assert play(env, expert_for("agentenv/FixCode-v0", "fix"), seed) == (1.0, True), PROBLEMS[p][0]
        partial, won = play(env, expert_for("agentenv/FixCode-v0", "partial_fix"), seed)
        assert 0.0 < partial < 1.0 and not won, PROBLEMS[p][0]
