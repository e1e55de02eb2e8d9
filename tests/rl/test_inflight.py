"""In-flight episodes across a restart (rl.rollout.inflight), with real sandboxes and the tiny K3 policy.

Runner level: a rollout recorded at a turn boundary keeps each playing episode's sandbox paused (kept by
the checkpoint folder, out of the worker's pool) while the live run goes on in forks; after the first
runner and its pool are gone, a new runner finishes the recorded episodes from their kept sandboxes,
with their earlier tokens and versions as recorded; gc closes the kept sandboxes once the folder is gone.

End to end: an async `rl.train` whose driver is SIGKILLed after a checkpoint resumes with the episodes
that checkpoint recorded (their sandboxes survived the kill) and trains on them; stopped with Ctrl-C,
the resumed run writes a checkpoint with its episodes in flight, from which the next run goes on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rl_testutil import ROOT, TINY, compose

from agentenv import Sandbox
from agentenv.gc import close_orphans
from agentenv.owner import KEEPER_LABEL, OWNER_LABEL
from agentenv.pool.pool import LABEL_POOL
from agentenv.registry import Registry
from rl.policy import build_policy
from rl.rollout.inflight import IN_FLIGHT_SUMMARY, kept_sandboxes, load_record, save_record
from rl.rollout.runner import EpisodeRunner
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.docker, pytest.mark.slow]
TOK = ByteTokenizer()


def runner_for(cfg, sandbox_config, seed: int = 0) -> EpisodeRunner:
    policy = build_policy(cfg.model, seed=seed)
    engine = TorchEngine(policy, TOK, cfg.rollout.temperature, cfg.env.action_vocabulary)
    env_cfg = replace(cfg.env, group_start="seed")
    return EpisodeRunner(env_cfg, cfg.rollout, engine, TOK, sandbox=sandbox_config)


def test_a_recorded_rollout_goes_on_after_a_restart_with_its_tokens_and_versions(sandbox_config, tmp_path):
    cfg = compose("env.kwargs.max_turns=3", "env.kwargs.num_values=9", "rollout.env_threads=4")
    keeper = tmp_path / "checkpoints" / "iter_00000"
    keeper.mkdir(parents=True)
    first = runner_for(cfg, sandbox_config)
    taken: dict = {}
    generations = []
    generate = first.engine.generate
    first.engine.generate = lambda *args: generations.append(1) or generate(*args)

    def policy_version() -> int:  # turn 2 starts: ask for a snapshot, served at the start of turn 3
        if len(generations) == 1 and "thread" not in taken:
            thread = threading.Thread(target=lambda: taken.update(r=first.snapshot(keeper, timeout_s=120)))
            thread.start()
            deadline = time.monotonic() + 10
            while first._snapshot_request is None and time.monotonic() < deadline:
                time.sleep(0.01)
            taken["thread"] = thread
        return 0

    try:
        generator = torch.Generator().manual_seed(0)
        live, stats = first.run([11, 12], 2, generator, policy_version=policy_version, tag=7)
        taken["thread"].join(timeout=120)
    finally:
        first.close()
    assert stats.failed == 0
    recorded, tag = taken["r"]
    assert tag == 7 and len(recorded) == 4
    playing = [r for r in recorded if r.playing]
    assert playing, "every episode ended within two turns: nothing was in flight"
    for r in playing:
        assert r.episode.turns == 2 and r.episode.error is None and r.sandbox_id
        kept = Sandbox.get(r.sandbox_id)
        assert kept.status == "paused", "the pool's close() must leave a kept sandbox alone"
        assert kept.labels[KEEPER_LABEL] == str(keeper.resolve())
        assert OWNER_LABEL not in kept.labels and LABEL_POOL not in kept.labels
    for r, ongoing in zip(recorded, live, strict=True):  # the live run went on from the recorded state
        assert ongoing.tokens[: len(r.episode.tokens)] == r.episode.tokens

    save_record_and_reload = _round_trip(recorded, keeper)
    second = runner_for(cfg, sandbox_config, seed=1)  # "after the restart": another pool, other weights
    try:
        done, stats = second.resume(
            save_record_and_reload, 2, torch.Generator().manual_seed(1), policy_version=lambda: 5
        )
    finally:
        second.close()
    assert stats.failed == 0 and stats.episodes == 4
    for r, episode in zip(recorded, done, strict=True):
        n = len(r.episode.tokens)
        assert episode.tokens[:n] == r.episode.tokens and episode.versions[:n] == r.episode.versions
        assert episode.logprobs[:n] == r.episode.logprobs
        if r.playing:
            assert episode.turns == 3 and set(episode.versions[n:]) == {5}  # went on with the new weights
        else:
            assert episode.tokens == r.episode.tokens and episode.turns == r.episode.turns
    for r in playing:  # restored by a fork: the kept sandbox can be resumed again
        assert Sandbox.get(r.sandbox_id).status == "paused"

    for name in os.listdir(keeper):
        (keeper / name).unlink()
    keeper.rmdir()
    closed = close_orphans()
    assert {r.sandbox_id for r in playing} <= set(closed)


def _round_trip(recorded, folder: Path):
    """The episodes as a restarted process reads them: through the checkpoint's files."""
    from rl.rollout.inflight import InFlightRecord, InFlightRollout

    record = InFlightRecord(version=0, group_size=2, rollouts=[InFlightRollout(7, "127.0.0.1", 2, recorded)])
    save_record(record, folder)
    summary = json.loads((folder / IN_FLIGHT_SUMMARY).read_text())
    assert summary["rollouts"][0]["kept_sandboxes"] == [r.sandbox_id for r in recorded if r.sandbox_id]
    return load_record(folder).rollouts[0].episodes


ASYNC = (
    *TINY,
    "trainer.mode=async",
    "env.kwargs.max_turns=3",
    "env.kwargs.num_values=9",
    "rollout.policy_latency_s=0.3",  # turns long enough that a checkpoint finds episodes mid-game
    "trainer.preflight=false",  # three starts of one task: its probe is tests/rl/test_task_failures.py's
)


def train(ray_address: str, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`python -m rl.train` as a user starts it, joining the session's local Ray (its actors die with it)."""
    cmd = [sys.executable, "-m", "rl.train", *ASYNC, *overrides, f"trainer.ray_address={ray_address}",
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=interruptible
    )


def interruptible() -> None:
    """SIGINT as at a terminal: a shell without job control (CI) starts background jobs with it ignored,
    and Python raises KeyboardInterrupt only when SIGINT was not ignored at its start."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def while_running(driver: subprocess.Popen, check, timeout_s: float = 300, every_s: float = 0.2):
    """The first truthy value of ``check()``, polled while the driver runs (None: it ended, or
    ``timeout_s`` passed, first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and driver.poll() is None:
        if value := check():
            return value
        time.sleep(every_s)
    return None


def wait_for_playing_checkpoint(driver: subprocess.Popen, run_dir: Path) -> Path | None:
    """The summary of the first checkpoint that kept playing episodes (None: the driver ended first)."""

    def playing() -> Path | None:
        found = sorted((run_dir / "checkpoints").glob(f"iter_*/{IN_FLIGHT_SUMMARY}"))
        if found and any(r["playing"] for r in json.loads(found[-1].read_text())["rollouts"]):
            return found[-1]
        return None

    return while_running(driver, playing)


def wait_for_iterations(driver: subprocess.Popen, run_dir: Path, after: int, count: int) -> None:
    """Until the run's metrics hold ``count`` iterations numbered above ``after``."""
    metrics = run_dir / "metrics.jsonl"

    def enough() -> bool:
        logged = []
        for line in metrics.read_text().splitlines() if metrics.exists() else []:
            try:
                logged.append(json.loads(line)["iteration"])
            except ValueError:  # the line being written
                break
        return sum(i > after for i in logged) >= count

    while_running(driver, enough)


def wait_for_file(driver: subprocess.Popen, path: Path) -> bool:
    """Whether ``path`` appears (within 120 s, while the driver runs)."""
    return bool(while_running(driver, path.exists, timeout_s=120, every_s=0.05)) or path.exists()


def checkpoint_iteration(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "trainer_state.json").read_text())["iteration"])


def stopped(driver: subprocess.Popen) -> None:
    if driver.poll() is None:
        driver.kill()
    driver.wait(timeout=60)


def assert_went_on_with(run_dir: Path, checkpoint: Path, kept: list[str], iterations: int) -> None:
    """The run in ``run_dir``, resumed from ``checkpoint``, continued its episodes in flight (their kept
    sandboxes restored by forks), trained on them within ``iterations`` new iterations without a failed
    episode, and closed the kept sandboxes once it wrote a newer checkpoint."""
    done = checkpoint_iteration(checkpoint)
    log = (run_dir / "train.log").read_text()
    assert re.search(r"continuing \d+ episodes in flight \([1-9]\d* playing\)", log), log[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    new = [r for r in map(json.loads, lines) if r["iteration"] > done]
    assert len(new) == iterations
    assert sum(r["continued_episodes"] for r in new) > 0, "the recorded episodes were not trained on"
    assert all(r["failed_episodes"] == 0 for r in new)
    registry = Registry(Path(os.environ["AGENTENV_HOME"]))
    rows = registry.list_sandboxes(include_closed=True)
    assert set(kept) <= {r.parent_id for r in rows}, "the kept sandboxes were not restored"
    assert all(registry.get_sandbox(sid).state == "closed" for sid in kept), (
        "a newer checkpoint must close the sandboxes the older one kept"
    )
    assert not (checkpoint / IN_FLIGHT_SUMMARY).exists()


def test_an_async_run_killed_then_interrupted_resumes_each_time_with_its_episodes_in_flight(local_ray,
                                                                                           tmp_path):
    """SIGKILL after a periodic checkpoint; the resumed run (no periodic checkpoints) is stopped with
    Ctrl-C (SIGINT) and writes one with its episodes in flight as it stops; the run resumed from that
    one finishes. Each restart goes on with the episodes its checkpoint recorded."""
    hold = tmp_path / "hold"  # its HoldsMidGame keeps an episode mid-game while the Ctrl-C lands
    holds = f"env.wrappers=[{{cls: 'user_wrappers:HoldsMidGame', kwargs: {{flag: '{hold}', hold_s: 3.0}}}}]"
    killed = train(local_ray, tmp_path / "run", holds, "trainer.iterations=50", "trainer.checkpoint_every=1")
    try:
        summary = wait_for_playing_checkpoint(killed, tmp_path / "run")
        assert summary is not None, f"no checkpoint kept episodes: {killed.stderr.read1()[-3000:]!r}"
        killed.send_signal(signal.SIGKILL)
    finally:
        stopped(killed)
    first = summary.parent
    kept = kept_sandboxes(first)
    assert kept and all(Sandbox.get(sid).status == "paused" for sid in kept), "the kill took kept sandboxes"

    interrupted = train(local_ray, tmp_path / "resumed", holds, "trainer.iterations=50",
                        "trainer.checkpoint_every=0", f"trainer.resume={first}")
    try:
        wait_for_iterations(interrupted, tmp_path / "resumed", checkpoint_iteration(first), 1)
        hold.touch()
        assert wait_for_file(interrupted, hold.with_name("hold.held")), interrupted.stderr.read1()[-3000:]
        interrupted.send_signal(signal.SIGINT)
        hold.unlink()
        assert interrupted.wait(timeout=300) == 130, interrupted.stderr.read()[-3000:]
    finally:
        stopped(interrupted)
    summaries = sorted((tmp_path / "resumed" / "checkpoints").glob(f"iter_*/{IN_FLIGHT_SUMMARY}"))
    assert len(summaries) == 1, "Ctrl-C must write one checkpoint with the episodes in flight"
    second = summaries[0].parent
    new_iterations = checkpoint_iteration(second) - checkpoint_iteration(first)
    assert_went_on_with(tmp_path / "resumed", first, kept, new_iterations)
    kept_again = kept_sandboxes(second)
    assert kept_again and all(Sandbox.get(sid).status == "paused" for sid in kept_again)

    # One iteration more finishes the run: the recorded episodes go first (their finished groups are
    # queued before any new call, and each recorded call is the first its worker plays), as the one
    # iteration before the Ctrl-C showed; the checkpoint at the end of the run closes what second kept.
    done = checkpoint_iteration(second)
    finished = train(local_ray, tmp_path / "finished", holds, f"trainer.iterations={done + 2}",
                     f"trainer.resume={second}")
    _, err = finished.communicate(timeout=600)
    assert finished.returncode == 0, err[-5000:].decode()
    assert_went_on_with(tmp_path / "finished", second, kept_again, 1)
