"""The K3 policy on vLLM (``rollout.engine=vllm``), built on vLLM 0.32's model-plugin interface.

- `rl.vllm.plugin`: registers the model class with vLLM (entry point ``vllm.general_plugins``);
- `rl.vllm.layers`: the KDA and NoPE-MLA layers as vLLM layers, subclasses of `model.kda` / `model.mla`
  that keep their weights and maths and add vLLM's per-request state (KDA) and paged KV cache (MLA);
- `rl.vllm.model`: `K3VllmForCausalLM`, the model class vLLM builds and loads;
- `rl.vllm.worker`: the worker extension that pushes new weights into a running engine;
- `rl.vllm.engine`: `VllmEngine`, the rollout engine (the interface of `rl.generation.TorchEngine`).

Nothing here imports vLLM at package import; the modules that need it import it themselves.
"""
