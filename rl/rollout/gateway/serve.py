"""Serving a saved policy: `load_policy` reads a checkpoint into a `TorchEngine` and its tokenizer,
`main` is ``python -m rl.rollout.gateway --checkpoint DIR [--host H] [--port N] ...`` (its flags hold the
gateway's defaults). The standalone server is open: every call is served and none is recorded (a
trainer opens episode keys through `Gateway.keys` in its own process).

``--checkpoint`` takes what ``model.init_from`` takes (`rl.init_weights.policy_dir`): a
``save_pretrained`` folder, a checkpoint, or a run folder (its newest checkpoint). The tokenizer is the
run's (``resolved_config.yaml`` of the run folder) when there is one, else the byte tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

from agentenv.errors import ConfigError
from model import K3ForCausalLM
from model.checkpoint import CheckpointMismatch
from model.config import ConfigError as ModelConfigError
from rl.checkpoints import TRAINER_STATE
from rl.config.schema import TokenizerConfig
from rl.init_weights import policy_dir
from rl.rollout.gateway.app import create_app
from rl.rollout.gateway.service import Gateway
from rl.rollout.gateway.settings import GatewaySettings
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

RUN_CONFIG = "resolved_config.yaml"  # written into the run folder by rl.train


def _run_tokenizer(policy: Path) -> Tokenizer:
    """The tokenizer of the run the policy folder belongs to (byte tokenizer when none is found)."""
    for folder in policy.resolve().parents:
        if (folder / RUN_CONFIG).is_file():
            section = (yaml.safe_load((folder / RUN_CONFIG).read_text()) or {}).get("tokenizer") or {}
            return build_tokenizer(TokenizerConfig(**section))
    return ByteTokenizer()


def load_policy(path: str | Path, device: str) -> tuple[TorchEngine, Tokenizer, int]:
    """(engine, tokenizer, version: the checkpoint's iteration, 0 for a bare weights folder) of the
    policy at ``path``; a `ConfigError` naming the problem when it holds none or a broken one."""
    if not Path(path).exists():
        raise ConfigError(f"--checkpoint {path}: no such file or folder")
    folder = policy_dir(path)
    try:
        model = K3ForCausalLM.from_pretrained(folder)
    except (FileNotFoundError, CheckpointMismatch, ModelConfigError, ValueError, OSError) as exc:
        raise ConfigError(f"--checkpoint {path}: cannot load the policy in {folder}: {exc}") from None
    model.to(device).eval()
    tokenizer = _run_tokenizer(folder)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(f"--checkpoint {path}: the tokenizer has {tokenizer.vocab_size} ids, the model "
                          f"{model.config.vocab_size}")  # fmt: skip
    state = folder.parent / TRAINER_STATE
    version = int(yaml.safe_load(state.read_text())["iteration"]) if state.is_file() else 0
    return TorchEngine(model, tokenizer), tokenizer, version


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rl.rollout.gateway",
                                     description="Serve a saved policy over an OpenAI-compatible API.")
    parser.add_argument(
        "--checkpoint", required=True, help="save_pretrained folder, checkpoint or run folder"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", default="k3rl-policy", help="the model id clients name")
    parser.add_argument("--context-tokens", type=int, help="default: the model's max_position_embeddings")
    parser.add_argument("--max-tokens", type=int, default=1024, help="most tokens of one completion")
    parser.add_argument("--max-n", type=int, default=16, help="largest n of one call")
    parser.add_argument("--batch-window-ms", type=float, default=5.0, help="quiet gap ending a gathering")
    parser.add_argument("--max-batch-rows", type=int, default=64, help="most completions of one engine call")
    parser.add_argument("--seed", type=int, default=0, help="of the sampling generator")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    try:
        engine, tokenizer, version = load_policy(args.checkpoint, args.device)
    except ConfigError as exc:
        sys.exit(f"rl.rollout.gateway: {exc}")
    settings = GatewaySettings(
        model_name=args.model_name,
        context_tokens=args.context_tokens or engine.model.config.max_position_embeddings,
        max_tokens=args.max_tokens,
        max_n=args.max_n,
        batch_window_s=args.batch_window_ms / 1000,
        max_batch_rows=args.max_batch_rows,
        open_access=True,
        seed=args.seed,
    )
    torch.manual_seed(args.seed)
    gateway = Gateway(engine, tokenizer, settings)
    gateway.batcher.version = version
    print(f"rl.rollout.gateway: serving {args.checkpoint} (version {version}) as {args.model_name!r} on "
          f"http://{args.host}:{args.port}/v1", flush=True)  # fmt: skip
    uvicorn.run(create_app(gateway), host=args.host, port=args.port, log_level="warning")
