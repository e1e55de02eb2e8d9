import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))

from task_fixtures import make_task, sandbox_config, task_home  # noqa: E402, F401

ROOT = Path(__file__).resolve().parents[2]


def compose(*overrides: str) -> dict:
    """The resolved run config (as `rl.train` builds it) for the given Hydra overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rl.train import resolve_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return resolve_config(hydra_compose("config", overrides=list(overrides)))


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


@pytest.fixture(scope="module")
def local_ray(task_home):  # noqa: F811  (the fixture imported above)
    """Local Ray for the module, started after $AGENTENV_HOME is set so that workers inherit it."""
    import os

    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()
