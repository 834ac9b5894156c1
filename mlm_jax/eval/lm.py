"""`MlmLM`: lm-evaluation-harness's `LM` over an mlm_jax model, scoring and generating as its `hf` model does.

Shapes: B batch, S sequence, V vocabulary.

The same semantics as lm-eval's HFLM, so that scores match it: the harness's `TemplateLM` splits a context's trailing
whitespace into the continuation and puts the prefix token (BOS, else EOS) before an empty context; a context and
continuation longer than `max_length` + 1 lose tokens from the left; a rolling document is cut into lm-eval's
disjoint windows of `max_length`; a generation prompt keeps its last `max_length - max_gen_toks` tokens and its text
ends at the first of the request's `until` strings or the EOS. Scoring runs in batches of `batch_size` rows padded
on the right (harmless under the causal mask) to a power-of-two length, so a handful of shapes compile.
"""
from __future__ import annotations

import collections
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from mlm_jax.infer.generate import generate
from mlm_jax.infer.pretrained import Pretrained
from mlm_jax.eval.errors import EvalError
from mlm_jax.eval.tokens import Codec

DEFAULT_MAX_LENGTH = 2048  # lm-eval's, for a model that does not say its context
MIN_BUCKET = 16


@functools.partial(jax.jit, static_argnames="graphdef")
def _score(graphdef, state, tokens_BS, targets_BS):
    """Log-probability of each target token and whether it is the argmax."""
    logits_BSV = nnx.merge(graphdef, state)(tokens_BS).astype(jnp.float32)
    logp_BS = jnp.take_along_axis(jax.nn.log_softmax(logits_BSV), targets_BS[..., None], axis=-1)[..., 0]
    return logp_BS, jnp.argmax(logits_BSV, axis=-1) == targets_BS


def _bucket(n: int, cap: int) -> int:
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), cap)


class MlmLM(TemplateLM):
    """`model` (callable as `model(tokens_BS) -> logits_BSV`) with the tokenizer, EOS and context of `pretrained`;
    its weights may be sharded over several devices."""

    def __init__(self, model, pretrained: Pretrained, *, batch_size: int = 8, progress: bool = True):
        super().__init__()
        self.model = model
        self.codec = Codec(pretrained)
        self.stop_ids = tuple(pretrained.eos_ids)
        self._max_length = pretrained.context or DEFAULT_MAX_LENGTH
        self.batch_size = batch_size
        self.progress = progress
        self.graphdef, self.state = nnx.split(model)

    @property
    def eot_token_id(self) -> int:
        return self.codec.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self.codec.prefix_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Special tokens added unless asked not to, or unless the text starts with the prefix token already."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.codec.decode([self.prefix_token_id], skip_special=False))
        return self.codec.encode(string, add_special_tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per (key, context ids,
        continuation ids)."""
        L = self.max_length
        if longest := max((len(cont) for _, _, cont in requests if len(cont) > L), default=None):
            raise EvalError(f"a continuation of {longest} tokens is longer than the model's context of {L} tokens")
        rows = [(ctx + cont)[-(L + 1):] for _, ctx, cont in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out: list[tuple[float, bool]] = [None] * len(rows)
        bar = tqdm(total=len(rows), desc="loglikelihood", disable=disable_tqdm or not self.progress)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            S = _bucket(len(rows[batch[0]]) - 1, L)
            tokens_BS = np.zeros((self.batch_size, S), np.int32)
            targets_BS = np.zeros((self.batch_size, S), np.int32)
            for b, i in enumerate(batch):
                n = len(rows[i]) - 1
                tokens_BS[b, :n], targets_BS[b, :n] = rows[i][:-1], rows[i][1:]
            logp_BS, greedy_BS = jax.device_get(_score(self.graphdef, self.state, tokens_BS, targets_BS))
            for b, i in enumerate(batch):
                n, key, cont = len(rows[i]) - 1, requests[i][0], requests[i][2]
                scored = slice(n - len(cont), n)
                out[i] = (float(np.sum(logp_BS[b, scored], dtype=np.float64)), bool(greedy_BS[b, scored].all()))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, out[i])
            bar.update(len(batch))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, summed over disjoint windows of `max_length` tokens, every window after
        the first conditioned on the tokens before it."""
        windows, owners = [], []
        for r, request in enumerate(requests):
            (text,) = request.args
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(r)
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[r] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with `do_sample`, sampled) continuations, in batches of requests with the same settings."""
        eos_text = self.codec.decode([self.eot_token_id], skip_special=False)
        groups = collections.defaultdict(list)
        for r, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(r)
        out: list[str] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm or not self.progress)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new_tokens = kwargs.pop("max_gen_toks")
            room = self.max_length - new_tokens
            if room <= 0:
                raise EvalError(f"max_gen_toks={new_tokens} leaves no room for a prompt in the model's context of "
                                f"{self.max_length} tokens")
            sampling = dict(temperature=float(kwargs.get("temperature", 1.0)), top_k=kwargs.get("top_k"),
                            top_p=kwargs.get("top_p")) if kwargs.get("do_sample") else {}
            prompts = {r: self.codec.encode_prompt(requests[r].args[0])[-room:] or [self.prefix_token_id]
                       for r in members}
            members = sorted(members, key=lambda r: -len(prompts[r]))
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                new = generate(self.model, [prompts[r] for r in batch], max_new_tokens=new_tokens,
                               stop_tokens=self.stop_ids, **sampling)
                for r, ids in zip(batch, new):
                    out[r] = postprocess_generated_text(self.codec.decode(ids, skip_special=True), until, None)
                    self.cache_hook.add_partial("generate_until", requests[r].args, out[r])
                bar.update(len(batch))
        bar.close()
        return out
