"""`rl.policy`: the rollout workers' empty shell of the policy draws nothing from the RNG, skips the init
(no ``torch._dynamo`` import, which initialising on the meta device costs), and once loaded computes
exactly what the policy it was loaded from computes."""

import subprocess
import sys

import torch
from rl_testutil import ROOT, TINY, compose

from rl.policy import build_policy, build_policy_shell


def test_a_loaded_shell_equals_its_source_and_the_rng_is_untouched():
    cfg = compose(*TINY).model
    before = torch.random.get_rng_state()
    shell = build_policy_shell(cfg)
    assert torch.equal(before, torch.random.get_rng_state())
    source = build_policy(cfg, seed=3)
    shell.load_state_dict(source.state_dict())
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(shell(tokens).logits, source(tokens).logits)


def test_building_a_shell_does_not_import_dynamo():
    code = ("import sys; sys.path.insert(0, 'tests/rl'); from rl_testutil import TINY, compose; "
            "from rl.policy import build_policy_shell; build_policy_shell(compose(*TINY).model); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
