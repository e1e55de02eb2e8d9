"""Routing replay (R3) on one learner step of staleness: how far the learner's routing and log-probs are
from the rollout's, with and without replaying the rollout's experts.

Rewrites the `routing-replay` section of docs/benchmarks.md.
Usage: python bench/routing_replay.py [--no-write]

Design: docs/design/benchmarks.md#bench-routing-replay.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # imported by a test: after the checkout, so that
    sys.path.append(str(Path(__file__).resolve().parent))  # bench/model.py never shadows model/
from bench_report import compose, training_machine, write_section  # noqa: E402

SECTION = "routing-replay"


def sample(cfg, weights: dict, generator: torch.Generator, turns: int = 3) -> list:
    """4 episodes sampled by ``weights`` with the torch engine, laid out as the rollout runner does."""
    from rl.episode import Episode
    from rl.policy import build_policy_shell
    from rl.rollout.torch_engine import TorchEngine
    from rl.tokenizer import build_tokenizer

    tok = build_tokenizer(cfg.tokenizer)
    model = build_policy_shell(cfg.model)
    model.load_state_dict(weights)
    engine = TorchEngine(model, tok, cfg.rollout.temperature, cfg.env.action_vocabulary)
    episodes = [Episode(cfg.env.id, seed=i // 2, group=i // 2) for i in range(4)]
    for i, e in enumerate(episodes):
        prompt = [tok.bos_id, tok.observation_id, *tok.encode(f"guess 0-{i + 4}"), tok.end_id, tok.action_id]
        e.append(prompt, trained=False)
    for _turn in range(turns):
        for e, gen in zip(episodes, engine.generate([e.tokens for e in episodes], 3, generator), strict=True):
            e.append(gen.token_ids, trained=True, logprobs=gen.logprobs, routes=gen.routes)
            if not gen.ended:
                e.append([tok.end_id], trained=False)
            e.step_rewards.append((len(e.tokens) - 1, float(gen.token_ids[0] % 2)))
            e.append([tok.observation_id, *tok.encode("higher"), tok.end_id, tok.action_id], trained=False)
    return episodes


def measure(cfg, weights: dict, batch, replay: bool) -> tuple[float, dict]:
    """The log-prob gap and `rl.learner.routing.routing_mismatch` of a learner holding ``weights`` on
    ``batch``."""
    from rl.algos import masked_mean
    from rl.learner.learner import Learner
    from rl.learner.routing import routing_mismatch

    learner = Learner(replace(cfg, algo=replace(cfg.algo, routing_replay=replay)))
    learner.load_weights(weights)
    with torch.no_grad():
        logp, _, _, stats = learner._forward(batch)
    gap = masked_mean((logp - batch.rollout_logprobs).abs(), batch.action_mask).item()
    return gap, routing_mismatch(stats, batch.attention_mask, batch.routes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="learner steps (one row pair each)")
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from rl.episode import collate
    from rl.learner.learner import Learner

    started = time.perf_counter()
    machine = training_machine()
    cfg = compose(["algo.group_size=2", "algo.episodes_per_step=4"])
    learner = Learner(cfg)
    generator = torch.Generator().manual_seed(0)
    lines = [
        "| step | learner holds | replay | log-prob gap | mismatch (layer mean) | mismatch (any layer) "
        "| tokens |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for step in range(args.steps):
        old = learner.weights()[1]
        batch = collate(sample(cfg, old, generator), learner.pad_id)
        learner.train_step(sample(cfg, old, generator))
        new = learner.weights()[1]
        biases = {k: new[k] if k.endswith("e_score_correction_bias") else v for k, v in old.items()}
        for label, weights in (("v+1", new), ("v, v+1's router biases", biases)):
            for replay in (False, True):
                gap, m = measure(cfg, weights, batch, replay)
                line = (f"| {step} | {label} | {'on' if replay else 'off'} | {gap:.4f} | "
                        f"{m['routing_mismatch']:.3f} | {m['routing_mismatch_any']:.3f} | "
                        f"{int(m['routing_recorded_tokens'])} |")
                print(line, flush=True)
                lines.append(line)
    body = "\n".join([
        "## Routing replay (`bench/routing_replay.py`)\n",
        f"Command: `python bench/routing_replay.py --steps {args.steps}`. {machine}\n",
        "Episodes sampled at v, measured after one learner step (v+1: 2 epochs x 2 minibatches of",
        "`make train`'s algo, each followed by quantile balancing), and on v's weights with only v+1's",
        "router biases. The learner's own routing is measured with replay on too (it is what it would",
        "have chosen); with replay on, the forward uses the recorded experts of every generated token.\n",
        *lines,
        f"\n(total {time.perf_counter() - started:.0f} s)",
    ])
    if args.no_write:
        print(body)
    else:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
