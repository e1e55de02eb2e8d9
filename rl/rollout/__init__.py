"""The rollout wing: the rollout worker actor, the episode runner and its trees and agent programs,
in-flight snapshots, task wrappers, and the generation engines behind one `Engine` protocol."""
