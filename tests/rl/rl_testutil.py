"""Helpers of the trainer tests (imported by name; pytest puts this folder on sys.path)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compose_raw(*overrides: str):
    """Hydra's composed config (with its ``hydra`` node, so errors can name the file) for ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=True)


def compose(*overrides: str):
    """The checked, typed `RunConfig` (as `rl.train` builds it) for the given Hydra overrides."""
    from rl.train import resolve_config

    return resolve_config(compose_raw(*overrides))


# A run small enough for the test budget: 2 groups of 2 episodes, 2-turn games, no progress bar.
TINY = (
    "algo.group_size=2",
    "algo.episodes_per_step=4",
    "env.kwargs.max_turns=2",
    "trainer.iterations=2",
    "trainer.stop_at_success=null",
    "trainer.progress_bar=false",
    "trainer.tensorboard=true",
    "trainer.learner_threads=1",
    "rollout.env_threads=4",
    "trainer.time_limit_s=null",
    "sandbox.memory=128m",
    "sandbox.pids_limit=64",
)


def assert_drops_add_up(history: list[dict], group_size: int, episodes_per_step: int) -> None:
    """An async run's ``dropped_episodes``, iteration by iteration (a run that did not resume): none at
    iteration 0 (the workers and the learner both hold version 0, so nothing is stale), whole groups
    only, and never more than the episodes collected so far minus those trained (collected = trained +
    dropped + still queued)."""
    assert history[0]["dropped_episodes"] == 0, history[0]
    collected = dropped = 0
    for i, record in enumerate(history, 1):
        assert record["dropped_episodes"] % group_size == 0, record
        collected += record["episodes"]
        dropped += record["dropped_episodes"]
        assert collected - dropped >= i * episodes_per_step, (i, collected, dropped)
