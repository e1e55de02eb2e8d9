"""`bench/agent_episode_cpu.py` measures a real sandbox of env=agent_guess_number (a short run here): every
kind has one figure per round, an episode costs more than python3's bare start, and http.client adds to the
program's imports; the section names them."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import agent_episode_cpu  # noqa: E402


def test_the_program_imports_are_read_from_its_source():
    assert {"json", "socket", "subprocess"} <= set(agent_episode_cpu.program_imports())
    assert "http.client" not in agent_episode_cpu.program_imports()


@pytest.mark.docker
def test_a_short_run_measures_every_kind_in_a_real_sandbox():
    ms = agent_episode_cpu.measure(runs=3, rounds=2)
    assert {k: len(v) for k, v in ms.items()} == {k: 2 for k in agent_episode_cpu.KINDS}
    assert min(ms["episode"]) > max(ms["bare"]) > 0
    assert statistics.median(ms["http"]) > statistics.median(ms["imports"])
    text = agent_episode_cpu.section(ms, 3, 2, "the machine", 0.0)
    assert "| an episode: setup" in text and "what `http.client` would add" in text
