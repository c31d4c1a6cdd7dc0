"""A plain reference generator for the exactness harness: one request at a time, no batching, no
buckets, no KV cache, no preemption; sampling written out from the documented semantics.

It shares only the model forward with the engine (the same Flax module, a fresh full forward
per token) and the tokenizer. Everything the engine adds (scheduling, paging, bucketing, batched
sampling, streaming, adapter slots) is absent here, so any difference is the engine's.

Semantics (vLLM's, as the README documents them):
- logprobs are the model's raw distribution (log-softmax of the logits, before any processing);
- EOS and `stop_token_ids` are banned while fewer than `min_tokens` tokens exist;
- repetition penalty over prompt + output (divide positive logits, multiply negative ones),
  frequency and presence penalties over the output;
- temperature 0 is greedy; otherwise the logits are divided by the temperature, top-k keeps the
  k best, top-p keeps the smallest prefix of the top-k distribution whose mass reaches p, min-p
  keeps tokens with at least min_p times the best token's probability; a token is drawn with
  Gumbel-max keyed by `fold_in(key(seed), number of tokens generated so far)`;
- sample i of a request with seed s uses seed `(s + 7919 * i) % 2**32`;
- a stop token or EOS ends the output and is not part of it; a stop string ends it and is cut
  from the text (the earliest match that the newest token completed; none before `min_tokens`); `length` at `max_tokens` or at `max_model_len` tokens in all.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.adapters.manager import padded_update, set_slot
from jlora.adapters.peft import read_adapter
from jlora.models.llama import init_cache, init_lora_state
from jlora.sampling import SamplingParams


@dataclasses.dataclass
class RefSample:
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: str | int | None
    logprobs: list[dict[int, float]] | None


class ReferenceGenerator:
    def __init__(self, model, tokenizer, max_model_len: int, eos_token_id: int | None, max_lora_rank: int):
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len, self.eos = max_model_len, eos_token_id
        self.max_lora_rank = max_lora_rank
        self.graphdef, self.state = nnx.split(model)
        self._adapters: dict[str, dict] = {}
        self._empty = init_lora_state(model.cfg, 1, max_lora_rank, model.dtype)

    @partial(jax.jit, static_argnums=0)
    def _logits(self, state, lora_state, tokens, n, slot):  # tokens i32[1, max_model_len] -> f32[V]
        model = nnx.merge(self.graphdef, state)
        positions = jnp.where(jnp.arange(tokens.shape[1]) < n, jnp.arange(tokens.shape[1]), -1)[None]
        cache = init_cache(model.cfg, 1, tokens.shape[1], model.dtype)
        logits, _ = model(tokens, positions, cache, lora_state, slot[None], (n - 1)[None], lora_impl="gather")
        return logits[0]

    def logits(self, ids: list[int], lora_path: str | None) -> np.ndarray:
        tokens = np.zeros((1, self.max_model_len), np.int32)
        tokens[0, : len(ids)] = ids
        if lora_path is None:
            state, slot = self._empty, -1
        else:
            if lora_path not in self._adapters:
                adapter = read_adapter(lora_path, self.model.cfg, self.max_lora_rank)
                update = padded_update(adapter, self.model.cfg, self.max_lora_rank, dtype=self.model.dtype)
                self._adapters[lora_path] = set_slot(
                    init_lora_state(self.model.cfg, 1, self.max_lora_rank, self.model.dtype), 0, update)
            state, slot = self._adapters[lora_path], 0
        out = self._logits(self.state, state, tokens, np.int32(len(ids)), np.int32(slot))
        return np.asarray(out, np.float32)

    # ---- sampling, written out ----------------------------------------------------------------------

    def choose(self, logits: np.ndarray, p: SamplingParams, seed: int, prompt: list[int], out: list[int]) -> int:
        x = logits.astype(np.float32).copy()
        if len(out) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos or self.eos is None else [self.eos])
            x[banned] = -np.inf
        if p.repetition_penalty != 1.0:
            seen = np.zeros(x.shape, bool)
            seen[prompt + out] = True
            x = np.where(seen, np.where(x > 0, x / np.float32(p.repetition_penalty),
                                        x * np.float32(p.repetition_penalty)), x)
        if p.frequency_penalty or p.presence_penalty:
            counts = np.bincount(np.asarray(out, np.int64), minlength=x.shape[0]).astype(np.float32)
            x = x - np.float32(p.frequency_penalty) * counts - np.float32(p.presence_penalty) * (counts > 0)
        if p.temperature == 0.0:
            return int(np.argmax(x))
        x = (x / np.float32(max(p.temperature, 1e-6))).astype(np.float32)
        order = np.argsort(-x, kind="stable")
        keep_sorted = np.ones(x.shape, bool)
        if p.top_k > 0:
            keep_sorted[p.top_k:] = False
        s = x[order]
        probs = np.exp(np.where(keep_sorted, s - s[0], -np.inf))
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep_sorted &= (np.cumsum(probs) - probs) < p.top_p
        keep_sorted &= probs >= p.min_p * probs[0]
        keep = np.zeros(x.shape, bool)
        keep[order] = keep_sorted
        key = jax.random.fold_in(jax.random.key(seed), len(out))
        noise = np.asarray(jax.random.gumbel(key, x.shape, jnp.float32))
        return int(np.argmax(np.where(keep, x, -np.inf) + noise))

    # ---- one request --------------------------------------------------------------------------------

    def generate(self, prompt: list[int], p: SamplingParams, base_seed: int, lora_path: str | None) -> list[RefSample]:
        return [self._one(prompt, p, (base_seed + 7919 * i) % 2**32, lora_path) for i in range(p.n)]

    def _one(self, prompt: list[int], p: SamplingParams, seed: int, lora_path: str | None) -> RefSample:
        out: list[int] = []
        logprobs: list[dict[int, float]] = []
        text = ""
        max_new = p.max_tokens if p.max_tokens is not None else self.max_model_len
        while True:
            logits = self.logits(prompt + out, lora_path)
            tok = self.choose(logits, p, seed, prompt, out)
            if p.logprobs is not None:
                lp = logits - np.logaddexp.reduce(logits.astype(np.float64)).astype(np.float32)
                top = {int(i): float(lp[i]) for i in np.argsort(-lp, kind="stable")[: p.logprobs]}
                top[tok] = float(lp[tok])
                logprobs.append(top)
            out.append(tok)
            enough = len(out) >= p.min_tokens
            if enough and (tok in p.stop_token_ids or (not p.ignore_eos and tok == self.eos)):
                out.pop()  # not returned, but its logprob is (one entry past the output's tokens)
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                return RefSample(out, text, "stop", tok if tok in p.stop_token_ids else None, self._lp(p, logprobs))
            old_len = len(text)
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if enough and p.stop:
                found = [(text.find(s, max(0, old_len - len(s) + 1)), s) for s in p.stop]
                hits = [(at, s) for at, s in found if at >= 0]
                if hits:
                    at, stop = min(hits)
                    return RefSample(out, text[:at], "stop", stop, self._lp(p, logprobs))
            if len(out) >= max_new or len(prompt) + len(out) >= self.max_model_len:
                return RefSample(out, text, "length", None, self._lp(p, logprobs))

    @staticmethod
    def _lp(p: SamplingParams, logprobs: list[dict[int, float]]) -> list[dict[int, float]] | None:
        return logprobs if p.logprobs is not None else None
