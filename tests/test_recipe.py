"""README's fine-tuning recipe end to end on a tiny random Llama with a chat template, on the CPU: `convert from-hf`,
`prepare` chat records with its tokenizer, train from its weights (`checkpoint.init_from`), evaluate with lm-eval,
`generate --chat`, `to-hf` back; each step through its command-line entry point, as a user types it."""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from chat_models import CONVERSATIONS, save_chat_tokenizer, templates  # noqa: E402
from eval_models import TASKS  # noqa: E402
from hf_models import convert, save_random  # noqa: E402
from mlm_jax.data.prepare import main as prepare_main  # noqa: E402
from mlm_jax.eval.__main__ import main as eval_main  # noqa: E402
from mlm_jax.generate import main as generate_main  # noqa: E402
from mlm_jax.train.__main__ import main as train_main  # noqa: E402


def test_fine_tune_a_hugging_face_model_on_chat_data(tmp_path, capsys):
    hf = save_chat_tokenizer(tmp_path / "hf", templates(False)["llama3"])
    vocab = json.loads((hf / "tokenizer.json").read_text())["model"]["vocab"]
    config = transformers.LlamaConfig(vocab_size=len(vocab) + 9, hidden_size=64, intermediate_size=128,  # +specials
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False,
                                      bos_token_id=vocab.get("<|begin_of_text|>", 0), eos_token_id=1)
    torch.manual_seed(0)
    save_random(transformers.LlamaForCausalLM(config), hf)
    convert("from-hf", hf, tmp_path / "llama")

    records = [{"messages": c} for c in CONVERSATIONS] * 20
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert prepare_main(["--input", str(tmp_path / "chats.jsonl"), "--tokenizer", str(hf / "tokenizer.json"),
                         "--output", str(tmp_path / "data")]) == 0

    run = tmp_path / "run"
    assert train_main(["--config", str(tmp_path / "llama" / "config.yaml"),
                       f"checkpoint.init_from={tmp_path / 'llama' / 'checkpoints'}", f"data.paths=[{tmp_path / 'data'}]",
                       f"data.tokenizer={hf / 'tokenizer.json'}", "data.validation_fraction=0.1", "train.steps=3",
                       "train.seq_len=64", "train.global_batch_size=8", "train.log_every=1", "train.eval_every=3",
                       "log.progress=never", "model.dtype=float32", f"train.output_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "packed:" in out and "efficiency" in out
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2, 3] and any("eval_loss" in r for r in losses)

    assert eval_main([str(run), "--tasks", "tiny_choice", "--include-path", str(TASKS), "--limit", "2",
                      "--dtype", "float32"]) == 0
    assert "|tiny_choice" in capsys.readouterr().out

    assert generate_main([str(run), "--chat", "--prompt", "hello there", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("hello there")

    convert("to-hf", run / "checkpoints", tmp_path / "back")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back")
    assert back.config.vocab_size == config.vocab_size
