"""The byte-level tokenizer: round trip, special ids, and the config switch."""

import pytest

from rl.config import TokenizerConfig
from rl.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, ByteTokenizer, build_tokenizer


def test_bytes_round_trip_including_multibyte_text():
    tok = ByteTokenizer()
    text = "guess 5 → higher\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text


def test_special_ids_are_distinct_above_the_bytes_and_dropped_on_decode():
    tok = ByteTokenizer()
    specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.observation_id, tok.action_id, tok.end_id]
    assert len(set(specials)) == 6 and min(specials) == 256 and max(specials) < tok.vocab_size
    assert tok.decode([tok.action_id, *tok.encode("7"), tok.end_id]) == "7"


def test_vocab_size_matches_the_tiny_model_and_too_small_is_refused():
    assert BYTE_TOKENIZER_VOCAB_SIZE == 272
    with pytest.raises(ValueError, match="vocab_size >= 262"):
        ByteTokenizer(vocab_size=260)


def test_unknown_kind_names_the_key():
    with pytest.raises(ValueError, match="tokenizer.kind='sentencepiece'"):
        build_tokenizer(TokenizerConfig(kind="sentencepiece"))
