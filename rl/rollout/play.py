"""The play loop, written once: observe → generate → act → record, one turn of many episodes at a time.
The rollout runner (batched generation, env steps on threads within the residency's slots; its in-flight
resume and its trees included) and the demonstrations recorder (an expert in the policy's place) both play
through `play`; a turn's tokens are framed by `rl.episode.Episode` (`begin`, `stepped`) and `record_action`.
"""

from __future__ import annotations

from collections.abc import Callable

from rl.episode import Episode
from rl.rollout.torch_engine import Generation
from rl.tokenizer import Tokenizer

Generate = Callable[[list[int]], list[Generation]]  # active indices -> one generation each, in order
StepResult = tuple[tuple | None, BaseException | None]  # (env.step's result, None) or (None, its error)
Step = Callable[[list[tuple[int, str]]], dict[int, StepResult]]  # (index, action) jobs -> their results


def record_action(episode: Episode, gen: Generation, tok: Tokenizer, version: int) -> tuple[str, int]:
    """Append one generated action to ``episode`` (trained, with its log-probs, routes and ``version``),
    then the end-of-turn token the policy did not emit (not trained). Returns the action's text and the
    index of its last token (where the step's reward goes)."""
    episode.append(gen.token_ids, trained=True, logprobs=gen.logprobs, version=version, routes=gen.routes)
    reward_at = len(episode.tokens) - 1
    if not gen.ended:
        episode.append([tok.end_id], trained=False, version=version)
    return tok.decode(gen.token_ids), reward_at


def play(
    episodes: list[Episode],
    active: list[int],
    generate: Generate,
    step: Step,
    tok: Tokenizer,
    room: int,
    version: Callable[[], int],
    before_turn: Callable[[list[int]], None] | None = None,
    after_turn: Callable[[list[int]], list[int]] | None = None,
) -> None:
    """Play the episodes at ``active`` to their end. Each turn: ``before_turn(active)``; the weights
    ``version()`` in use; one ``generate`` call for every active episode; their actions recorded; one
    ``step`` call for all of them; each result recorded (`Episode.stepped`, ``room``: the most tokens that
    still leave room for an action) or its error failing its episode; then ``after_turn(active)`` returns
    the episodes that play the next turn (e.g. a tree's leaves and their new children)."""
    while active:
        if before_turn is not None:
            before_turn(active)
        turn_version = version()  # async: newer weights are swapped in here, between turns
        generations = generate(active)
        jobs, reward_at = [], {}
        for i, gen in zip(active, generations, strict=True):
            action, reward_at[i] = record_action(episodes[i], gen, tok, turn_version)
            jobs.append((i, action))
        results = step(jobs)
        still_active = []
        for i in active:
            result, error = results[i]
            if error is not None:
                episodes[i].fail(error)
            elif episodes[i].stepped(result, reward_at[i], tok, turn_version, room):
                still_active.append(i)
        active = still_active if after_turn is None else after_turn(still_active)
