"""Generation engines: sample the next action of many episodes at once.

``TorchEngine`` (default, CPU or one GPU) runs the K3 policy in inference mode: one left-padded prefill
of every active episode's token ids, then token-by-token decoding with the model's cache until each row
emits the end-of-turn token or ``max_new_tokens`` is reached. The exact sampled ids and their sampling
log-probs are returned (token in, token out), with the experts each sampled token was produced with
(``Generation.routes``, for routing replay in the learner) and per-layer expert loads for balancing metrics.

Each turn re-prefills the whole episode so far (the model's short convolutions cannot skip padding in the
middle of a cached sequence, and episodes' observations differ in length). For the short contexts of
the built-in tasks this costs less than a tenth of a learner step.

Branching rollouts (Tree-GRPO, `rl.algos.tree_grpo`) instead keep one episode's state (`EpisodeState`:
its cache, one sequence, so no padding) across turns: `TorchEngine.read` feeds new tokens into it,
`EpisodeState.branch` copies it into the children of a branch node and `TorchEngine.continue_from`
samples each child's next action from its copy, without reading the shared prefix again.

A caller serving requests of their own (`rl.rollout.gateway`) passes a `Sampling` per context: its
temperature,
nucleus (top-p) and token limit replace the engine's for that row; the recorded log-probs are then those
of the distribution each token was drawn from (temperature and top-p applied).

``rollout.engine=vllm`` selects `rl.rollout.vllm.engine.VllmEngine` instead (the same interface, the policy
run by
an in-process vLLM engine); `rl.rollout.engines.build_engine` builds the engine the config names.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from model.cache import K3Cache
from rl.errors import StaleWeights
from rl.tokenizer import MASKED_LOGIT, Tokenizer, disallowed_tokens


@dataclass
class Generation:
    """What the policy produced for one episode in one turn.

    ``routes`` (routing replay, R3) is the contract every engine fills the same way: an integer tensor
    (int16, or int32 for more than 32767 experts) on the CPU of shape ``[len(token_ids), n_moe_layers,
    top_k]``. Row ``j`` holds, for every MoE layer of the model in layer order, the ``top_k`` expert ids
    the router chose at the forward position whose logits sampled ``token_ids[j]``: the context's last
    token for ``j = 0`` (its prefill), the previously generated token ``token_ids[j-1]`` after that (its
    decode step). That is the position the learner computes the token's log-prob from, and the episode
    keeps the row with the token (`rl.episode.Episode.routes`). The order of the ``top_k`` ids does not
    matter (they are compared and replayed as a set). None: the engine recorded no routing (the learner
    then routes those tokens itself and leaves them out of the routing-mismatch metric). An engine that
    sees the whole sequence's routing at once (e.g. one that returns the routed experts of every
    position, prompt included) takes the rows of positions ``len(context) - 1`` to
    ``len(context) + len(token_ids) - 2``.
    """

    token_ids: list[int]
    logprobs: list[float]
    ended: bool  # emitted the end-of-turn token (else it hit max_new_tokens)
    routes: torch.Tensor | None = None  # [len(token_ids), n_moe_layers, top_k]; see the class docstring
    # context tokens this call computed, the rest served from a cache (vLLM's prefix cache, a carried
    # policy state); None: not reported
    context_read: int | None = None


@dataclass
class EpisodeState:
    """The policy's state after one episode's tokens so far (`TorchEngine.read`): the model's cache of
    that one sequence (each KDA layer's recurrent and conv state, each MLA layer's latent KV), the logits
    after its last read token, and ``pending`` tokens of the context not read yet (the last sampled
    token, until the next `read`). `branch` copies it into the children of a branch node, so that they
    continue from the shared prefix without reading it again."""

    cache: K3Cache
    logits: torch.Tensor | None = None  # [vocab], after the last read token (None while tokens are pending)
    pending: list[int] = field(default_factory=list)
    routes: torch.Tensor | None = None  # [n_moe_layers, top_k]: the experts of the last read token

    def branch(self, width: int) -> list[EpisodeState]:
        """``width`` independent copies (each child's later tokens change only its own)."""
        if width < 1:
            raise ValueError(f"a branch needs at least one child, got width={width}")
        return [copy.deepcopy(self) for _ in range(width)]


@dataclass(frozen=True)
class Sampling:
    """One context's sampling parameters (`TorchEngine.generate`'s ``sampling``)."""

    temperature: float  # > 0
    top_p: float  # in (0, 1]: sample from the smallest set of tokens whose probabilities reach it
    max_new_tokens: int  # >= 1, at most the call's ``max_new_tokens``


def nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[rows, vocab]`` renormalised over each row's top-p nucleus (``top_p`` [rows]); the
    tokens outside it get `MASKED_LOGIT`. The most likely token is always kept."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()  # probability mass ranked above each token
    drop_sorted = before >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, MASKED_LOGIT), dim=-1)


def route_dtype(num_experts: int) -> torch.dtype:
    """The integer dtype of recorded expert ids: int16 while they fit, else int32."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def last_token_routes(router_stats, lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts used at the last real token of each row: ``[rows, n_moe_layers, top_k]`` on the CPU.

    ``router_stats`` are a forward's (real tokens only, rows one after another); ``lengths`` [rows] the
    real tokens of each row (left padding, so each row's last token is its last real one)."""
    last = torch.cumsum(lengths, 0) - 1
    if not router_stats:
        return torch.empty((len(lengths), 0, 0), dtype=dtype)
    rows = [stats.ids[last.to(stats.ids.device)] for stats in router_stats]
    return torch.stack(rows, dim=1).to("cpu", dtype)


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
        self.route_dtype = route_dtype(model.config.num_experts)
        self.expert_loads: dict[int, torch.Tensor] = {}  # layer -> tokens routed to each expert
        self.held = -1  # the weights version `load_weights` or `swap_staged` left in ``model``; -1: none
        self._standby = None  # the policy copy `stage_weights` fills beside a generation
        self._staged: int | None = None  # the version in ``_standby``, until swapped in

    @torch.inference_mode()
    def generate(
        self,
        contexts: list[list[int]],
        max_new_tokens: int,
        generator: torch.Generator,
        sampling: list[Sampling] | None = None,
        on_step: Callable[[list[tuple[int, int, float]]], None] | None = None,
    ) -> list[Generation]:
        """Sample up to ``max_new_tokens`` for each context (all run as one batch), recording the experts
        each sampled token was produced with (`Generation.routes`). ``sampling``: one `Sampling` per
        context instead of the engine's temperature, no top-p and ``max_new_tokens``. ``on_step``: called
        after each decoding step with (row, token id, log-prob) of each row that sampled in it (streaming)."""
        if not contexts:
            return []
        if sampling is not None and len(sampling) != len(contexts):
            raise ValueError(f"{len(sampling)} sampling parameters for {len(contexts)} contexts")
        self.model.eval()
        batch = len(contexts)
        width = max(len(c) for c in contexts)
        pad = self.tokenizer.pad_id
        ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[row, width - len(context) :] = 1
        device = next(self.model.parameters()).device
        cache = self.model.new_cache(batch)
        out = self.model(ids.to(device), attention_mask=mask.to(device), cache=cache)
        self._record_loads(out.router_stats)
        step_routes = last_token_routes(out.router_stats, mask.sum(1), self.route_dtype)
        ones = torch.ones(batch, dtype=torch.long)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        routes: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool)
        end = self.tokenizer.end_id
        temperature, top_p, limits = self.temperature, None, None
        if sampling is not None:
            temperature = torch.tensor([s.temperature for s in sampling], dtype=torch.float)[:, None]
            top_p = torch.tensor([s.top_p for s in sampling], dtype=torch.float)
            limits = torch.tensor([min(s.max_new_tokens, max_new_tokens) for s in sampling])
        for step in range(max_new_tokens):
            logp = self._action_logp(out.logits[:, -1], temperature)
            if top_p is not None and bool((top_p < 1).any()):
                logp = torch.where((top_p < 1)[:, None], nucleus(logp, top_p), logp)
            sampled = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            chosen = logp.gather(-1, sampled[:, None]).squeeze(-1)
            active = torch.nonzero(~done).flatten().tolist()
            for row in active:
                tokens[row].append(int(sampled[row]))
                logprobs[row].append(float(chosen[row]))
                routes[row].append(step_routes[row])
            if on_step is not None:
                on_step([(row, tokens[row][-1], logprobs[row][-1]) for row in active])
            done |= sampled == end
            if limits is not None:
                done |= limits <= step + 1
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            out = self.model(sampled[:, None].to(device), cache=cache)
            self._record_loads(out.router_stats)
            step_routes = last_token_routes(out.router_stats, ones, self.route_dtype)
        return [
            Generation(t, lp, bool(t and t[-1] == end), torch.stack(r) if r else step_routes[:0], len(c))
            for t, lp, r, c in zip(tokens, logprobs, routes, contexts, strict=True)
        ]

    def _action_logp(self, logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
        """Sampling log-probs ``[rows, vocab]`` on the CPU (where the generator samples) of the last
        position's ``logits``: temperature, then the action-vocabulary mask."""
        logits = logits.float().cpu() / temperature
        if self.disallowed is not None:
            logits = logits.masked_fill(self.disallowed, MASKED_LOGIT)
        return torch.log_softmax(logits, dim=-1)

    @torch.inference_mode()
    def read(self, tokens: list[int], state: EpisodeState | None = None) -> EpisodeState:
        """Read ``tokens`` (after ``state``'s pending ones) into one episode's state, in place; None
        starts a new episode. Returns the state, its logits those after the last token."""
        if state is None:
            state = EpisodeState(self.model.new_cache(1))
        if state.cache.batch_size != 1:
            raise ValueError(f"an episode state holds one sequence, this cache {state.cache.batch_size}")
        new = [*state.pending, *tokens]
        if not new:
            raise ValueError("nothing to read: no tokens and none pending")
        self.model.eval()
        device = next(self.model.parameters()).device
        out = self.model(torch.tensor([new], dtype=torch.long, device=device), cache=state.cache)
        self._record_loads(out.router_stats)
        state.logits, state.pending = out.logits[0, -1], []
        state.routes = last_token_routes(out.router_stats, torch.tensor([len(new)]), self.route_dtype)[0]
        return state

    @torch.inference_mode()
    def entropy(self, state: EpisodeState) -> float:
        """The entropy (nats) of the distribution the next action token of ``state`` is drawn from
        (temperature and action vocabulary applied): how unsure the policy is at this point."""
        if state.logits is None:
            raise ValueError("the state has pending tokens: read the next observation first")
        logp = self._action_logp(state.logits[None], self.temperature)[0]
        return float(-(logp.exp() * logp).sum())

    @torch.inference_mode()
    def continue_from(
        self, state: EpisodeState, max_new_tokens: int, generator: torch.Generator
    ) -> Generation:
        """Sample the next action of the episode of ``state`` (read up to now, see `read`), advancing the
        state in place: its last sampled token is left pending for the next `read`."""
        if state.logits is None:
            raise ValueError("the state has pending tokens: read the next observation first")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model.eval()
        device = next(self.model.parameters()).device
        logits, step_routes, end = state.logits, state.routes, self.tokenizer.end_id
        tokens: list[int] = []
        logprobs: list[float] = []
        routes: list[torch.Tensor] = []  # each sampled token's: the experts of the position that sampled it
        one = torch.ones(1, dtype=torch.long)
        for step in range(max_new_tokens):
            logp = self._action_logp(logits[None], self.temperature)
            sampled = torch.multinomial(logp.exp(), 1, generator=generator)
            tokens.append(int(sampled))
            logprobs.append(float(logp[0, tokens[-1]]))
            if step_routes is not None:
                routes.append(step_routes)
            if tokens[-1] == end or step == max_new_tokens - 1:
                break
            out = self.model(sampled.to(device), cache=state.cache)
            self._record_loads(out.router_stats)
            logits = out.logits[0, -1]
            step_routes = last_token_routes(out.router_stats, one, self.route_dtype)[0]
        state.logits, state.pending, state.routes = None, [tokens[-1]], None
        recorded = torch.stack(routes) if len(routes) == len(tokens) else None
        return Generation(tokens, logprobs, tokens[-1] == end, recorded)

    def _record_loads(self, router_stats) -> None:
        for stats in router_stats:
            loads = stats.loads.detach().float().cpu()
            previous = self.expert_loads.get(stats.layer)
            self.expert_loads[stats.layer] = loads if previous is None else previous + loads

    def take_expert_loads(self) -> dict[int, torch.Tensor]:
        """Loads accumulated since the last call (and reset them)."""
        loads, self.expert_loads = self.expert_loads, {}
        return loads

    # ------------------------------------------------------------------ weights (`rl.rollout.engines.Engine`)
    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Copy the learner's weights of ``version`` into the policy (no generation runs); the version."""
        self.model.load_state_dict(state_dict)
        self.held = version
        return version

    def stage_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy ``version`` into a standby copy of the policy while a generation may run on ``model``."""
        if self._standby is None:
            self._standby = copy.deepcopy(self.model)
        self._standby.load_state_dict(state_dict)
        self._staged = version

    def swap_staged(self) -> int | None:
        """Between turns: make the staged copy the policy (a pointer swap); its version, None if none."""
        if self._staged is None:
            return None
        self.model, self._standby = self._standby, self.model
        self.held, self._staged = self._staged, None
        return self.held

    def require_version(self, version: int) -> None:
        """Raise `rl.errors.StaleWeights` unless the policy holds the weights of ``version``."""
        if self.held != version:
            raise StaleWeights(f"the torch engine holds weights v{self.held} but the batch needs v{version}")

    def stats(self) -> dict[str, Any]:
        """Nothing beyond what the worker reports: the policy lives in this process."""
        return {}
