"""The weight and episode path: workers start from the learner's published weights (no init of their
own), the learner publishes each version once to Ray's object store, unit by unit, and trains on the
episodes' object references, `Learner.load` restores in place, and a restarted worker refuses to roll out
until it has reloaded the current weights, which the trainer's retry branch does. The Ray tests run real
actors on a local Ray; only the last one rolls out in sandboxes."""

import time

import pytest
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError
from rl_testutil import TINY, compose
from test_learner import episodes

from model import K3ForCausalLM
from rl.driver.trainer import Trainer
from rl.errors import StaleWeights
from rl.learner.actor import LearnerActor
from rl.learner.learner import Learner
from rl.learner.sharding import local
from rl.rollout.actor import NO_WEIGHTS, RolloutWorker, rollout_worker_actor
from rl.weights import PublishedWeights


@pytest.fixture(scope="module")
def cfg():
    return compose("algo.group_size=4", "algo.episodes_per_step=8", "trainer.learner_threads=1")


def test_a_worker_draws_no_init_and_rolls_out_nothing_before_its_first_weights(cfg):
    rng = torch.get_rng_state()
    worker = RolloutWorker(cfg, index=0)
    assert torch.equal(torch.get_rng_state(), rng), "the worker initialised weights it will overwrite"
    assert worker.version == NO_WEIGHTS
    with pytest.raises(StaleWeights, match="holds weights v-1 but the batch needs v0"):
        worker.rollout([1], 2, 0, sample_seed=0, expected_version=0)
    version, state = Learner(cfg).weights()
    assert worker.load_weights(version, state) == 0
    held = worker.model.state_dict()
    assert held.keys() == state.keys() and all(torch.equal(held[k], state[k]) for k in state)


def test_learner_load_restores_in_place_and_training_continues_identically(cfg, tmp_path, monkeypatch):
    trained = Learner(cfg)
    trained.train_step(episodes(seed=1))
    trained.save(tmp_path / "ckpt")
    resumed = Learner(cfg)
    params = {name: local(p).data_ptr() for name, p in resumed.model.named_parameters()}
    built = []
    original_init = K3ForCausalLM.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(K3ForCausalLM, "__init__", counting_init)
    resumed.load(tmp_path / "ckpt")
    monkeypatch.undo()
    assert built == [], "load built a second model to copy from"
    assert {name: local(p).data_ptr() for name, p in resumed.model.named_parameters()} == params
    assert resumed.version == 1
    assert trained.train_step(episodes(seed=2)) == resumed.train_step(episodes(seed=2))
    a, b = trained.weights()[1], resumed.weights()[1]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_learner_load_names_a_missing_or_cut_file(cfg, tmp_path):
    Learner(cfg).save(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "learner" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"__0_0\.distcp: \d+ bytes, learner\.json says \d+"):
        Learner(cfg).load(tmp_path / "ckpt")
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"__0_0\.distcp: missing from the checkpoint"):
        Learner(cfg).load(tmp_path / "ckpt")


def test_the_learner_trains_on_episode_references_and_publishes_each_version_once(cfg, local_ray):
    learner = ray.remote(LearnerActor).remote(cfg)
    version, blocks = ray.get(learner.publish.remote())
    # the driver holds references only, one per sharded unit: each decoder layer, each MoE layer's experts,
    # the embedding, the head, the rest (final norm and depth mix)
    assert version == 0 and all(isinstance(b.ref, ray.ObjectRef) for b in blocks)
    layers = cfg.model.num_hidden_layers
    moe_layers = layers - cfg.model.first_k_dense_replace
    assert len(blocks) == layers + moe_layers + 3
    plain = Learner(cfg)  # the same seed: what the actor must reproduce bit for bit
    first = PublishedWeights(version, blocks).state_dict()
    assert first.keys() == plain.weights()[1].keys()
    assert all(torch.equal(first[k], v) for k, v in plain.weights()[1].items())

    batch = episodes()
    shares = [ray.put(batch[:4]), ray.put(batch[4:])]  # as two workers' rollouts hand them over
    metrics, version, blocks = ray.get(learner.train_step.remote(*shares))
    assert version == 1 and all(isinstance(b.ref, ray.ObjectRef) for b in blocks)
    assert metrics == plain.train_step(batch)
    published = PublishedWeights(version, blocks).state_dict()
    assert all(torch.equal(published[k], v) for k, v in plain.weights()[1].items())
    ray.kill(learner)


def test_a_restarted_worker_refuses_the_batch_until_it_reloads_the_current_weights(cfg, local_ray):
    # the learner in this process (its actor is the test above's): its train step puts the weights in
    # Ray's object store all the same, and the worker, a real actor, loads them by reference
    learner = LearnerActor(cfg)
    worker = rollout_worker_actor().options(max_restarts=1).remote(cfg, 0)
    _metrics, version, blocks = learner.train_step(episodes())
    weights = PublishedWeights(version, blocks)
    assert ray.get(worker.load_weights.remote(version, weights)) == 1
    ray.kill(worker, no_restart=False)  # as an OOM kill: Ray restarts it, with no weights
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.get(worker.rollout.options(num_returns=2).remote([1], 2, 0, 0, version)[0], timeout=60)
        except RayTaskError as exc:
            assert isinstance(exc.cause, StaleWeights) and "holds weights v-1" in str(exc.cause)
            break
        except RayActorError:  # still restarting
            assert time.monotonic() < deadline, "the killed worker did not come back"
            time.sleep(0.5)
        else:
            pytest.fail("a restarted worker rolled out without weights")
    assert ray.get(worker.load_weights.remote(version, weights)) == 1  # by reference, as the trainer does
    with pytest.raises(RayTaskError, match="refusing older v0"):
        ray.get(worker.load_weights.remote(0, ray.put(Learner(cfg).weights()[1])))
    ray.kill(worker)


@pytest.mark.docker
@pytest.mark.slow
def test_the_trainer_retries_the_share_of_a_worker_killed_between_iterations(local_ray, tmp_path):
    """Real sandboxes: a worker killed after iteration 0 comes back without weights; the workers' one
    recovery path reloads the current version into it by reference and the share of iteration 1 is rerun."""
    trainer = Trainer(compose(*TINY, "trainer.tensorboard=false"), tmp_path / "run")
    try:
        assert trainer._start() == 0
        first = trainer._iteration(0, time.perf_counter())
        assert first["worker_restarts"] == 0 and trainer.version == 1
        ray.kill(trainer.workers.actors[0], no_restart=False)
        second = trainer._iteration(1, time.perf_counter())
    finally:
        trainer.metrics.close()
        trainer._shutdown()
    assert second["worker_restarts"] == 1 and trainer.version == 2
    assert second["episodes"] == 4 and second["failed_episodes"] == 0 and second["weights_version"] == 2
