"""Tiny random Hugging Face models for the evaluation tests, each with a byte-level BPE tokenizer trained on the test
tasks' own texts (tests/eval_tasks), saved as transformers saves them and converted to ours.
Import after importorskip(torch)."""
import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hf_models import convert, save_random

TASKS = Path(__file__).parent / "eval_tasks"
CONTEXT = 48  # max_position_embeddings: the longest documents span several rolling windows, long prompts truncate
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=CONTEXT, tie_word_embeddings=False)
# Llama 3's way (a BOS that the post-processor adds) and Qwen's (no BOS: an empty context starts from the EOS)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, "<|begin_of_text|>", "<|end_of_text|>"),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, None, "<|endoftext|>"),
}


def task_texts() -> list[str]:
    texts = []
    for path in sorted(TASKS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts += [v for v in row.values() if isinstance(v, str)] + row.get("choices", [])
    return texts


def save_tokenizer(path: Path, bos: str | None, eos: str, **config) -> Tokenizer:
    """tokenizer.json and the tokenizer_config.json (with `config` in it) with which transformers loads it as a
    fast tokenizer."""
    specials = [t for t in (bos, eos) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(task_texts(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "model_max_length": CONTEXT, **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def save_family(root: Path, family: str) -> tuple[Path, Path]:
    """(the Hugging Face folder, ours converted from it) of a random tiny model of `family` in float32."""
    config_cls, model_cls, bos, eos = FAMILIES[family]
    hf = root / f"{family}-hf"
    tok = save_tokenizer(hf, bos, eos)
    ids = dict(bos_token_id=tok.token_to_id(bos) if bos else None, eos_token_id=tok.token_to_id(eos))
    torch.manual_seed(0)
    save_random(model_cls(config_cls(vocab_size=tok.get_vocab_size(), **TINY, **ids)), hf)
    convert("from-hf", hf, root / family)
    return hf, root / family
