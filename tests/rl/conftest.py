import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))

from task_fixtures import make_task, sandbox_config, task_home  # noqa: E402, F401


@pytest.fixture(scope="module")
def local_ray(task_home):  # noqa: F811  (the fixture imported above)
    """Local Ray for the module, started after $AGENTENV_HOME is set so that workers inherit it."""
    import os

    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()
