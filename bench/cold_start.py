"""A supervised cold start for a benchmark's RL runs: demonstrations of weak scripted experts
(`python -m rl.sft.demonstrations`, each expert its share of games of its own), then SFT on all of them
(`python -m rl.train stage=sft`), each stage a fresh process. `bench/teacher.py` starts its GRPO from
one; `bench/tree.py` starts both methods of a task from the same one, kept under outputs/ (`cached`) so
that a later, resumed invocation trains from the very same weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_report import ROOT, git_commit

RECORD = "cold_start.json"  # written last: a folder without it holds no finished cold start


@dataclass(frozen=True)
class Recipe:
    """What a cold start is made of."""

    env: tuple[str, ...]  # the overrides naming the task, for every stage
    experts: tuple[tuple[str, float], ...]  # (the override choosing an expert, its share of the demos)
    demos: int  # demonstration episodes in all
    sft: tuple[str, ...] = ()  # overrides of the SFT stage

    def describe(self) -> str:
        """The experts and their shares, for a report (``expert.quality=grep 25% + ...``)."""
        return " + ".join(f"`{choice}` {share:.0%}" for choice, share in self.experts)


def stage(command: list[str]) -> float:
    """Run one stage (``python COMMAND`` in a fresh process); its wall seconds. Exits with the stage's
    output if it fails."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(command[:3])} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    return time.monotonic() - started


def make(recipe: Recipe, folder: Path) -> dict:
    """Demonstrations, then SFT, in ``folder`` (the SFT run folder: ``folder/sft``). Returns the SFT folder,
    the experts' success over their demonstrations, the demonstrations' count and each stage's seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    data, sft_dir = folder / "demos.jsonl", folder / "sft"
    demo_s, parts = 0.0, []
    for index, (choice, share) in enumerate(recipe.experts):
        part = folder / f"demos-{index}.jsonl"
        demo_s += stage(["-m", "rl.sft.demonstrations", *recipe.env, choice,
                         f"num_episodes={round(recipe.demos * share)}",
                         f"seed={index}",  # each expert plays games of its own
                         f"out={part}"])  # fmt: skip
        parts.append(part.read_text())
    text = "".join(parts)
    data.write_text(text)  # SFT shuffles its episodes
    lines = [json.loads(line) for line in text.splitlines()]
    sft_s = stage(["-m", "rl.train", "stage=sft", f"data={data}", *recipe.env, *recipe.sft,
                   "trainer.progress_bar=false", f"hydra.run.dir={sft_dir}"])  # fmt: skip
    return {"sft_dir": str(sft_dir), "expert": sum(bool(e["success"]) for e in lines) / len(lines),
            "demos": len(lines), "demo_s": demo_s, "sft_s": sft_s}


def cached(recipe: Recipe, folder: Path) -> dict:
    """The cold start of ``recipe`` kept in ``folder``, made first if the folder holds none of this recipe
    (an unfinished or different one is replaced). Adds the commit and time it was made on."""
    record = folder / RECORD
    if record.is_file():
        kept = json.loads(record.read_text())
        if kept.get("recipe") == json.loads(json.dumps(asdict(recipe))) and Path(kept["sft_dir"]).is_dir():
            return kept
    shutil.rmtree(folder, ignore_errors=True)
    made = make(recipe, folder)
    made.update(recipe=asdict(recipe), commit=git_commit(),
                made=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    partial = record.with_suffix(".partial")
    partial.write_text(json.dumps(made))
    partial.replace(record)
    return json.loads(record.read_text())
