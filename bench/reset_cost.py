"""What episode isolation costs per reset, for every shipped task (conf/env/*.yaml).

A reset in place, a restore by a cold start and a restore by a warm start (a fork of the pool's template),
each the median of ``--reps`` resets after a played step. Prints a Markdown table.
Usage: python bench/reset_cost.py [--reps 5] [--kv-mib 16]

Design: docs/design/benchmarks.md#bench-reset-cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path

import gymnasium
import yaml

import agentenv.tasks  # noqa: F401  (registers the built-in tasks)
from agentenv import SandboxConfig
from agentenv.factory import PooledSandboxes
from agentenv.pool import SandboxPool

CONF = Path(__file__).resolve().parents[1] / "conf" / "env"
SMALL = {"memory": "256m", "cpus": 1.0, "pids_limit": 64}


def timed_resets(env_id: str, kwargs: dict, pool: SandboxPool, reps: int, in_place: bool) -> float:
    """Median seconds of ``reps`` resets of one env after a played step (``in_place``: forced in place)."""
    env = gymnasium.make(env_id, sandboxes=PooledSandboxes(pool), **kwargs).unwrapped
    env.in_place_reset = "forced by the benchmark" if in_place else None  # the path measured
    times = []
    try:
        env.reset(seed=0)  # the first reset builds the template, if any: not timed
        for rep in range(reps):
            env.step("1")
            started = time.perf_counter()
            env.reset(seed=rep + 1)
            times.append(time.perf_counter() - started)
    finally:
        env.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kv-mib", type=int, default=16, help="KVLookup's data_mib (its yaml: 200)")
    args = parser.parse_args()
    config = SandboxConfig.load(**SMALL)
    rows = ["| config | task | declared | in place (s) | restore, cold (s) | restore, warm fork (s) |",
            "|---|---|---|---|---|---|"]
    for path in sorted(CONF.glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        kwargs = {**cfg["kwargs"], "sandbox": {"config": config.to_dict()}}
        if cfg["id"] == "agentenv/KVLookup-v0":
            kwargs["data_mib"] = args.kv_mib
        figures = []
        for in_place, warm in ((True, False), (False, False), (False, True)):
            pool = SandboxPool(f"reset-cost-{uuid.uuid4().hex[:6]}", config=config, warm_starts=warm)
            try:
                figures.append(timed_resets(cfg["id"], kwargs, pool, args.reps, in_place))
            finally:
                pool.close()
        declared = gymnasium.spec(cfg["id"]).entry_point
        module, name = declared.split(":")
        cls = getattr(__import__(module, fromlist=[name]), name)
        path_name = "in place" if cls.in_place_reset else "restore"
        cells = " | ".join(f"{f:.3f}" for f in figures)
        rows.append(f"| {path.stem} | {cfg['id']} | {path_name} | {cells} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
