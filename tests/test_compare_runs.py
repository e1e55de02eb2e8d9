"""scripts/compare_runs.py's parts: which metrics count as learned, the final weights' hash (equal tensors
hash alike, one changed value does not), and a --ref that is no commit refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from compare_runs import learned, weights_hash  # noqa: E402


def test_learned_keeps_what_training_decides_and_drops_host_figures():
    record = {"iteration": 0, "loss": 0.5, "maxvio": 0.1, "maxvio/layer1": 0.2, "maxvio_floor": 0.0,
              "success": 0.25, "elapsed_s": 3.1, "env_steps_per_s": 9.0, "sandbox_pauses": 4,
              "learner_idle_fraction": 0.3, "generate_s": 1.0, "iteration_s": 2.0,
              "generated_tokens_per_s": 500.0, "generated_tokens": 64}
    assert learned(record) == {"iteration": 0, "loss": 0.5, "maxvio": 0.1, "maxvio/layer1": 0.2,
                               "maxvio_floor": 0.0, "success": 0.25, "generated_tokens": 64}


def _checkpoint(run: Path, weights: dict[str, torch.Tensor]) -> Path:
    policy = run / "checkpoints" / "iter_2" / "policy"
    policy.mkdir(parents=True)
    (run / "checkpoints" / "iter_1" / "policy").mkdir(parents=True)  # an older one: not the one hashed
    save_file(weights, str(policy / "model.safetensors"))
    return run


def test_the_weights_hash_sees_one_changed_value(tmp_path):
    w = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    first = weights_hash(_checkpoint(tmp_path / "one", w))
    assert weights_hash(_checkpoint(tmp_path / "two", {k: v.clone() for k, v in w.items()})) == first
    changed = {k: v.clone() for k, v in w.items()}
    changed["b"][3] = 2.0
    assert weights_hash(_checkpoint(tmp_path / "three", changed)) != first


def test_a_ref_that_is_no_commit_is_refused():
    script = str(ROOT / "scripts" / "compare_runs.py")
    done = subprocess.run([sys.executable, script, "--ref", "no-such-ref-x"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--ref no-such-ref-x: not a commit of this repository" in done.stderr
