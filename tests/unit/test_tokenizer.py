"""The char-level tokenizer."""

import string

import pytest
from transformers import AutoTokenizer

from meshrl.runtime.tokenizer import CHARACTERS, build_char_tokenizer, load_tokenizer, save_tokenizer

TEXT = "hello world\n  ed cba\t{x: 1} ~!" + string.ascii_letters + string.digits + string.punctuation


def test_vocabulary_layout():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert len(tok) == 3 + len(CHARACTERS)
    assert "\n" in CHARACTERS and " " in CHARACTERS and "\r" not in CHARACTERS and "\x0b" not in CHARACTERS
    assert tok.convert_tokens_to_ids(list(CHARACTERS)) == list(range(3, 3 + len(CHARACTERS)))


def test_round_trip_one_id_per_character():
    tok = build_char_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT)
    assert ids == [tok.convert_tokens_to_ids(c) for c in TEXT]  # no bos/eos added, nothing merged
    assert tok.decode(ids) == TEXT
    assert tok.decode([2, *ids, 1], skip_special_tokens=True) == TEXT


def test_saved_folder_loads_with_auto_tokenizer(tmp_path):
    tok = build_char_tokenizer()
    save_tokenizer(tok, tmp_path / "tok")
    for loaded in (AutoTokenizer.from_pretrained(str(tmp_path / "tok")), load_tokenizer(tmp_path / "tok")):
        assert loaded.encode(TEXT) == tok.encode(TEXT)
        assert loaded.decode(tok.encode(TEXT)) == TEXT
        assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 1, 2)


def test_load_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing")
