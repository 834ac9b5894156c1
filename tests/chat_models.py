"""A byte-level BPE tokenizer with chat templates in three families' styles, saved as transformers saves them, for
the fine-tuning tests. Each template comes with and without `{% generation %}` blocks: transformers marks the
assistant's tokens of the first, and our prefix rule must find the same ones in the second."""
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"]
TEXTS = ["hello there, how are you today?", "I am fine, thanks for asking.", "What is two plus two? It is four.",
         "user assistant system model", "Tell me a story about a cat. Once there was a cat."]


def _assistant(content: str, end: str, tags: bool) -> str:
    body = content + end
    return "{% generation %}" + body + "{% endgeneration %}" if tags else body


def templates(tags: bool) -> dict[str, str]:
    """Llama 3 (headers, a BOS), Qwen (im_start/im_end, a system prompt by default) and Gemma (turns, the model
    role named `model`) styles; the newline after a turn is an expression, which transformers' `trim_blocks` keeps
    after `{% endgeneration %}`."""
    llama = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
             "{% if m['role'] == 'assistant' %}" + _assistant("{{ m['content'] }}", "<|eot_id|>", tags) +
             "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    qwen = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}" + _assistant("{{ m['content'] }}", "<|im_end|>", tags) + "{{ '\\n' }}"
            "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    gemma = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
             "<start_of_turn>{{ role }}\n"
             "{% if m['role'] == 'assistant' %}" + _assistant("{{ m['content'] | trim }}", "<end_of_turn>", tags)
             + "{{ '\\n' }}"
             "{% else %}{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    return {"llama3": llama, "qwen": qwen, "gemma": gemma}


def save_chat_tokenizer(path: Path, template: str | None) -> Path:
    """tokenizer.json and tokenizer_config.json (with `template`, or none) in `path`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|end_of_text|>"}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "I am fine, thanks."}],
    [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "a cat?"},
     {"role": "assistant", "content": "Once there was a cat."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "It is four."}],
]
