"""`python -m rl.train` with `AGENTENV_BACKEND=microvm`: the tiny run trains an iteration with every
episode's sandbox a QEMU microVM (its own Ray: the session's Ray workers carry the session's backend), and
leaves none of them behind."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest
from rl_testutil import ROOT, TINY

sys.path.insert(0, str(ROOT / "tests" / "agentenv"))
from microvm_env import backend_config, remove_vms  # noqa: E402

pytestmark = pytest.mark.docker


def test_the_trainer_runs_on_microvm_sandboxes(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "AGENTENV_HOME": str(home), "AGENTENV_BACKEND": "microvm",
           "AGENTENV_BACKEND_CONFIG": str(backend_config(tmp_path))}
    try:
        # one group of two episodes (TINY's two groups only double the TCG guests' work) in one minibatch
        r = subprocess.run([sys.executable, "-m", "rl.train", *TINY, "trainer.iterations=1",
                            "algo.episodes_per_step=2", "algo.minibatches=1", "trainer.tensorboard=false",
                            f"hydra.run.dir={tmp_path / 'run'}"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [h["iteration"] for h in history] == [0] and history[0]["weights_version"] == 1
        assert all(h["failed_episodes"] == 0 for h in history), history
        with sqlite3.connect(home / "registry.sqlite3") as conn:
            rows = conn.execute("SELECT state, container FROM sandboxes").fetchall()
        assert rows and all(c.startswith("vm-") for _s, c in rows), rows  # every sandbox was a microVM
        assert {s for s, _c in rows} == {"closed"}, rows
    finally:
        assert remove_vms(home) == []  # the run closed them all
