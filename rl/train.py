"""`python -m rl.train [overrides]` (console script `k3rl-train`): the Hydra entry point of k3rl.

Composes and checks the config, tries one env of the task here (`rl.driver.preflight`), then starts Ray and
trains into Hydra's run folder. A config mistake stops the run before anything starts with one line (exit
2); a task that cannot start stops it with its own frames (exit 1).

Design: docs/design/training.md#rl-train.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from agentenv.paths import conf_dir
from rl.config import ConfigError, RunConfig
from rl.config.command_line import prepare
from rl.config.load import load, with_origin
from rl.driver.preflight import TaskFailed, check_runtime, check_task_options, try_task


def resolve_config(cfg: DictConfig) -> RunConfig:
    """The composed config as a checked `RunConfig` (raises a one-line `ConfigError`): the schema's
    checks, then ``model.init_from`` (its checkpoint's model config must match), ``data``, and what the
    config asks of this host and of the task's code (`rl.driver.preflight`)."""
    from rl.init_weights import check_init_from

    run = load(cfg)
    check_init_from(run.model)
    if run.stage == "sft" and not (run.data and Path(run.data).is_file()):
        raise ConfigError(
            "data: stage=sft needs an existing demonstration JSONL (python -m rl.sft.demonstrations), "
            f"got {run.data!r}"
        )
    try:
        check_runtime(run)
        check_task_options(run)
    except ConfigError as exc:
        raise with_origin(cfg, exc) from None
    return run


def train(cfg: DictConfig, run_dir: str | Path):
    """Check the config and run its ``stage``: RL (`TrainResult`, also used by ``bench/train.py``) or the
    supervised cold start (`rl.sft.trainer.SFTResult`)."""
    run = resolve_config(cfg)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "resolved_config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(run)))
    if run.stage == "sft":
        from rl.sft.trainer import SFTRunner

        return SFTRunner(run, run_dir).run()
    from rl.driver.trainer import Trainer

    return Trainer(run, run_dir).run()


class CheckConfigFirst(Callback):
    """Hydra callback (``hydra.callbacks`` in conf/config.yaml): checks the composed config when the run
    starts, before Hydra creates its run folder, so that a rejected config leaves no ``outputs/`` behind;
    then, with ``trainer.preflight``, one env of the task is made, reset and stepped here
    (`rl.driver.preflight`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            run = resolve_config(config)
        except ConfigError as exc:
            print(f"k3rl-train: config error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if run.stage != "rl" or not run.trainer.preflight:
            return
        started = time.perf_counter()
        try:
            done = try_task(run)
        except TaskFailed as exc:
            print(f"k3rl-train: task error (pre-flight check of {run.env.id}): {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        took = time.perf_counter() - started
        print(f"k3rl-train: pre-flight check of {run.env.id} passed in {took:.1f} s: {'; '.join(done)}",
              file=sys.stderr)


def _to_log_file(text: str) -> None:
    """Append ``text`` to the run's log file (Hydra's file handler: ``train.log``), not to the console."""
    record = logging.LogRecord("k3rl.train", logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


# An absolute config path: conf/ of the checkout, or the copy an installed wheel ships (agentenv.paths).
@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rl.errors import LearnerRankLost, RolloutWorkerLost, TooManyFailures

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = train(cfg, run_dir)
    except ConfigError as exc:
        print(f"k3rl-train: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (TooManyFailures, RolloutWorkerLost, LearnerRankLost) as exc:
        print(f"k3rl-train: training stopped: {exc}", file=sys.stderr)
        print(f"k3rl-train: metrics and plot so far are in {run_dir}", file=sys.stderr)
        _to_log_file(f"training stopped: {exc}")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"\nk3rl-train: interrupted; metrics and the plot so far are in {run_dir}", file=sys.stderr)
        raise SystemExit(130) from None
    if cfg.stage == "sft":
        heldout = ", ".join(f"{k} {v:.4f}" for k, v in result.heldout.items() if k in ("loss", "accuracy"))
        steps, episodes, minutes = result.steps, result.train_episodes, result.wall_s / 60
        print(f"\nSFT: {steps} steps on {episodes} episodes, {minutes:.1f} min")
        print(f"held-out action tokens: {heldout or 'none held out'}")
        print(f"learning curve: {result.plot}")
        print(f"checkpoint:     {result.checkpoint} (start RL from it: model.init_from={run_dir})")
        print(f"metrics:        {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tb'})")
        return
    target = cfg.trainer.stop_at_success
    print(
        f"\nsuccess: {result.start_success:.2f} at the start -> {result.end_success:.2f} "
        f"(mean of the last {cfg.trainer.success_window} iterations) after {result.iterations} iterations, "
        f"{result.wall_s / 60:.1f} min"
    )
    if target is not None:
        print(f"target success {target}: {'reached' if result.reached_target else 'NOT reached'}")
    evaluated = [r for r in result.history if "eval_success" in r]
    if evaluated:
        last = evaluated[-1]
        print(f"held-out success: {last['eval_success']:.2f} over {last['eval_episodes']:.0f} games "
              f"(after iteration {last['iteration']})")
    if cfg.trainer.log_samples:
        print(f"samples:        {run_dir / 'samples.txt'} ({cfg.trainer.log_samples} episodes per iteration)")
    print(f"learning curve: {result.plot}")
    print(f"checkpoint:     {result.checkpoint}")
    print(f"metrics:        {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tb'})")


def main() -> None:
    """``python -m rl.train`` and ``k3rl-train``: the user's config folders added and the command line
    checked (`rl.config.command_line`), then Hydra's run."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # task modules in the working directory, as `python -m` has
    try:
        sys.argv = [sys.argv[0], *prepare(sys.argv[1:], "config")]
    except ConfigError as exc:
        print(f"k3rl-train: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    _hydra_main()


if __name__ == "__main__":
    main()
