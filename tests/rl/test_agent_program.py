"""Agent-program tasks (`agentenv.tasks.agent_program`, `rl.rollout.programs`): the program in the sandbox
plays GuessNumber through the runner's gateway; its calls become the episode's tokens exactly as captured,
the verifier's reward is the game's, a crash or a hang fails the episode, and a bad config names its key.
Real sandboxes and the tiny policy."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import gymnasium
import pytest
import torch
from rl_testutil import ROOT, compose

import agentenv.tasks  # noqa: F401  (registers the tasks)
from agentenv import Sandbox
from agentenv.errors import ConfigError
from rl.policy import build_policy
from rl.rollout.runner import EpisodeRunner
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]
TOK = ByteTokenizer()
ENV = "agentenv/AgentProgram-v0"
NUMBER = re.compile(r"\d+")


@pytest.fixture(scope="module")
def policy():
    return build_policy(compose().model, seed=0)


def make_runner(policy, sandbox_config, **program) -> EpisodeRunner:
    """A runner on env=agent_guess_number, its ``program`` keys changed as given."""
    cfg = compose("env=agent_guess_number", "rollout.env_threads=4")
    kwargs = copy.deepcopy(cfg.env.kwargs)
    kwargs["program"].update(program)
    env_cfg = replace(cfg.env, kwargs=kwargs)
    engine = TorchEngine(policy, TOK, action_vocabulary=env_cfg.action_vocabulary)
    return EpisodeRunner(env_cfg, cfg.rollout, engine, TOK, sandbox=sandbox_config)


def kept_records(runner: EpisodeRunner) -> list:
    """Every episode record the runner's gateway hands back when a key closes, as it is handed back."""
    keys = runner.programs._link().gateway.keys
    records, close = [], keys.close

    def closing(key):
        records.append(close(key))
        return records[-1]

    keys.close = closing
    return records


def record_of(records: list, episode):
    """The gateway's record of ``episode``: its last call's prompt and completion are the episode's tokens
    and its calls' log-probs the episode's action log-probs (two members that played alike match both)."""
    actions = [lp for lp, m in zip(episode.logprobs, episode.action_mask, strict=True) if m]
    for record in records:
        last = record.calls[-1]
        if last.prompt_ids + last.completion_ids == episode.tokens and \
                [lp for call in record.calls for lp in call.logprobs] == actions:
            return record
    raise AssertionError(f"no captured record gives the tokens of episode {episode.seed}: {episode.tokens}")


def game_reward(seed: int, completions: list[list[int]]) -> tuple[float, bool]:
    """GuessNumber's own summed reward for the guesses the program made of ``completions``."""
    env = gymnasium.make("agentenv/GuessNumber-v0", num_values=6, max_turns=3, invalid_penalty=0.1,
                         ruled_out_penalty=0.2, sandbox={"memory": "128m"})
    try:
        env.reset(seed=seed)
        total, success = 0.0, False
        for ids in completions:
            match = NUMBER.search(TOK.decode(ids))
            _, reward, terminated, _, info = env.step(match.group(0) if match else "")
            total, success = total + reward, success or info["success"]
            if terminated:
                break
        return total, success
    finally:
        env.close()


@pytest.fixture(scope="module")
def played(policy, sandbox_config):
    """Two groups of two agent_guess_number episodes, the gateway's records of them, and the stats."""
    runner = make_runner(policy, sandbox_config)
    records = kept_records(runner)
    try:
        episodes, stats = runner.run([7, 8], group_size=2, generator=torch.Generator().manual_seed(0),
                                     policy_version=lambda: 3)
    finally:
        runner.close()
    return episodes, records, stats


@pytest.mark.docker
def test_every_call_of_the_program_becomes_the_episode_tokens_as_captured(played):
    episodes, records, stats = played
    assert len(episodes) == 4 and stats.failed == 0, stats.errors
    assert len(records) == 4 and all(r.calls for r in records)
    for episode in episodes:
        record = record_of(records, episode)
        calls = record.calls
        assert episode.tokens[:2] == [TOK.bos_id, TOK.observation_id]
        assert TOK.decode(episode.tokens).startswith("guess 0-5")
        assert episode.turns == len(calls) <= 3 and episode.task_info["untrained_calls"] == [0.0]
        assert len(episode.tokens) == len(episode.action_mask) == len(episode.logprobs)
        assert len(episode.versions) == len(episode.tokens)
        # each call's prompt extends the last: its new tokens are observations, its completion actions
        position = 0
        for call in calls:
            new = len(call.prompt_ids) - position
            assert episode.tokens[position : len(call.prompt_ids)] == call.prompt_ids[position:]
            assert episode.action_mask[position : len(call.prompt_ids)] == [0] * new
            assert episode.logprobs[position : len(call.prompt_ids)] == [0.0] * new
            position = len(call.prompt_ids)
            end = position + len(call.completion_ids)
            assert episode.tokens[position:end] == call.completion_ids
            assert episode.action_mask[position:end] == [1] * len(call.completion_ids)
            assert episode.logprobs[position:end] == call.logprobs  # the sampling log-probs, as captured
            assert set(TOK.decode(call.completion_ids)) <= set("0123456789")  # env.action_vocabulary
            position = end
        assert position == len(episode.tokens)
        assert set(episode.versions) == {3} and {c.version for c in calls} == {3}


@pytest.mark.docker
def test_the_verifiers_reward_is_the_games(played, sandbox_config):
    episodes, records, _ = played
    for episode in episodes:
        record = record_of(records, episode)
        reward, success = game_reward(episode.seed, [c.completion_ids for c in record.calls])
        assert episode.reward == pytest.approx(reward) and episode.success == success
        last_action = max(i for i, m in enumerate(episode.action_mask) if m)
        assert episode.step_rewards == [(last_action, pytest.approx(reward))]
        assert episode.task_info["plays"] == [float(len(record.calls))]


@pytest.mark.docker
@pytest.mark.parametrize(
    ("program", "kind", "error", "calls"),
    [
        ({"command": "python3 -S /workspace/agent.py --turns 1 && exit 7"}, "runtime_error", "exited 7", 1),
        ({"command": "python3 -S /workspace/agent.py --turns 1 && sleep 60", "timeout_s": 3}, "exec_timeout",
         "timeout", 1),
        ({"command": "true"}, "runtime_error", "without calling the policy", 0),
    ],
    ids=["crash", "hang", "no-call"],
)
def test_a_program_that_crashes_or_hangs_fails_its_episode(policy, sandbox_config, program, kind, error,
                                                           calls):
    runner = make_runner(policy, sandbox_config, **program)
    try:
        (episode,), stats = runner.run([5], group_size=1, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert stats.failed == 1 and episode.failure == kind and error in episode.error, episode.error
    assert episode.weight == 0.0  # out of the loss, not a zero reward
    assert episode.turns == calls and (sum(episode.action_mask) >= 1) == bool(calls)  # kept to inspect


def test_bad_task_config_names_its_key():
    verifier = {"function": "agentenv.tasks.agent_guess_number:verify"}
    program = {"command": "true"}
    with pytest.raises(ConfigError, match=r"program\.command"):
        gymnasium.make(ENV, program={"files": {}}, verifier=verifier)
    with pytest.raises(ConfigError, match=r"verifier\.function: agentenv.tasks.agent_guess_number has no "):
        gymnasium.make(ENV, program=program, verifier={"function": "agentenv.tasks.agent_guess_number:nope"})
    with pytest.raises(ConfigError, match=r"verifier\.function: cannot import module 'no_such_module'"):
        gymnasium.make(ENV, program=program, verifier={"function": "no_such_module:verify"})
    with pytest.raises(ConfigError, match=r"verifier: give exactly one of"):
        gymnasium.make(ENV, program=program, verifier={"kwargs": {}})
    with pytest.raises(ConfigError, match=r"verifier: unknown key\(s\) \['functoin'\]"):
        gymnasium.make(ENV, program=program, verifier={"functoin": "m:f"})
    with pytest.raises(ConfigError, match=r"program\.files\./workspace/a\.py: no file"):
        gymnasium.make(ENV, program={**program, "files": {"/workspace/a.py": "./missing/a.py"}},
                       verifier=verifier)


@pytest.mark.docker
@pytest.mark.slow
def test_rl_train_agent_guess_number_trains_in_async_mode(local_ray, tmp_path):
    """One run of the trainer's async mode, where programs call an engine whose weights change under them
    (the sync driver plays the same runner, which the tests above drive): their calls train the policy."""
    run_dir = tmp_path / "run"
    mode = ("trainer.mode=async", "trainer.iterations=2", "trainer.eval_every=0")
    trained = subprocess.run(
        [sys.executable, "-m", "rl.train", "env=agent_guess_number", "preset=short", *mode,
         "sandbox.memory=128m", "sandbox.pids_limit=64", f"trainer.ray_address={local_ray}",
         f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "pre-flight check of agentenv/AgentProgram-v0 passed" in trained.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == int(mode[1].rsplit("=", 1)[1])
    for record in records:
        assert record["failed_episodes"] == 0 and record["episodes"] >= 8 and record["episode_tokens"] > 0
        assert record["AgentProgram/plays"] >= 1 and record["AgentProgram/untrained_calls"] == 0
        # the gateway's engine time is the generation time: tokens/s of the engine, not of no time at all
        assert record["generate_s"] > 0 and 0 < record["generated_tokens_per_s"] < 1e5
    assert records[-1]["weights_version"] >= 1  # trained on the programs' calls


@pytest.mark.docker
@pytest.mark.parametrize("fork", [True, False])
def test_a_command_verifier_scores_the_final_state_in_a_fork_when_asked(sandbox_config, fork, monkeypatch):
    env = gymnasium.make(
        ENV, program={"command": "echo $AGENT_TASK > answer.txt", "setup": "echo 4.5 {seed}"},
        verifier={"command": "touch verifier_was_here && cut -d' ' -f1 answer.txt", "fork": fork},
        sandbox={"config": sandbox_config},
    )
    try:
        assert env.reset(seed=11)[0] == "4.5 11"
        execs, exec_ = [], Sandbox.exec
        monkeypatch.setattr(Sandbox, "exec", lambda sb, *a, **k: execs.append(sb.id) or exec_(sb, *a, **k))
        _, reward, terminated, _, info = env.step(json.dumps({"UNUSED": "1"}))
        monkeypatch.undo()
        assert (reward, terminated, info["success"]) == (4.5, True, True)
        # the program and, where the agent played, the verifier run in the episode's shell session: a new
        # exec only in the fork
        assert (env.unwrapped.sandbox.id not in execs and len(execs) == 1) if fork else execs == []
        seen = env.unwrapped.run("test -e verifier_was_here && echo seen || echo unseen").output.strip()
        assert seen == ("unseen" if fork else "seen")  # in a fork, nothing the verifier did stays
    finally:
        env.close()


@pytest.mark.docker
@pytest.mark.parametrize("in_place", [True, False])
def test_a_program_task_reuses_its_sandbox_only_when_its_config_says_why(sandbox_config, in_place):
    """A setup that restarts the game and clears the log of plays, so with ``in_place_reset`` the second
    episode plays in the first one's sandbox and its verdict holds only its own plays."""
    example = compose("env=agent_guess_number").env.kwargs
    program = {**example["program"], "command": "/workspace/play.sh 0 && /workspace/play.sh 0",
               "setup": "/workspace/guess.sh new {seed} 6 && rm -f /workspace/.plays"}
    program.pop("in_place_reset", None)  # the example's own claim
    if in_place:
        program["in_place_reset"] = "the program plays two fixed guesses; setup restarts the game and its log"
    env = gymnasium.make(ENV, program=program, verifier=example["verifier"],
                         sandbox={"config": sandbox_config})
    try:
        sandboxes, plays = [], []
        for seed in (3, 4):
            env.reset(seed=seed)
            sandboxes.append(env.unwrapped.sandbox.id)
            _, _, _, _, info = env.step(json.dumps({"UNUSED": "1"}))
            plays.append(info["plays"])
        assert plays == [2.0, 2.0]  # each episode's own two plays, never the earlier one's too
        assert (sandboxes[0] == sandboxes[1]) == in_place
    finally:
        env.close()
    with pytest.raises(ConfigError, match=r"program.in_place_reset: say why setup alone restores"):
        gymnasium.make(ENV, program={**program, "in_place_reset": ""}, verifier=example["verifier"])


def test_the_example_program_reads_a_guess_from_its_text_or_its_tool_call():
    from agentenv.tasks.programs.guess_agent import guess_of

    assert guess_of({"content": "maybe 042 or 5"}) == ("42", None)
    assert guess_of({"content": "no idea"}) == ("x", None)
    call = {"id": "call_1", "type": "function", "function": {"name": "guess", "arguments": '{"number": 3}'}}
    assert guess_of({"content": "", "tool_calls": [call]}) == ("3", call)
    bad = {**call, "function": {"name": "guess", "arguments": '{"number": "three"}'}}
    assert guess_of({"content": "7", "tool_calls": [bad]}) == ("x", bad)


def test_the_example_programs_client_posts_json_and_reads_the_status_and_body():
    """`guess_agent.post` (a plain socket, HTTP/1.0) against a loopback server: the request's path, key and
    JSON arrive, a 200's body and a 401's status come back, and an answer that is not HTTP or a URL that is
    not http:// ends the program with a message, not a traceback."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agentenv.tasks.programs.guess_agent import post

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers["Authorization"], json.loads(body)))
            status = 200 if self.headers["Authorization"] == "Bearer good" else 401
            answer = json.dumps({"ok": status == 200}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1/chat/completions"
        assert post(url, {"messages": ["é"]}, "good") == (200, b'{"ok": true}')
        assert post(url, {}, "bad") == (401, b'{"ok": false}')
        assert seen[0] == ("/v1/chat/completions", "Bearer good", {"messages": ["é"]})
        with pytest.raises(SystemExit, match="must be an http:// URL"):
            post("https://127.0.0.1/v1", {}, "good")
    finally:
        server.shutdown()
        server.server_close()
    with socket_server(b"SSH-2.0-not-http\r\n") as port, pytest.raises(SystemExit, match="not HTTP"):
        post(f"http://127.0.0.1:{port}/v1", {}, "good")


@contextlib.contextmanager
def socket_server(answer: bytes):
    """A loopback port whose one connection gets ``answer`` and is closed."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        thread.join(timeout=10)
        listener.close()


@pytest.mark.docker
def test_an_in_flight_checkpoint_is_taken_between_waves_and_resumes(policy, sandbox_config, tmp_path):
    """One group per wave (max_concurrent_episodes): a snapshot asked for while the first wave's programs
    run is answered when they end; a new runner resumes it, keeping the first group and playing the
    second. The policy version read before each wave is the one its calls record (async weight swaps)."""
    runner = make_runner(policy, sandbox_config)
    runner.max_concurrent_episodes = 2
    asked, taken = threading.Event(), {}

    def snapshot() -> None:
        taken["record"] = runner.snapshot(tmp_path / "keeper", timeout_s=120)

    def policy_version() -> int:  # called before each wave's programs start: 5, then 6 once one ended
        version = 6 if any(e.tokens for e in runner._run_episodes) else 5
        if not asked.is_set():  # the first wave: ask for a snapshot now, from another thread
            asked.set()
            threading.Thread(target=snapshot, daemon=True).start()
            deadline = time.monotonic() + 30
            while runner._snapshot_request is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return version

    try:
        episodes, stats = runner.run([3, 4], group_size=2, generator=torch.Generator().manual_seed(0),
                                     policy_version=policy_version, tag="call-1")
    finally:
        runner.close()
    assert stats.failed == 0 and stats.waves == 2, stats.errors
    assert [set(e.versions) for e in episodes] == [{5}, {5}, {6}, {6}]
    recorded, tag = taken["record"]
    assert tag == "call-1" and not any(r.playing for r in recorded)
    assert [bool(r.episode.tokens) for r in recorded] == [True, True, False, False]  # between the waves
    assert [r.episode.tokens for r in recorded[:2]] == [e.tokens for e in episodes[:2]]

    again = make_runner(policy, sandbox_config)
    try:
        resumed, stats = again.resume(recorded, 2, torch.Generator().manual_seed(0), lambda: 7, tag="call-1")
    finally:
        again.close()
    assert stats.failed == 0 and stats.waves == 1, stats.errors
    assert [e.tokens for e in resumed[:2]] == [e.tokens for e in episodes[:2]]  # as recorded
    assert all(e.tokens and set(e.versions) == {7} for e in resumed[2:])  # played after the restart
    assert [e.seed for e in resumed] == [3, 3, 4, 4] and [e.group for e in resumed] == [0, 0, 1, 1]


@pytest.mark.docker
def test_a_program_task_refuses_branching_rollouts(policy, sandbox_config):
    from rl.config.schema import TreeRolloutConfig

    cfg = compose("env=agent_guess_number")
    rollout = replace(cfg.rollout, tree=TreeRolloutConfig(branch_at=[1], width=2, depth=1, budget=2))
    engine = TorchEngine(policy, TOK, action_vocabulary=cfg.env.action_vocabulary)
    with pytest.raises(ConfigError, match=r"rollout\.tree: agentenv/AgentProgram-v0 is played by an agent"):
        EpisodeRunner(cfg.env, rollout, engine, TOK, sandbox=sandbox_config)


def test_a_program_that_rewrites_its_history_trains_its_longest_sample():
    from rl.episode import Episode
    from rl.rollout.gateway.capture import CallRecord, EpisodeRecord
    from rl.rollout.programs import program_episode

    def call(prompt, completion, version=1):
        return CallRecord(prompt, completion, [-0.5] * len(completion), version, None, True)

    record = EpisodeRecord("k", [
        call([1, 2], [3]),
        call([1, 2, 3, 4], [5, 6]),  # extends the first
        call([9, 2], [7]),  # a rewritten history: a sample of its own, shorter
    ])
    episode = Episode(ENV, seed=4, group=1)
    assert program_episode(episode, record, reward=0.5) == 2
    assert episode.tokens == [1, 2, 3, 4, 5, 6] and episode.action_mask == [0, 0, 1, 0, 1, 1]
    assert episode.logprobs == [0.0, 0.0, -0.5, 0.0, -0.5, -0.5] and episode.step_rewards == [(5, 0.5)]
    assert episode.turns == 2 and episode.task_info == {"calls": [3.0], "untrained_calls": [1.0]}
    assert program_episode(Episode(ENV, seed=4, group=1), EpisodeRecord("k", []), reward=1.0) == 0
