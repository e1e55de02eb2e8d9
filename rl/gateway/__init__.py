"""An OpenAI-compatible gateway over the policy, so that agent programs written against OpenAI's API are
played by the K3 policy and every token they get is captured for training.

`rl.gateway.service.Gateway` (sampling through `rl.gateway.batcher`, recording in `rl.gateway.capture`),
`rl.gateway.app.create_app` (its HTTP API), `rl.gateway.samples.episode_samples` (an episode's calls as
training episodes), `rl.gateway.serve` (``python -m rl.gateway``, a saved policy on its own),
`rl.gateway.sandbox_link.SandboxLink` (the gateway on the loopback of sandboxes, which have no network).
"""
