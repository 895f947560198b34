"""meshrl.data: sources, formats and masks, packing, the resumable order, bad input; SFT's DataDocuments."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from meshrl.data import EpochOrder, Formatter, columns_of, read_rows, resolve_format, split_validation
from meshrl.envs.base import stop_token_ids
from meshrl.runtime.config import DataConfig, SFTConfig, validate
from meshrl.runtime.tokenizer import build_bpe_tokenizer, build_char_tokenizer, load_tokenizer, save_tokenizer
from meshrl.runtime.train.packing import count_loss_tokens, pack_sft
from meshrl.runtime.train.sft_data import DataDocuments, check_data

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"}, {"role": "assistant", "content": "no"}]
ROWS = {
    "messages": [{"messages": CHAT}, {"messages": CHAT[:2]}],
    "prompt_completion": [{"prompt": "ab", "completion": "cd"}, {"prompt": "x", "completion": "yz"}],
    "text": [{"text": "hello"}, {"text": "bye"}],
}
# A one-character-per-token template for the char tokenizer: "<u>hi<eos><a>yo<eos>..."
CHAR_TEMPLATE = ("{% for m in messages %}<{{ m.role[0] }}>{{ m.content }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<a>{% endif %}")


def write(rows: list[dict], path: Path) -> Path:
    """Write rows as the source kind named by path: .jsonl, .parquet, or a save_to_disk folder."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def char_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHAR_TEMPLATE
    return tok


@pytest.mark.parametrize("fmt", list(ROWS))
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ""])
def test_every_source_and_format_gives_the_same_documents(tmp_path, fmt, suffix):
    path = write(ROWS[fmt], tmp_path / f"data{suffix}")
    assert sorted(columns_of(path)) == sorted(ROWS[fmt][0])
    rows = read_rows(path)
    assert rows.where[1] == (f"{path}:2" if suffix == ".jsonl" else f"{path} row 1")
    assert resolve_format("auto", columns_of(path), str(path)) == fmt
    tok = char_tokenizer()
    docs = [Formatter(tok, fmt)(r) for r in rows.rows]
    expected = [Formatter(tok, fmt)(r) for r in ROWS[fmt]]
    assert docs == expected and all(d.num_trained > 0 for d in docs)


def test_a_dataset_dict_folder_reads_its_split(tmp_path):
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS["text"]),
                          "test": datasets.Dataset.from_list(ROWS["text"][:1])}).save_to_disk(str(folder))
    assert len(read_rows(folder).rows) == 2 and len(read_rows(folder, "test").rows) == 1
    with pytest.raises(ValueError, match="no split 'dev'"):
        read_rows(folder, "dev")


def test_plain_formats_train_the_completion_and_eos():
    tok = char_tokenizer()
    doc = Formatter(tok, "prompt_completion")({"prompt": "ab", "completion": "cd"})
    assert doc.ids == tok.encode("abcd", add_special_tokens=False) + [tok.eos_token_id]
    assert doc.trained == [False, False, True, True, True]
    assert Formatter(tok, "prompt_completion", "all")({"prompt": "ab", "completion": "cd"}).trained == [True] * 5
    text = Formatter(tok, "text")({"text": "hey"})
    assert text.ids[-1] == tok.eos_token_id and text.trained == [True] * 4


def test_assistant_only_mask_is_exact_for_a_two_turn_chat():
    tok = char_tokenizer()
    doc = Formatter(tok, "messages")({"messages": CHAT})
    # "<u>hi<eos><a>yo<eos><u>ok<eos><a>no<eos>": one token per character, <eos> one token
    #  0..2 <u>  3,4 hi  5 eos  6..8 <a>  9,10 yo  11 eos  12..14 <u>  15,16 ok  17 eos  18..20 <a>  21,22 no  23 eos
    assert tok.decode(doc.ids, skip_special_tokens=False) == "<u>hi<eos><a>yo<eos><u>ok<eos><a>no<eos>"
    assert [i for i, t in enumerate(doc.trained) if t] == [9, 10, 11, 21, 22, 23]
    last = Formatter(tok, "messages", "last_turn")({"messages": CHAT})
    assert [i for i, t in enumerate(last.trained) if t] == [21, 22, 23]
    assert all(Formatter(tok, "messages", "all")({"messages": CHAT}).trained)
    # packed, a position is a loss position when its *target* is trained: one to the left
    [[mb]] = pack_sft([doc.as_example()], seq_len=64, num_ranks=1)
    assert mb["loss_mask"][0].nonzero().flatten().tolist() == [8, 9, 10, 20, 21, 22]
    assert mb["targets"][0, 8].item() == tok.convert_tokens_to_ids("y")


def test_prompt_completion_chats_train_only_the_completion():
    tok = char_tokenizer()
    doc = Formatter(tok, "prompt_completion")({"prompt": CHAT[:3], "completion": CHAT[3:]})
    assert doc.ids == Formatter(tok, "messages")({"messages": CHAT}).ids
    assert [i for i, t in enumerate(doc.trained) if t] == [21, 22, 23]


def test_chatml_assistant_tokens_with_the_bpe_tokenizer():
    tok = build_bpe_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus three?"},
            {"role": "assistant", "content": "five"}, {"role": "user", "content": "and two plus two?"},
            {"role": "assistant", "content": "four"}]
    doc = Formatter(tok, "messages")({"messages": chat})
    spans, run = [], []
    for i, t in zip(doc.ids, doc.trained):
        if t:
            run.append(i)
        elif run:
            spans.append(tok.decode(run)), run.clear()
    spans.append(tok.decode(run))
    assert spans == ["five<|im_end|>\n", "four<|im_end|>\n"]


def test_a_chat_template_in_the_config_overrides_the_tokenizers(tmp_path):
    tok = build_bpe_tokenizer()
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    cfg = DataConfig(path=str(write(ROWS["messages"], tmp_path / "d.jsonl")), chat_template=str(template))
    docs = DataDocuments(cfg, tok, max_tokens=512)
    assert tok.decode(docs.train[1].ids) == "user: hi\nassistant: yo\n"


def test_packing_keeps_chat_documents_apart():
    from meshrl.models import get_family
    from meshrl.models.common.attention import CausalAttention, make_document_attention
    from meshrl.runtime.train.logprob_head import LogprobHead

    tok = char_tokenizer()
    fmt = Formatter(tok, "messages")
    docs = [fmt({"messages": CHAT}), fmt({"messages": [CHAT[0], {"role": "assistant", "content": "a longer one"}]})]
    family = get_family("qwen3")
    args = dataclasses.replace(family.flavors["debug"], vocab_size=len(tok))
    with torch.device("meta"):
        model = family.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    [[packed]] = pack_sft([d.as_example() for d in docs], seq_len=256, num_ranks=1)
    assert packed["doc_ids"].max() == 1  # both documents in one row
    with torch.no_grad():
        together, _ = model(packed["input_ids"], packed["position_ids"], make_document_attention(packed["doc_ids"], "sdpa"),
                            head=LogprobHead(packed["targets"], 1.0))
        for doc_id in (0, 1):
            [[alone]] = pack_sft([docs[doc_id].as_example()], seq_len=256, num_ranks=1)
            own, _ = model(alone["input_ids"], alone["position_ids"], CausalAttention(),
                           head=LogprobHead(alone["targets"], 1.0))
            mine = packed["doc_ids"][0] == doc_id
            assert torch.equal(packed["loss_mask"][0][mine], alone["loss_mask"][0])
            torch.testing.assert_close(together[0][mine], own[0], rtol=1e-5, atol=1e-5)


def test_epoch_order_resumes_at_the_same_example():
    order = EpochOrder(7, seed=3)
    uninterrupted = order.rows(0, 30)
    for epoch in range(4):
        assert sorted(uninterrupted[7 * epoch:7 * epoch + 7]) == list(range(7))  # each epoch visits every row once
    assert uninterrupted[:7] != uninterrupted[7:14]  # a new order every epoch
    resumed = EpochOrder(7, seed=3)  # a fresh process that only knows the cursor
    assert resumed.rows(12, 18) == uninterrupted[12:]
    assert EpochOrder(7, seed=4).rows(0, 7) != uninterrupted[:7]
    assert EpochOrder(7, shuffle=False).rows(5, 4) == [5, 6, 0, 1]


def test_data_documents_resume_and_epochs(tmp_path):
    rows = [{"text": f"row {i}"} for i in range(10)]
    cfg = DataConfig(path=str(write(rows, tmp_path / "d.jsonl")), epochs=2, validation_fraction=0.2, seed=1)
    tok = char_tokenizer()
    a = DataDocuments(cfg, tok, max_tokens=64)
    assert len(a.train) == 8 and len(a.validation) == 2 and a.summary()["data/rows"] == 8
    assert a.num_steps(max_steps=100, batch_size=3) == 6 and a.batch_size_at(15, 3) == 1  # 16 examples
    steps = [a.examples(c, 3) for c in range(0, 15, 3)]
    b = DataDocuments(cfg, tok, max_tokens=64)  # a restarted run at cursor 9
    assert b.examples(9, 3) == steps[3] and b.examples(12, 3) == steps[4]
    held = {tuple(v[0] + v[1]) for v in a.validation}
    assert not held & {tuple(d.ids) for d in a.train}  # held-out rows are not trained on
    keep, val = split_validation(10, 0.2, seed=1)
    assert sorted(keep + val) == list(range(10)) and len(val) == 2


def test_a_malformed_row_fails_with_file_and_line_or_is_skipped(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.with_name("good.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n{not json\n" + json.dumps({"messages": "oops"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    tok = char_tokenizer()
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON.*data.on_error = \"skip\""):
        DataDocuments(DataConfig(path=str(path)), tok, max_tokens=64)
    docs = DataDocuments(DataConfig(path=str(path), on_error="skip"), tok, max_tokens=64)
    assert len(docs.train) == 1 and docs.summary()["data/skipped_rows"] == 3
    assert [s.split(": ")[0] for s in docs.skipped] == [f"{path}:3", f"{path}:4", f"{path}:5"]
    assert "non-empty list" in docs.skipped[1] and "no assistant message" in docs.skipped[2]
    with pytest.raises(ValueError, match=rf"good.jsonl:1: a document of 24 tokens does not fit"):
        DataDocuments(DataConfig(path=str(path.with_name("good.jsonl"))), tok, max_tokens=20)
    with pytest.raises(ValueError, match="no usable rows \\(4 skipped"):
        DataDocuments(DataConfig(path=str(path), on_error="skip"), tok, max_tokens=20)


def test_missing_columns_fail_before_launch_naming_the_columns(tmp_path, capsys):
    from meshrl.runtime import launch, sft

    path = write([{"question": "q", "reply": "r"}], tmp_path / "d.parquet")
    tok = char_tokenizer()
    with pytest.raises(ValueError, match=r"data.path: .*no known format's columns.*\['question', 'reply'\]"):
        check_data(DataConfig(path=str(path)), tok)
    with pytest.raises(ValueError, match=r"format 'messages' needs column\(s\) messages.*\['question', 'reply'\]"):
        check_data(DataConfig(path=str(path), format="messages"), tok)
    # the command line: exit 2 with one line, before any process starts
    with pytest.raises(SystemExit) as e:
        launch.parse_or_exit(SFTConfig, ["--model.flavor", "debug", "--model.tokenizer", "char",
                                         "--data.path", str(path)], sft.preflight)
    assert e.value.code == 2 and "question" in capsys.readouterr().err


def test_chats_without_a_template_fail_before_launch(tmp_path):
    path = write(ROWS["messages"], tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="data.path: chats need a chat template"):
        check_data(DataConfig(path=str(path)), build_char_tokenizer())
    check_data(DataConfig(path=str(path), chat_template=CHAR_TEMPLATE), build_char_tokenizer())


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = write(ROWS["text"], tmp_path / "d.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"needs the pyarrow package: pip install 'meshrl\[data\]'"):
        read_rows(path)


def test_data_config_refusals():
    with pytest.raises(ValueError, match="not both"):
        DataConfig(path="x.jsonl", validation_path="v.jsonl", validation_fraction=0.1)
    base = {"model": {"flavor": "debug", "tokenizer": "char"}, "data": {"path": "x.jsonl"}}
    with pytest.raises(ValueError, match="eval_every with \\[data\\] logs val/loss"):
        validate(SFTConfig, {**base, "eval_every": 5})
    assert validate(SFTConfig, {**base, "eval_every": 5, "data": {"path": "x.jsonl", "validation_fraction": 0.1}})


def test_bpe_tokenizer_has_special_tokens_a_template_and_two_stop_ids(tmp_path):
    tok = build_bpe_tokenizer()
    text = "Reverse the word: hello. Zebra 42!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges learnt
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok) == (tok.eos_token_id, end_of_turn) and tok.eos_token == "<|endoftext|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tmp_path)
    assert stop_token_ids(again) == stop_token_ids(tok) and again.chat_template == tok.chat_template
    assert build_bpe_tokenizer().get_vocab() == tok.get_vocab()  # deterministic


def test_a_model_folders_generation_config_adds_stop_ids(tmp_path):
    save_tokenizer(build_char_tokenizer(), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    assert stop_token_ids(load_tokenizer(tmp_path)) == (1, 5)


def test_count_loss_tokens_follows_the_mask():
    tok = char_tokenizer()
    doc = Formatter(tok, "messages")({"messages": CHAT})
    assert count_loss_tokens(pack_sft([doc.as_example()] * 2, seq_len=64, num_ranks=2)) == 12
