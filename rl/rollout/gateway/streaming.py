"""`TextDeltas`: one completion's text released piece by piece as its tokens are sampled (streaming).

Text is released only once no later token can change it: a trailing partial character (decoded as
U+FFFD) waits for its other bytes, a tail that could begin a stop sequence waits to see whether it
does, and ``hold`` markers (the ``<tool_call>`` tag when the call offers tools) keep everything from
the marker on, and the newlines before it, for the end (`rest`), where the completion's final text
decides. So the released pieces followed by `rest` are exactly the text a call without streaming gets.
"""

from __future__ import annotations

from rl.tokenizer import Tokenizer

PARTIAL = "\ufffd"  # what a token that ends inside a character decodes to


class TextDeltas:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], hold: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = hold
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.sent = ""  # text released so far
        self.released = 0  # tokens whose text (and log-probs) were released
        self.stopped = False  # a stop sequence was completed: later tokens are not part of the completion

    def _safe(self, text: str) -> int:
        """How much of ``text`` no later token can change or cut."""
        safe = len(text.rstrip(PARTIAL))
        for marker in self.hold:
            if marker in text:
                safe = min(safe, text.index(marker))
        for marker in (*self.stops, *self.hold):
            for k in range(min(len(marker) - 1, safe), 0, -1):
                if text[:safe].endswith(marker[:k]):
                    safe -= k
                    break
        if self.hold:
            safe = len(text[:safe].rstrip("\n"))
        return safe

    def push(self, token: int, logprob: float) -> tuple[str, list[int], list[float]]:
        """Take the next sampled token: (new text, the ids and log-probs of the tokens it releases)."""
        if self.stopped:
            return "", [], []
        self.ids.append(token)
        self.logprobs.append(logprob)
        text = self.tokenizer.decode(self.ids)
        found = [text.index(s) for s in self.stops if s in text]
        if found:
            text, self.stopped = text[: min(found)], True
            safe = len(text)
        else:
            safe = self._safe(text)
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return "", [], []
        return self._release(text[len(self.sent) : safe], len(self.ids))

    def _release(self, text: str, upto: int) -> tuple[str, list[int], list[float]]:
        ids, logprobs = self.ids[self.released : upto], self.logprobs[self.released : upto]
        self.sent += text
        self.released = max(self.released, upto)
        return text, ids, logprobs

    def rest(self, final: str, ids: list[int], logprobs: list[float]) -> tuple[str, list[int], list[float]]:
        """What is left to release once the completion is done: its ``final`` text (and its kept tokens
        ``ids``, ``logprobs``) past what was released."""
        if not final.startswith(self.sent):
            raise RuntimeError(
                f"the streamed text {self.sent!r} is not the start of the completion {final!r}"
            )
        self.ids, self.logprobs = list(ids), list(logprobs)
        return self._release(final[len(self.sent) :], len(ids))
