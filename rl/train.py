"""`python -m rl.train [overrides]` (console script `k3rl-train`): the Hydra entry point of k3rl.

Composes ``conf/config.yaml`` (groups ``model/ algo/ env/ sandbox/ rollout/ trainer/``), validates it,
starts Ray and trains. Hydra's run folder (``outputs/<date>/<time>/``) receives the resolved config,
the log, ``metrics.jsonl``, TensorBoard events, checkpoints and the learning-curve plot; their paths
are printed at the end. A bad config value stops the run before anything starts, naming the key.

Examples::

    python -m rl.train                                  # GRPO on GuessNumber with the tiny K3 policy
    python -m rl.train algo=ppo trainer.iterations=50
    python -m rl.train env=find_value rollout.num_workers=2
    python -m rl.train trainer.resume=outputs/2026-11-30/06-00-00
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from rl.config import ConfigError, validate


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as a plain dict, with the tokenizer's special ids filled in."""
    from rl.tokenizer import build_tokenizer

    data = OmegaConf.to_container(cfg, resolve=True)
    validate(data)
    tokenizer = build_tokenizer(data["tokenizer"])
    data["tokenizer"]["pad_id"] = tokenizer.pad_id
    env_kwargs = data["env"].setdefault("kwargs", {}) or {}
    data["env"]["kwargs"] = env_kwargs
    if data.get("sandbox"):  # the sandbox group's values, under the env's own overrides (e.g. image)
        env_kwargs["sandbox"] = {"config": data["sandbox"], **(env_kwargs.get("sandbox") or {})}
    return data


def train(cfg: DictConfig, run_dir: str | Path):
    """Validate, train, and return the `TrainResult` (used by ``main`` and by ``bench/train.py``)."""
    from rl.trainer import Trainer

    data = resolve_config(cfg)
    (Path(run_dir)).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "resolved_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    return Trainer(data, run_dir).run()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rl.trainer import RolloutWorkerLost, TooManyFailures

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = train(cfg, run_dir)
    except ConfigError as exc:
        print(f"k3rl-train: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (TooManyFailures, RolloutWorkerLost) as exc:
        print(f"k3rl-train: training stopped: {exc}", file=sys.stderr)
        print(f"k3rl-train: metrics and plot so far are in {run_dir}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"\nk3rl-train: interrupted; metrics and the plot so far are in {run_dir}", file=sys.stderr)
        raise SystemExit(130) from None
    target = cfg.trainer.stop_at_success
    print(
        f"\nsuccess: {result.start_success:.2f} at the start -> {result.end_success:.2f} "
        f"(mean of the last {cfg.trainer.success_window} iterations) after {result.iterations} iterations, "
        f"{result.wall_s / 60:.1f} min"
    )
    if target is not None:
        print(f"target success {target}: {'reached' if result.reached_target else 'NOT reached'}")
    print(f"learning curve: {result.plot}")
    print(f"checkpoint:     {result.checkpoint}")
    print(f"metrics:        {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tb'})")


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
