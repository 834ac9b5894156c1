"""Fine-tuning data: chat records rendered with the tokenizer's chat template mark the assistant's tokens as
transformers does (Llama 3, Qwen and Gemma styles; templates without generation blocks by the prefix rule),
prompt/completion records their completions; `prepare` stores the loss mask, the loader packs whole examples into
rows (deterministic, never splitting one) whose loss mask trains only those tokens; bad records and templates are
one line and exit code 2."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")

from chat_models import CONVERSATIONS, save_chat_tokenizer, templates  # noqa: E402
from layouts import leaves  # noqa: E402
from mlm_jax import Trainer, load_config  # noqa: E402
from mlm_jax.config import ConfigError  # noqa: E402
from mlm_jax.data.examples import ChatTemplate  # noqa: E402
from mlm_jax.data.loader import StepLoader  # noqa: E402
from mlm_jax.data.prepare import main as prepare_main  # noqa: E402
from mlm_jax.data.tokenfile import TokenDir  # noqa: E402

SEQ = 64


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {f"{name}-{kind}": save_chat_tokenizer(root / f"{name}-{kind}", templates(kind == "tagged")[name])
            for name in ("llama3", "qwen", "gemma") for kind in ("tagged", "plain")}


@pytest.mark.parametrize("family", ["llama3", "qwen", "gemma"])
@pytest.mark.parametrize("kind", ["tagged", "plain"])
def test_the_assistant_tokens_are_those_transformers_marks(tokenizers_dir, family, kind):
    """With generation blocks (transformers' own masks) and without (the prefix rule), the same tokens, which equal
    `apply_chat_template(..., return_assistant_tokens_mask=True)` of the tagged template."""
    import transformers
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizers_dir[f"{family}-tagged"]))
    ours = ChatTemplate(tokenizers_dir[f"{family}-{kind}"])
    assert ours.generation_blocks == (kind == "tagged")
    for conversation in CONVERSATIONS:
        want = reference.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        ids, mask = ours.example(conversation)
        assert ids.tolist() == list(want["input_ids"]) and mask.tolist() == list(want["assistant_masks"])


def prepared(tmp_path: Path, records, tokenizer: Path, name: str = "sft") -> Path:
    src = write_jsonl(tmp_path / f"{name}.jsonl", records)
    assert prepare_main(["--input", str(src), "--tokenizer", str(tokenizer / "tokenizer.json"), "--output",
                         str(tmp_path / name)]) == 0
    return tmp_path / name


CHATS = [{"messages": c} for c in CONVERSATIONS] * 12 + [
    {"messages": [{"role": "user", "content": f"what is {i}?"}, {"role": "assistant", "content": f"It is {i}."}]}
    for i in range(30)]


def test_chat_records_store_the_assistant_tokens_as_the_loss_mask(tokenizers_dir, tmp_path):
    out = prepared(tmp_path, CHATS, tokenizers_dir["llama3-plain"])
    tokdir = TokenDir(out)
    assert tokdir.mask is not None and json.loads((out / "index.json").read_text())["loss_mask"] == "mask.bin"
    template = ChatTemplate(tokenizers_dir["llama3-plain"])
    starts = list(tokdir.doc_offsets) + [len(tokdir.tokens)]
    for i, record in enumerate(CHATS[:3]):
        ids, mask = template.example(record["messages"])
        doc = slice(starts[i], starts[i + 1])
        assert tokdir.tokens[doc].tolist() == ids.tolist() + [tokdir.eod_id]  # each example ends with an eod
        assert tokdir.mask[doc].tolist() == mask.tolist() + [0]


def test_prompt_completion_records_train_the_completion_and_its_end(tokenizers_dir, tmp_path):
    records = [{"prompt": "hello there", "completion": " I am fine."}]
    tokdir = TokenDir(prepared(tmp_path, records, tokenizers_dir["llama3-plain"], "pc"))
    n_prompt = int((tokdir.mask == 0).sum())
    assert tokdir.mask.tolist() == [0] * n_prompt + [1] * (len(tokdir.tokens) - n_prompt)
    assert tokdir.tokens[-1] == tokdir.eod_id and n_prompt > 0


def sft_config(out: Path, tokenizer: Path, tmp_path: Path, *overrides):
    return load_config(None, ["model.dtype=float32", "model.vocab_size=512", f"train.seq_len={SEQ}",
                              "train.global_batch_size=8", "train.steps=2", "train.eval_every=0", "log.progress=never",
                              f"data.paths=[{out}]", f"data.tokenizer={tokenizer / 'tokenizer.json'}",
                              "data.validation_fraction=0.2", "checkpoint.save=false",
                              f"train.output_dir={tmp_path / 'run'}", *overrides])


def test_packed_rows_hold_whole_examples_and_train_only_the_assistant(tokenizers_dir, tmp_path):
    tok = tokenizers_dir["llama3-plain"]
    out = prepared(tmp_path, CHATS, tok)
    trainer = Trainer(sft_config(out, tok, tmp_path), devices=jax.devices()[:1])
    assert "packed:" in trainer.data.description and "efficiency" in trainer.data.description
    rows = trainer.data.train._windows[0]
    assert 0.5 < rows.efficiency <= 1
    # every example in exactly one row, whole; the same rows for the same seed
    assert sorted(rows.row_docs.tolist()) == list(range(len(rows.lengths)))
    again = Trainer(sft_config(out, tok, tmp_path / "again"), devices=jax.devices()[:1]).data.train._windows[0]
    np.testing.assert_array_equal(again.row_docs, rows.row_docs)
    # the targets trained on are the assistant's tokens of the examples, and nothing else
    docs = rows.documents
    fields = rows.fields(np.arange(rows.num_windows))
    assert int(fields["loss_mask"].sum()) == int(docs.mask.sum())
    assert set(np.unique(fields["targets"][fields["loss_mask"] > 0])) <= set(docs.tokens[docs.mask > 0].tolist())
    # a prompt's targets, changed, change neither the loss nor the gradients
    loader = StepLoader(trainer.data.train, SEQ, 8, 0)
    batch = loader.fields(0, 0, 8)
    params = jax.device_get(trainer.state.params)
    metrics, grads = trainer.gradients(params, batch=batch)
    batch["targets"] = np.where(batch["loss_mask"] > 0, batch["targets"], (batch["targets"] + 5) % 300)
    metrics2, grads2 = trainer.gradients(params, batch=batch)
    assert float(metrics["loss"]) == float(metrics2["loss"])
    for path, g in leaves(grads).items():
        np.testing.assert_array_equal(leaves(grads2)[path], g)


def test_an_example_longer_than_a_row_is_refused_or_cut(tokenizers_dir, tmp_path):
    tok = tokenizers_dir["llama3-plain"]
    long = [{"messages": [{"role": "user", "content": "hello there " * 40}, {"role": "assistant", "content": "fine"}]}]
    out = prepared(tmp_path, long * 3 + CHATS, tok)
    with pytest.raises(ConfigError, match="longer than a row of train.seq_len \\+ 1 = 65 tokens.*data.long_examples"):
        Trainer(sft_config(out, tok, tmp_path), devices=jax.devices()[:1])
    trainer = Trainer(sft_config(out, tok, tmp_path, "data.long_examples=truncate"), devices=jax.devices()[:1])
    assert int(trainer.data.train._windows[0].lengths.max()) == SEQ + 1


def test_fine_tuning_data_read_as_windows_is_refused(tokenizers_dir, tmp_path):
    tok = tokenizers_dir["llama3-plain"]
    out = prepared(tmp_path, CHATS, tok)
    with pytest.raises(ConfigError, match="data.packing=false with fine-tuning data"):
        Trainer(sft_config(out, tok, tmp_path, "data.packing=false"), devices=jax.devices()[:1])


@pytest.mark.parametrize("records, tokenizer, expected", [
    ([{"message": []}], "llama3-plain", ["sft.jsonl:1", "no 'text' field", "'messages'"]),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "llama3-plain", ["sft.jsonl:1", "no assistant turn"]),
    ([{"messages": [{"role": "user"}]}], "llama3-plain", ["sft.jsonl:1", "'messages' is not a list"]),
    ([{"prompt": "hi", "completion": ""}], "llama3-plain", ["sft.jsonl:1", "completion is empty"]),
    ([{"messages": CONVERSATIONS[0]}], "no-template", ["no chat_template"]),
    ([{"messages": CONVERSATIONS[0]}], "empty-blocks", ["sft.jsonl:1", "marks none of the assistant's tokens"]),
    ([{"messages": CONVERSATIONS[0]}], "unstable", ["sft.jsonl:1", "does not render a conversation's beginning"]),
    ([{"messages": CONVERSATIONS[0]}], "byte", ["not --tokenizer byte"]),
])
def test_bad_records_and_templates_are_one_line_and_exit_code_2(tokenizers_dir, tmp_path, capsys, records,
                                                                 tokenizer, expected):
    custom = {"no-template": None,
              "empty-blocks": "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% if m['role'] == 'assistant' %}"
                              "{% generation %}{% endgeneration %}{% endif %}{% endfor %}",
              "unstable": "{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}"
                          ">>{% endif %}"}
    if tokenizer in custom:
        tok = save_chat_tokenizer(tmp_path / tokenizer, custom[tokenizer]) / "tokenizer.json"
    else:
        tok = "byte" if tokenizer == "byte" else tokenizers_dir[tokenizer] / "tokenizer.json"
    src = write_jsonl(tmp_path / "sft.jsonl", records)
    assert prepare_main(["--input", str(src), "--tokenizer", str(tok), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(e in err for e in expected), err
    assert not (tmp_path / "out").exists()


def test_a_saved_hugging_face_dataset_is_an_input(tokenizers_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(CHATS[:4]).save_to_disk(str(tmp_path / "ds"))
    tok = tokenizers_dir["llama3-plain"]
    assert prepare_main(["--input", str(tmp_path / "ds"), "--tokenizer", str(tok / "tokenizer.json"), "--output",
                         str(tmp_path / "out")]) == 0
    want = prepared(tmp_path, CHATS[:4], tok, "from-jsonl")
    np.testing.assert_array_equal(TokenDir(tmp_path / "out").tokens, TokenDir(want).tokens)
    np.testing.assert_array_equal(TokenDir(tmp_path / "out").mask, TokenDir(want).mask)
