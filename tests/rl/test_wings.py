"""rl/ is a core and four wings, and the arrows between them point one way: the core imports no wing, the
rollout wing (the gateway included) and the learner wing never import each other, the SFT wing builds on
both, and only the driver and the entry point (`rl.train`) see everything."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from import_cycles import imports_of, module_files  # noqa: E402

WINGS = ("rl.driver", "rl.rollout", "rl.learner", "rl.sft")
MAY_IMPORT = {  # besides the core
    "core": set(),
    "rl.rollout": set(),
    "rl.learner": set(),
    "rl.sft": {"rl.learner", "rl.rollout"},
    "rl.driver": {"rl.rollout", "rl.learner"},
    "rl.train": {"rl.driver", "rl.sft"},
}


def part(module: str) -> str:
    """The wing a module of rl belongs to, ``rl.train`` (the entry point) or ``core``."""
    if module == "rl.train":
        return module
    return next((w for w in WINGS if module == w or module.startswith(w + ".")), "core")


def crossings() -> list[str]:
    files = module_files(ROOT, ["rl"])
    known = set(files)
    wrong = []
    for module, path in files.items():
        here = part(module)
        for target in imports_of(module, path, known):
            there = part(target)
            if there not in (here, "core") and there not in MAY_IMPORT[here] and target not in WINGS:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def test_the_arrows_between_the_wings_point_one_way():
    assert crossings() == []


def test_every_wing_is_a_package_and_the_checker_sees_a_crossing(tmp_path, monkeypatch):
    for wing in WINGS:
        assert (ROOT / wing.replace(".", "/") / "__init__.py").is_file(), wing
    # the checker itself: a learner module importing the runner is found
    fake = tmp_path / "rl"
    files = {"__init__.py": "", "episode.py": "", "rollout/__init__.py": "", "learner/__init__.py": "",
             "rollout/runner.py": "from rl.episode import x\n",
             "learner/learner.py": "from rl.rollout.runner import y\n"}
    for name, text in files.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert crossings() == ["rl.learner.learner -> rl.rollout.runner"]
