"""Generation engines: sample the next action of many episodes at once.

``TorchEngine`` (default, CPU or one GPU) runs the K3 policy in inference mode: one left-padded prefill
of every active episode's token ids, then token-by-token decoding with the model's cache until each row
emits the end-of-turn token or ``max_new_tokens`` is reached. The exact sampled ids and their sampling
log-probs are returned (token in, token out), with per-layer expert loads for balancing metrics.

Each turn re-prefills the whole episode so far (the model's short convolutions cannot skip padding in the
middle of a cached sequence, and episodes' observations differ in length). For the short contexts of
the built-in tasks this costs less than a tenth of a learner step.

``vllm`` is a configuration slot only: k3rl has no vLLM engine for the K3 policy in this version, so
``check_vllm_available`` (run when the config is checked) and ``build_engine`` refuse it with a message
that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.config.schema import RolloutConfig
from rl.tokenizer import Tokenizer


@dataclass
class Generation:
    """What the policy produced for one episode in one turn."""

    token_ids: list[int]
    logprobs: list[float]
    ended: bool  # emitted the end-of-turn token (else it hit max_new_tokens)


MASKED_LOGIT = -1e9  # finite, so that masked entries give exp() = 0 and 0 * logit = 0 (no NaN)


def disallowed_tokens(tokenizer: Tokenizer, action_vocabulary: str | None, vocab_size: int):
    """Bool mask ``[vocab]`` of the ids an action may not use, or None when actions are unconstrained.

    ``action_vocabulary`` (``env.action_vocabulary``) lists the characters an action may contain; their
    token ids and the end-of-turn token stay allowed (constrained decoding, as grammar-guided sampling
    does in inference servers). The learner applies the same mask, so log-probs agree.
    """
    if not action_vocabulary:
        return None
    allowed = {tokenizer.end_id}
    for char in action_vocabulary:
        allowed.update(tokenizer.encode(char))
    mask = torch.ones(vocab_size, dtype=torch.bool)
    mask[sorted(allowed)] = False
    return mask


class EngineUnavailable(RuntimeError):
    """The configured generation engine cannot run on this host."""


class TorchEngine:
    """Batched sampling with a ``K3ForCausalLM`` (see the module docstring)."""

    def __init__(
        self, model, tokenizer: Tokenizer, temperature: float = 1.0, action_vocabulary: str | None = None
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0, got {temperature}")
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.disallowed = disallowed_tokens(tokenizer, action_vocabulary, model.config.vocab_size)
        self.expert_loads: dict[int, torch.Tensor] = {}  # layer -> tokens routed to each expert

    @torch.inference_mode()
    def generate(
        self, contexts: list[list[int]], max_new_tokens: int, generator: torch.Generator
    ) -> list[Generation]:
        """Sample up to ``max_new_tokens`` for each context (all run as one batch)."""
        if not contexts:
            return []
        self.model.eval()
        batch = len(contexts)
        width = max(len(c) for c in contexts)
        pad = self.tokenizer.pad_id
        ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[row, width - len(context) :] = 1
        cache = self.model.new_cache(batch)
        out = self.model(ids, attention_mask=mask, cache=cache)
        self._record_loads(out.router_stats)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool)
        end = self.tokenizer.end_id
        for step in range(max_new_tokens):
            logits = out.logits[:, -1].float() / self.temperature
            if self.disallowed is not None:
                logits = logits.masked_fill(self.disallowed, MASKED_LOGIT)
            logp = torch.log_softmax(logits, dim=-1)
            sampled = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            chosen = logp.gather(-1, sampled[:, None]).squeeze(-1)
            for row in torch.nonzero(~done).flatten().tolist():
                tokens[row].append(int(sampled[row]))
                logprobs[row].append(float(chosen[row]))
            done |= sampled == end
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            out = self.model(sampled[:, None], cache=cache)
            self._record_loads(out.router_stats)
        return [Generation(t, lp, bool(t and t[-1] == end)) for t, lp in zip(tokens, logprobs, strict=True)]

    def _record_loads(self, router_stats) -> None:
        for stats in router_stats:
            loads = stats.loads.detach().float().cpu()
            previous = self.expert_loads.get(stats.layer)
            self.expert_loads[stats.layer] = loads if previous is None else previous + loads

    def take_expert_loads(self) -> dict[int, torch.Tensor]:
        """Loads accumulated since the last call (and reset them)."""
        loads, self.expert_loads = self.expert_loads, {}
        return loads


def build_engine(
    rollout_cfg: RolloutConfig, model, tokenizer: Tokenizer, action_vocabulary: str | None = None
) -> TorchEngine:
    """The generation engine named by ``rollout.engine``."""
    engine = rollout_cfg.engine
    if engine == "torch":
        return TorchEngine(model, tokenizer, rollout_cfg.temperature, action_vocabulary)
    if engine == "vllm":
        check_vllm_available()
    raise EngineUnavailable(f"rollout.engine={engine!r} is unknown; use 'torch' or 'vllm'")


def check_vllm_available() -> None:
    """Always raise ``EngineUnavailable``: k3rl has no vLLM engine for the K3 policy in this version.

    ``rollout=vllm`` is kept as the configuration slot for it; the `vllm` extra installs only the vllm
    package. The message also names what this host lacks for vLLM (the package, a CUDA GPU).
    """
    missing = []
    try:
        import vllm  # noqa: F401
    except ImportError:
        missing.append("the vllm package")
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    lacks = f"; this host also lacks {' and '.join(missing)}" if missing else ""
    raise EngineUnavailable(
        "rollout=vllm is not implemented: k3rl has no vLLM engine for the K3 policy in this version (the "
        f"`vllm` extra only installs the vllm package){lacks}. Use rollout=torch (the default)."
    )
