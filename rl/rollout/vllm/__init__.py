"""The K3 policy on vLLM (``rollout.engine=vllm``), built on vLLM 0.32's model-plugin interface.

Modules: `plugin` (registration), `layers` (KDA and NoPE-MLA as vLLM layers), `model` (the model class),
`worker` (weight pushes) and `engine` (`VllmEngine`). Nothing here imports vLLM at package import; the
modules that need it import it themselves.

Design: docs/design/training.md#rl-vllm.
"""
