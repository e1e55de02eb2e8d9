"""Lanes for `make test`: two host lanes and the compute modules side by side (pytest-xdist, `-n 2`),
then the serial tests alone.

Most of the suite talks to the machine's shared services: dockerd and CRIU (containers, checkpoints),
local Ray clusters, network namespaces, `rl.train` subprocesses. Such tests wait on latency more than
they compute, so two of them can share the two cores; what they must not share is host-wide state. The
suite splits them in two host lanes that run side by side, each one after the other in collection order:
`host-rl` (tests/rl: trainings, Ray clusters) and `host` (everything else: sandboxes, the server, tasks,
docs, install). Each lane is a different xdist worker with its own AgentENV home, Ray cluster and network
namespace names (they carry the worker's pid), so the two lanes share only dockerd and the CPUs.

The modules listed in `COMPUTE_MODULES` touch none of those services: model and kernel numerics, the
learner and the algorithms on hand-made batches, process groups on loopback, config checks, the
in-process vLLM engine, the benchmarks' verdicts and the GPU check's CPU dry run. Each is a unit of its
own (its module-scoped fixtures start once) and fills whichever worker is free. A module belongs there
only when none of its tests starts a container, a Ray cluster, a server or a training subprocess. The
units a worker takes once its lane is done come longest first (`LONGEST_COMPUTE`, then xdist's order,
most tests first), so that the last ones to finish are short and the two workers end close together. A
third worker (`-n 3`, the compute modules beside both lanes) did not pay on two cores: the lanes are busy
enough that it mostly slowed them (11.1 min with a test that failed early, 12.5, and 14.2 on a fresh
clone, against 12.4 and 12.5 with `-n 2`).

A test marked `serial` changes what every other test relies on (it restarts dockerd, which stops every
running container) or measures latencies a busy neighbour would distort: `make test` deselects them in
the parallel run and runs them afterwards on their own (`pytest -m serial`). A plain `pytest tests`
(no `-n`) runs everything in order.

The units are xdist's scopes (`pytest_xdist_make_scheduler`, a `LoadScopeScheduling` whose scope is the
lane): its `xdist_group` marks cannot do it with pytest 9.2, whose node ids xdist 3.8 no longer suffixes.
"""

from __future__ import annotations

import pytest

HOST_LANE = "host"
RL_HOST_LANE = "host-rl"
COMPUTE_MODULES = (
    "tests/bench/",
    "tests/model/",
    "tests/kernels/",
    "tests/test_import_cycles.py",
    "tests/rl/test_algos.py",
    "tests/rl/test_async.py",
    "tests/rl/test_checkpoints.py",
    "tests/rl/test_config_mistakes.py",
    "tests/rl/test_config_refusals.py",
    "tests/rl/test_device.py",
    "tests/rl/test_failed_episodes.py",
    "tests/rl/test_learner.py",
    "tests/rl/test_learner_ranks.py",
    "tests/rl/test_policy.py",
    "tests/rl/test_ranks.py",
    "tests/rl/test_rl_config.py",
    "tests/rl/test_routing_replay.py",
    "tests/rl/test_task_metrics.py",
    "tests/rl/test_tokenizer.py",
    "tests/rl/test_vllm_engine.py",
    "tests/server/test_server_watch.py",
)
# The compute modules that take longest (over 4 s on an idle machine, `pytest MODULE --durations=0`),
# longest first.
LONGEST_COMPUTE = (
    "tests/rl/test_learner_ranks.py",
    "tests/bench/test_gpu_check.py",
    "tests/rl/test_vllm_engine.py",
    "tests/kernels/test_kernels_kda_triton.py",
    "tests/rl/test_rl_config.py",
    "tests/rl/test_learner.py",
    "tests/model/test_balancing.py",
    "tests/kernels/test_kernels_compile_sm90.py",
)


def lane_of(nodeid: str) -> str:
    """The unit of work of a test: its own module for the compute modules, else one of the host lanes."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(COMPUTE_MODULES):
        return module
    return RL_HOST_LANE if module.startswith("tests/rl/") else HOST_LANE


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n N`: one unit of work per lane (see the module docstring), the two host lanes first, on
    different workers; the compute modules go to whichever worker is free, the longest first."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # moved to the front last to first: HOST_LANE ends up first, RL_HOST_LANE second, then the
            # longest compute modules
            for unit in reversed((HOST_LANE, RL_HOST_LANE, *LONGEST_COMPUTE)):
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return LaneScheduling(config, log)


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """`make test`'s second pass (`-m serial`) imports only the test modules whose source names the mark:
    the others hold no serial test, and importing all of them (torch, Ray, vLLM) took most of the pass."""
    if config.getoption("markexpr", "") != "serial" or not collection_path.name.startswith("test_") \
            or collection_path.suffix != ".py":
        return None
    return True if "mark.serial" not in collection_path.read_text() else None
