#!/usr/bin/env python3
"""Is a change bit-exact for training? Run the same short runs (sync, async, a two-rank learner) on this
checkout and on an earlier commit, and compare what they learned: every learning metric of every
iteration and a hash of the final weights. Timings, sandbox counts and other host-dependent figures are
not compared. Exit 1 on any difference. An async run is exact only when its timing repeats (which weights
version each rollout turn used): compare it on a quiet machine.

Usage: python scripts/compare_runs.py --ref COMMIT [--iterations N] [--cases sync async ws2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ("trainer.stop_at_success=null", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "trainer.time_limit_s=null", "seed=0")
CASES = {
    "sync": (),
    "async": ("trainer.mode=async",),
    "ws2": ("trainer.learner.world_size=2", "trainer.num_cpus=3"),
}
# what a run learned: exact-equality keys (a key naming a family, e.g. maxvio, takes its per-layer keys too)
LEARNED = ("iteration", "weights_version", "episodes", "failed_episodes", "success", "reward", "turns",
           "generated_tokens", "trained_tokens", "episode_tokens", "loss", "policy_loss", "entropy", "kl",
           "approx_kl", "clip_fraction", "grad_norm", "lr", "optimizer_steps", "maxvio", "routing_mismatch",
           "rollout_logprob_gap", "rollout_expert_load", "staleness_mean", "staleness_max")


def learned(record: dict) -> dict:
    """The record's learned figures: the LEARNED keys and their families (``maxvio/layer1``,
    ``maxvio_floor``), never a time or a rate (a key ending in ``_s``)."""
    return {k: v for k, v in record.items() if not k.endswith("_s") and any(
        k == key or k.startswith(key + "/") or k.startswith(key + "_") for key in LEARNED)}


def weights_hash(run_dir: Path) -> str:
    """sha256 over the tensors of the last checkpoint's policy (names, dtypes, shapes and bytes)."""
    import torch
    from safetensors.torch import load_file

    checkpoints = sorted((run_dir / "checkpoints").glob("iter_*"), key=lambda p: int(p.name.split("_")[1]))
    if not checkpoints:
        raise SystemExit(f"compare_runs: {run_dir} wrote no checkpoint")
    digest = hashlib.sha256()
    for file in sorted((checkpoints[-1] / "policy").glob("*.safetensors")):
        tensors = load_file(file)
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            digest.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def resources_shim(code: Path, folder: Path) -> Path:
    """A folder whose ``k3rl_resources`` package maps ``conf`` and ``sandbox_images`` onto ``code``'s, so
    that a run of an earlier commit reads that commit's configs, not the installed checkout's."""
    package = folder / "k3rl_resources"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("conf", "sandbox_images"):
        link = package / name
        if not link.is_symlink():
            link.symlink_to(code / name, target_is_directory=True)
    return folder


def run(code: Path, out: Path, overrides: tuple[str, ...], iterations: int) -> tuple[list[dict], str]:
    """One run of ``python -m rl.train`` on the code in ``code`` (PYTHONPATH puts it and its configs first,
    for the Ray workers too); its learning metrics per iteration and its final weights' hash."""
    shim = resources_shim(code, out.parent / f"shim-{code.name}")
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{shim}"}
    cmd = [sys.executable, "-m", "rl.train", *BASE, f"trainer.iterations={iterations}", *overrides,
           f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"compare_runs: {' '.join(cmd)} failed in {code}:\n{done.stderr[-3000:]}")
    records = [learned(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, weights_hash(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/compare_runs.py",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ref", required=True, help="the earlier commit to compare against")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--keep", type=Path, help="keep the runs' folders here")
    args = parser.parse_args(argv)
    sha = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=ROOT, capture_output=True, text=True)
    if sha.returncode != 0:
        parser.error(f"--ref {args.ref}: not a commit of this repository")
    work = Path(tempfile.mkdtemp(prefix="compare-runs-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    old_code = work / "ref"
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(old_code), args.ref], cwd=ROOT,
                   check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(f"compare_runs: {args.ref} ({sha.stdout.strip()}) against this checkout (HEAD {head.stdout.strip()}"
          f"{', with uncommitted changes' if _dirty() else ''}), {args.iterations} iterations per run")
    differ = 0
    try:
        for case in args.cases:
            old = run(old_code, work / f"{case}-ref", CASES[case], args.iterations)
            new = run(ROOT, work / f"{case}-new", CASES[case], args.iterations)
            same_metrics, same_weights = old[0] == new[0], old[1] == new[1]
            keys = len(old[0][0]) if old[0] else 0
            print(f"  {case:6s} metrics ({keys} keys x {len(old[0])} iterations): "
                  f"{'identical' if same_metrics else 'DIFFER'}; final weights {old[1]} vs {new[1]}: "
                  f"{'identical' if same_weights else 'DIFFER'}")
            if not same_metrics:
                for i, (a, b) in enumerate(zip(old[0], new[0], strict=False)):
                    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
                    if diff:
                        print(f"    iteration {i}: {dict(list(diff.items())[:6])}")
            differ += not (same_metrics and same_weights)
            if case == "async" and not (same_metrics and same_weights):
                print("    (async: the weights version of each rollout turn depends on timing; on a busy "
                      "machine two runs of the same code can differ too)")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_code)], cwd=ROOT, capture_output=True)
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if differ else 0


def _dirty() -> bool:
    return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    sys.exit(main())
