"""`rl.learner.checkpoint_convert`: checkpoints of the earlier layout (``learner.pt`` with AdamW's state by
parameter index and every expert three parameters of its own; a sharded learner's ``shards/rank{r}.pt``
with flat fp32 slices) become distributed checkpoints holding the same weights, moments, value head,
reference, schedule and counters. The old files are written here from a trained learner's state, laid
out as the earlier learner laid them out (its parameter order: expert after expert, w1 w3 w2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rl_testutil import compose
from test_learner_ranks import episodes

from model.moe import stacked_slot
from rl.learner.checkpoint_convert import convert, old_parameter_order
from rl.learner.learner import Learner
from rl.learner.shard_checkpoint import read_learner_state, rng_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = ("algo=ppo", "algo.group_size=2", "algo.episodes_per_step=8", "algo.kl_coef=0.1",
       "trainer.learner_threads=1")


def old_state(learner: Learner, saved: dict) -> tuple[list[str], dict[str, dict[str, torch.Tensor]], dict]:
    """The learner's AdamW state (``saved``: its checkpoint) as the earlier learner kept it: per old
    parameter name (an expert's weight one row of the stacked one), in the old order; its param group."""
    order = old_parameter_order(learner.model, value_head=True)
    moments = {}
    for name in order:
        target, index = stacked_slot(name)
        full = saved["optimizer"][target if target.startswith("value_head.") else "policy." + target]
        moments[name] = {k: (v if index is None or k == "step" else v[index]).clone()
                         for k, v in full.items()}  # fmt: skip
    group = {k: v for k, v in learner.optimizer.param_groups[0].items() if k != "params"}
    return order, moments, group


def trained(tmp_path: Path) -> tuple[Learner, Path, dict]:
    """A PPO learner (value head, KL reference) after one batch, its own checkpoint and that state."""
    learner = Learner(compose(*CFG))
    learner.train_step(episodes(8))
    native = tmp_path / "native"
    learner.save(native)  # the distributed checkpoint the conversion must reproduce
    return learner, native, read_learner_state(native)


def value_head(saved: dict) -> dict[str, torch.Tensor]:
    head = "value_head."
    return {k.removeprefix(head): v for k, v in saved["model"].items() if k.startswith(head)}


def common(learner: Learner, saved: dict) -> dict:
    return {"scheduler": learner.scheduler.state_dict(), "version": learner.version, "steps": learner.steps,
            "reference": saved["reference"]}  # fmt: skip


def assert_same(converted: Path, native: Path, flat: bool = False) -> None:
    """The same learner state. ``flat``: the earlier flat slice had one AdamW step count for all its
    parameters, also for one no loss reaches (zero moments), which the learner leaves at step 0."""
    a, b = read_learner_state(converted), read_learner_state(native)
    assert a["trainer"] == b["trainer"]
    for part in ("model", "reference"):
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for name, moments in b["optimizer"].items():
        untouched = flat and not moments["exp_avg_sq"].any()
        assert all(torch.equal(a["optimizer"][name][k], v) for k, v in moments.items()
                   if not (untouched and k == "step")), name  # fmt: skip


def test_a_single_rank_learner_pt_converts_to_the_same_state(tmp_path):
    learner, native, saved = trained(tmp_path)
    order, moments, group = old_state(learner, saved)
    old = tmp_path / "run" / "checkpoints" / "iter_00000"
    learner.export(old / "policy")
    torch.save(common(learner, saved) | {
        "optimizer": {"state": {i: moments[n] for i, n in enumerate(order)},
                      "param_groups": [group | {"params": list(range(len(order)))}]},
        "value_head": value_head(saved), "rng": rng_state()}, old / "learner.pt")  # fmt: skip
    convert(old, compose(*CFG))
    assert_same(old, native)
    resumed = Learner(compose(*CFG))
    resumed.load(old)  # and it resumes: the same next step as the learner it came from
    assert resumed.train_step(episodes(8, seed=1)) == learner.train_step(episodes(8, seed=1))


def test_a_sharded_checkpoint_of_flat_slices_converts_to_the_same_state(tmp_path):
    learner, native, saved = trained(tmp_path)
    order, moments, group = old_state(learner, saved)
    old = tmp_path / "run" / "checkpoints" / "iter_00000"
    learner.export(old / "policy")
    values = learner.weights()[1] | {"value_head." + k: v for k, v in value_head(saved).items()}
    flat_names = [n for n in order if stacked_slot(n)[1] is None]  # experts split by expert parallelism
    numels = [values[n].numel() for n in flat_names]
    size = -(-sum(numels) // 2)

    def flat(key: str | None) -> torch.Tensor:
        parts = [(values[n] if key is None else moments[n][key]).reshape(-1) for n in flat_names]
        whole = torch.cat(parts)
        return torch.cat([whole, whole.new_zeros(2 * size - whole.numel())])

    experts = [n for n in order if stacked_slot(n)[1] is not None]
    half = learner.model.config.num_experts // 2  # expert_parallel 2: each rank half of every layer's experts
    mine = [[n for n in experts if stacked_slot(n)[1] // half == r] for r in range(2)]
    (old / "shards").mkdir()
    for r in range(2):
        cut = slice(r * size, (r + 1) * size)
        state = {0: {"step": moments[flat_names[0]]["step"], "exp_avg": flat("exp_avg")[cut],
                     "exp_avg_sq": flat("exp_avg_sq")[cut]}}  # fmt: skip
        state |= {i: moments[n] for i, n in enumerate(mine[r], start=1)}
        groups = [group | {"params": list(range(len(state)))}]
        torch.save({"flat": flat(None)[cut], "flat_names": flat_names, "flat_numels": numels,
                    "experts": {n: values[n] for n in mine[r]}, "rng": rng_state(),
                    "optimizer": {"state": state, "param_groups": groups}},
                   old / "shards" / f"rank{r}.pt")  # fmt: skip
    torch.save(common(learner, saved) | {"sharded": 2, "expert_parallel": 2}, old / "learner.pt")
    convert(old, compose(*CFG))
    assert_same(old, native, flat=True)
