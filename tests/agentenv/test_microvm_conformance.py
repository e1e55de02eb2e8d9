"""The handle conformance cases (`test_handle_conformance.py`: exec results and timeouts, bad arguments,
files, a missing file, state errors, a fork with labels, close twice, sessions) on the microvm backend, for
a local `Sandbox`. The cases are the conformance module's own functions; only the fixture differs. (The
remote handle is backend-blind and runs these cases on containers; `tests/server/test_microvm_server.py`
drives a server of microVMs through E2B's SDK. A pool member is a local sandbox behind the pool's
bookkeeping; the trainer's run on microVMs goes through it.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agentenv_testutil import SMALL
from microvm_env import microvm_home
from test_handle_conformance import (  # noqa: F401 - collected here with this module's fixtures
    LABELS,
    test_a_timeout_kills_the_command,
    test_bad_arguments_are_refused_alike,
    test_exec_results,
    test_files,
    test_fork_with_labels_and_close_twice,
    test_paths_outside_the_work_dir_are_refused_alike,
    test_session_runs_like_exec,
    test_state_errors,
    test_the_handle_and_its_session_satisfy_the_protocols,
)

from agentenv import Sandbox, SandboxConfig
from agentenv.api import SandboxHandle

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def microvm(base_image, tmp_path_factory) -> Iterator[None]:
    with microvm_home(tmp_path_factory.mktemp("microvm-conformance")):
        yield


@pytest.fixture(scope="module")
def small_profile(microvm) -> SandboxConfig:
    return SandboxConfig.load(**SMALL)


@pytest.fixture(scope="module")
def handle(small_profile) -> Iterator[SandboxHandle]:
    sb: SandboxHandle = Sandbox.create(config=small_profile, labels=LABELS)
    yield sb
    sb.close()
