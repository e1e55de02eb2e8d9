"""Tokenizers: a byte-level one with special turn tokens (the default, nothing to download) and a wrapper
around a Hugging Face tokenizer stored in a local folder.

Token ids are kept as generated (token in, token out), so earlier turns of an episode are never
re-tokenised.

Design: docs/design/training.md#rl-tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from rl.config.schema import TokenizerConfig

BYTE_VOCAB = 256
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|observation|>", "<|action|>", "<|end|>")
# Ids 256..271: the six specials above, then reserved ids so that the vocabulary is a multiple of 16.
BYTE_TOKENIZER_VOCAB_SIZE = 272


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int
    observation_id: int
    action_id: int
    end_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def observation_turn(tok: Tokenizer, observation: str, first: bool = False) -> list[int]:
    """An observation framed as the policy reads it: its turn (``observation_id``, text, ``end_id``), then
    the opener of the action turn that answers it; ``first``: the sequence's start (``bos_id``) before."""
    return [*([tok.bos_id] if first else []), tok.observation_id, *tok.encode(observation), tok.end_id,
            tok.action_id]  # fmt: skip


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; the special turn tokens follow (see :data:`SPECIAL_TOKENS`)."""

    vocab_size: int = BYTE_TOKENIZER_VOCAB_SIZE
    pad_id: ClassVar[int] = BYTE_VOCAB + 0
    bos_id: ClassVar[int] = BYTE_VOCAB + 1
    eos_id: ClassVar[int] = BYTE_VOCAB + 2
    observation_id: ClassVar[int] = BYTE_VOCAB + 3
    action_id: ClassVar[int] = BYTE_VOCAB + 4
    end_id: ClassVar[int] = BYTE_VOCAB + 5

    def __post_init__(self) -> None:
        if self.vocab_size < BYTE_VOCAB + len(SPECIAL_TOKENS):
            raise ValueError(
                f"byte tokenizer needs vocab_size >= {BYTE_VOCAB + len(SPECIAL_TOKENS)}, "
                f"got {self.vocab_size}"
            )

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local folder; the turn tokens are special tokens of that tokenizer.

    Needs ``transformers`` (not a dependency of k3rl); the folder must already hold the tokenizer files
    (nothing is downloaded).
    """

    def __init__(self, path: str, special_tokens: dict[str, str]) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "tokenizer.kind=hf needs the `transformers` package; install it or use tokenizer.kind=bytes"
            ) from exc
        if not Path(path).is_dir():
            raise ValueError(f"tokenizer.path={path!r} is not a folder (it must hold a saved HF tokenizer)")
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"tokenizer.path={path!r}: cannot load a tokenizer from it ({exc})") from None
        missing = [
            name for name in ("pad", "bos", "observation", "action", "end") if name not in special_tokens
        ]
        if missing:
            raise ValueError(f"tokenizer.special_tokens is missing {missing} for the HF tokenizer at {path}")
        ids = {name: self._tok.convert_tokens_to_ids(tok) for name, tok in special_tokens.items()}
        unknown = [special_tokens[n] for n, i in ids.items() if i is None or i == self._tok.unk_token_id]
        if unknown:
            raise ValueError(f"tokens {unknown} are not in the HF tokenizer at {path}")
        self.vocab_size = len(self._tok)
        self.pad_id, self.bos_id = ids["pad"], ids["bos"]
        self.observation_id, self.action_id, self.end_id = ids["observation"], ids["action"], ids["end"]
        self._turn_ids = frozenset(ids.values())

    def encode(self, text: str) -> list[int]:
        """Text to ids; special-token strings in the text (``<|end|>`` in a file an agent ``cat``-s) are
        encoded as plain text, so an observation can never forge a turn token."""
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        """Ids back to text, exactly (no clean-up of spaces); turn and other special tokens are dropped,
        whether or not the tokenizer marks the turn tokens as special."""
        kept = [i for i in ids if i not in self._turn_ids]
        return self._tok.decode(kept, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer named by the ``tokenizer`` config section (``kind: bytes`` or ``kind: hf``)."""
    if cfg.kind == "bytes":
        return ByteTokenizer(vocab_size=cfg.vocab_size)
    if cfg.kind == "hf":
        return HFTokenizer(cfg.path, dict(cfg.special_tokens or {}))
    raise ValueError(f"tokenizer.kind={cfg.kind!r} is unknown; use 'bytes' or 'hf'")


MASKED_LOGIT = -1e9  # finite, so that masked entries give exp() = 0 and 0 * logit = 0 (no NaN)


def disallowed_tokens(tokenizer: Tokenizer, action_vocabulary: str | None, vocab_size: int):
    """Bool mask ``[vocab]`` of the ids an action may not use, or None when actions are unconstrained.

    ``action_vocabulary`` (``env.action_vocabulary``) lists the characters an action may contain; their
    token ids and the end-of-turn token stay allowed (constrained decoding, as grammar-guided sampling
    does in inference servers). The learner applies the same mask, so log-probs agree.
    """
    if not action_vocabulary:
        return None
    allowed = {tokenizer.end_id}
    for char in action_vocabulary:
        allowed.update(tokenizer.encode(char))
    mask = torch.ones(vocab_size, dtype=torch.bool)
    mask[sorted(allowed)] = False
    return mask
