"""The driver wing: the training loop (`trainer`), where its batches come from (`sources`, `async_source`),
its handles on the rollout workers and the learner ranks, held-out evaluation and the pre-flight check."""
