"""The learner wing: the learner and its Ray actor, sharding over the rank mesh, checkpoints of a sharded
learner, the optimizer and routing replay."""
