"""Fine-tuning examples as tokens and a loss mask (1 on each token a model is trained to produce): chat records
rendered with the tokenizer's own chat template, as transformers renders them, and prompt/completion records.

Which tokens are the assistant's comes from the template's `{% generation %}` blocks where it has them
(transformers' `return_assistant_tokens_mask`), else from rendering each conversation up to every assistant turn: the
tokens an assistant turn adds to the rendering of what came before it (with the generation prompt) are its own, but for the whitespace that ends the turn.
A template that marks nothing, or whose renderings of a conversation's beginnings are not beginnings of its rendering,
is refused: training on every token, or on the wrong ones, would be silent.

numpy and the optional tokenizers/transformers packages only (`pip install 'mlm_jax[data]'`): preparing data never
loads jax.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

FORMATS = ("auto", "text", "chat", "prompt_completion")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class ExampleError(ValueError):
    """A record or template that cannot become a training example; the message is one line."""


def record_format(record: dict, text_field: str, fmt: str) -> str:
    """text, chat or prompt_completion: `fmt` unless auto, which goes by the record's fields."""
    if fmt != "auto":
        return fmt
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    return "text"


class ChatTemplate:
    """A tokenizer directory's chat template (its `tokenizer_config.json`), loaded the way transformers loads it."""

    def __init__(self, tokenizer_path: str | Path):
        try:
            import transformers
        except ImportError:
            raise ExampleError("chat records need the `transformers` package (its chat templates): "
                               "pip install 'mlm_jax[data]'") from None
        path = Path(tokenizer_path)
        folder = path if path.is_dir() else path.parent
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as e:
            raise ExampleError(f"{folder}: cannot load its tokenizer with transformers ({str(e).splitlines()[0]})") \
                from None
        if not self.tokenizer.chat_template:
            raise ExampleError(f"{folder}/tokenizer_config.json has no chat_template: chat records need one")
        self.generation_blocks = bool(_GENERATION.search(self.tokenizer.chat_template))

    def render(self, messages: list[dict], **kwargs) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
        return list(out["input_ids"])

    def example(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss mask) of one conversation: the assistant's tokens are the targets."""
        if self.generation_blocks:
            out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, mask = self._by_prefixes(messages)
        if not any(mask):
            raise ExampleError("the chat template marks none of the assistant's tokens (its {% generation %} blocks "
                               "hold nothing): it would train on nothing")
        return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)

    def _by_prefixes(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """The assistant's tokens of a template without generation blocks: each assistant turn's rendering, past
        the rendering of what came before it with the generation prompt."""
        ids = self.render(messages)
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else []
            through = self.render(messages[:i + 1])
            if through[:len(before)] != before or ids[:len(through)] != through:
                raise ExampleError("the chat template does not render a conversation's beginning as the beginning of "
                                   "its rendering, so the assistant's tokens cannot be told apart: mark them with "
                                   "{% generation %} ... {% endgeneration %} in the template")
            end = len(through)
            while end > len(before) and not self.tokenizer.decode([through[end - 1]]).strip():
                end -= 1  # the whitespace that separates a turn from the next is not the assistant's to learn
            mask[len(before):end] = [1] * (end - len(before))
        return ids, mask


def check_messages(messages) -> None:
    """A chat record's `messages`: a list of {"role", "content"} with an assistant turn to learn."""
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise ExampleError("'messages' is not a list of {\"role\": ..., \"content\": ...} with string values")
    if not any(m["role"] == "assistant" for m in messages):
        raise ExampleError("the conversation has no assistant turn: nothing to learn")


def prompt_completion(tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of a prompt/completion record: the completion's tokens and the end-of-document token
    after it are the targets (the model learns where an answer ends)."""
    if not (isinstance(prompt, str) and isinstance(completion, str)):
        raise ExampleError("'prompt' and 'completion' must be strings")
    prompt_ids = np.asarray(tokenizer.encode(prompt), np.int64)
    completion_ids = np.asarray(tokenizer.encode(completion), np.int64)
    if not len(completion_ids):
        raise ExampleError("the completion is empty: nothing to learn")
    ids = np.concatenate([prompt_ids, completion_ids, [tokenizer.eod_id]])
    mask = np.concatenate([np.zeros(len(prompt_ids), np.uint8), np.ones(len(completion_ids) + 1, np.uint8)])
    return ids, mask
