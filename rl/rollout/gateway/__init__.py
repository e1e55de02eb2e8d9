"""An OpenAI-compatible gateway over the policy, so that agent programs written against OpenAI's API are
played by the K3 policy and every token they get is captured for training. Part of the rollout wing: each
rollout worker serves one over its engine for its agent-program episodes.

`service.Gateway` (sampling through `batcher`, recording in `capture`), `app.create_app` (its HTTP API),
`samples.episode_samples` (an episode's calls as training episodes), `serve` (``python -m
rl.rollout.gateway``, a saved policy on its own), `sandbox_link.SandboxLink` (the gateway on the loopback
of sandboxes, which have no network).
"""
