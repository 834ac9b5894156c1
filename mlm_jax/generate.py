"""`mlm_jax.generate(model, prompts, ...)` (`infer.generate.generate`, this module being callable) and
`python -m mlm_jax.generate PATH --prompt TEXT`, which streams a checkpoint's continuation of a prompt."""
from __future__ import annotations

import argparse
import sys
import types

from mlm_jax.checkpoint.weights import ConvertError
from mlm_jax.data.examples import ChatTemplate, ExampleError
from mlm_jax.infer.generate import generate, stream
from mlm_jax.infer.pretrained import load_pretrained, load_tokenizer

__all__ = ["generate", "main", "stream"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def main(argv=None) -> int:
    """`python -m mlm_jax.generate PATH --prompt TEXT`: the prompt's continuation, streamed to stdout as it is
    produced; bad input is one `error:` line on stderr and exit code 2."""
    p = _Parser(prog="python -m mlm_jax.generate", description="Continue a prompt with a trained or converted model.")
    p.add_argument("path", help="a converted dir, a run's output dir, or a checkpoints dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokenizer", help="a tokenizer.json (default: the one beside the checkpoint, or the run's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor", type=int, default=1, help="split the model over this many local devices")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user's message, rendered with the tokenizer's chat template")
    try:
        args = p.parse_args(argv)
        try:
            info = load_tokenizer(args.path, args.tokenizer)
            if not args.prompt:
                raise ValueError("--prompt is empty: give the text to continue")
            prompt = (chat_prompt(info, args.prompt) if args.chat
                      else info.tokenizer.encode(args.prompt, add_special_tokens=True).tolist())
            if info.context and len(prompt) >= info.context:
                raise ValueError(f"--prompt is {len(prompt)} tokens, and the model's context is {info.context}: "
                                 f"shorten it")
            room = info.context - len(prompt) if info.context else args.max_new_tokens
            model = load_pretrained(args.path, tensor=args.tensor)
            tokens = stream(model, prompt, max_new_tokens=min(args.max_new_tokens, room),
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stop_tokens=info.eos_ids)
            print(args.prompt, end="", flush=True)
            shown, text, new = "", "", []
            for token in tokens:
                new.append(token)
                text = info.tokenizer.decode(new, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # an unfinished character waits for its next token
                    print(text[len(shown):], end="", flush=True)
                    shown = text
            print(text[len(shown):])  # what is left unfinished at the end, as the whole decode shows it
        except ConvertError as e:
            raise ValueError(str(e)) from None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def chat_prompt(info, text: str) -> list[int]:
    """`text` as a user's message with the generation prompt after it, by the tokenizer's chat template (its
    `tokenizer_config.json`, as in fine-tuning)."""
    if not hasattr(info.tokenizer, "path"):
        raise ValueError("--chat needs a tokenizer with a chat template (a tokenizer.json beside its "
                         "tokenizer_config.json), not the byte tokenizer")
    try:
        return ChatTemplate(info.tokenizer.path).render([{"role": "user", "content": text}],
                                                        add_generation_prompt=True)
    except ExampleError as e:
        raise ValueError(f"--chat: {e}") from None


class _CallableModule(types.ModuleType):
    """`mlm_jax.generate(...)` calls `generate` even once this module is imported (which makes `mlm_jax.generate`
    the module)."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
