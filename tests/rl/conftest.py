import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tasks"))

from task_fixtures import make_task, sandbox_config, task_home  # noqa: E402, F401


@pytest.fixture(scope="session")
def local_ray(task_home) -> str:  # noqa: F811  (the fixture imported above)
    """Local Ray for the whole session (one start-up instead of one per module; 3 CPUs: a learner and two
    rollout workers), started after $AGENTENV_HOME is set so that workers inherit it, with this folder on
    the workers' PYTHONPATH (the test wrappers and tasks are imported there by name). Its address:
    `python -m rl.train` runs of the tests join it with ``trainer.ray_address=...`` instead of starting a
    Ray of their own."""
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), old_path) if p)
    context = ray.init(num_cpus=3, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield context.address_info["gcs_address"]
    ray.shutdown()
    if old_path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="module")
def one_torch_thread():
    """The learner's thread count (trainer.learner_threads) for a module's tests: a second torch thread
    on busy cores only waits (a module opts in with ``pytestmark = pytest.mark.usefixtures(...)``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
