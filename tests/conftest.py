"""Two lanes for `make test` (`pytest -n 2`, pytest-xdist): the host lane and the compute lane.

Most of the suite talks to the machine's shared services: dockerd and CRIU (containers, checkpoints, one
test restarts the daemon and checks that no other session's containers run), local Ray clusters, network
namespaces, `rl.train` subprocesses, timing-sensitive pause policies. Those tests form ONE unit of work,
so they run one after the other in one worker, in collection order, exactly as in a plain `pytest` run.
They wait on latency more than they compute: alone, the suite kept about one of the two cores busy.

The modules listed in `COMPUTE_MODULES` touch none of those services: model and kernel numerics, the
learner and the algorithms on hand-made batches, config checks, the in-process vLLM engine. Each such
module is a unit of its own (its module-scoped fixtures, e.g. the vLLM engine, start once), and the other
worker runs them beside the host lane. A plain `pytest tests` (no `-n`) runs everything in order.

A module belongs in `COMPUTE_MODULES` only when none of its tests starts a container, a Ray cluster, a
server or a training subprocess; everything else lands in the host lane, so a new test is safe by default.

The units are xdist's scopes (`pytest_xdist_make_scheduler`, a `LoadScopeScheduling` whose scope is the
lane): its `xdist_group` marks cannot do it with pytest 9.2, whose node ids xdist 3.8 no longer suffixes.
"""

from __future__ import annotations

import pytest

HOST_LANE = "host"
COMPUTE_MODULES = (
    "tests/model/",
    "tests/kernels/",
    "tests/test_import_cycles.py",
    "tests/rl/test_algos.py",
    "tests/rl/test_async.py",
    "tests/rl/test_checkpoints.py",
    "tests/rl/test_config_refusals.py",
    "tests/rl/test_device.py",
    "tests/rl/test_failed_episodes.py",
    "tests/rl/test_learner.py",
    "tests/rl/test_learner_ranks.py",
    "tests/rl/test_policy.py",
    "tests/rl/test_rl_config.py",
    "tests/rl/test_routing_replay.py",
    "tests/rl/test_tokenizer.py",
    "tests/rl/test_vllm_engine.py",
)


def lane_of(nodeid: str) -> str:
    """The unit of work of a test: its own module for the compute modules, else the one host lane."""
    module = nodeid.split("::", 1)[0]
    return module if module.startswith(COMPUTE_MODULES) else HOST_LANE


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n N`: one unit of work per lane (see the module docstring), the host lane first."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return LaneScheduling(config, log)
