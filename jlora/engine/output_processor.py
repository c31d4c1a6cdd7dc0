"""The output processor: sampled tokens -> sequences' tokens, text, stop decisions and stream deltas.

It appends each sampled token, detokenizes incrementally (`IncrementalDetokenizer`: a few
tokens' decode per token, not the whole output), applies EOS, stop tokens, stop strings and the
length limit, and says which sequences finish and why; the engine frees them. Stream deltas hold
back a trailing partial character and any tail that could still grow into a stop string (which
would be cut from the final text), so the deltas always join to the final text.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jlora.engine.sequence import Request, Sequence, SeqState

Finish = tuple[str, "str | int | None"]  # (finish_reason, stop_reason)


class OutputProcessor:
    def __init__(self, max_model_len: int, eos_token_id: int | None):
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    def append(self, s: Sequence, out: dict[str, np.ndarray], row: int) -> Finish | None:
        """Row `row` of a step's output is `s`'s next token; returns why `s` finishes, if it does."""
        p = s.params
        tok = int(out["tokens"][row])
        s.state = SeqState.DECODE
        s.num_computed = s.total_len  # every token but the new one is in the cache
        enough = len(s.output_ids) + 1 >= p.min_tokens
        ends = enough and (tok in p.stop_token_ids or (not p.ignore_eos and tok == self.eos_token_id))
        if not ends and s.matcher is not None and not s.matcher.consume_token(tok):
            raise ValueError(f"token {tok} is not allowed by the sample's grammar: {s.matcher.get_error()}")
        if p.logprobs is not None:
            # An EOS / stop token that ends the sample is not part of the output, but its logprob is
            # kept as one entry past the output's tokens, as vLLM returns it: lm-eval's loglikelihood
            # requests (echo, max_tokens=1) drop the last entry as the generated token.
            top = {int(i): float(lp) for i, lp in zip(out["top_ids"][row][: p.logprobs],
                                                      out["top_logprobs"][row][: p.logprobs])}
            top[tok] = float(out["token_logprob"][row])
            s.logprobs.append(top)
        if ends:
            return ("stop", tok) if tok in p.stop_token_ids else ("stop", None)
        s.output_ids.append(tok)
        old_len = len(s.text)
        s.detok.append(tok)
        s.text = s.detok.text
        if enough and p.stop:
            # Only matches this token completed (as vLLM); the earliest one wins.
            hits = [(at, stop) for stop in p.stop if (at := s.text.find(stop, max(0, old_len - len(stop) + 1))) >= 0]
            if hits:
                at, stop = min(hits)
                s.text = s.text[:at]
                return "stop", stop
        if s.matcher is not None and s.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return "stop", None
        max_new = p.max_tokens if p.max_tokens is not None else self.max_model_len
        if len(s.output_ids) >= max_new or s.total_len >= self.max_model_len:
            return "length", None
        return None

    @staticmethod
    def record_prompt_logprobs(plan: Any, out: dict[str, np.ndarray]) -> None:
        """Prompt logprobs computed in this step (where the runner set targets), in prompt order;
        a position already recorded (by another sample, or before a preemption) is skipped."""
        q = plan.shape[2]
        for i, (s, start, n) in enumerate(plan.prefill):
            lps = s.prompt_logprobs
            if lps is None:
                continue
            k = s.params.prompt_logprobs
            for pos in range(max(start, len(lps) - 1), min(start + n, len(s.prompt_token_ids) - 1)):
                j = i * q + pos - start
                entry = {int(t): float(v) for t, v in zip(out["prompt_top_ids"][j][:k], out["prompt_top_logprobs"][j][:k])}
                entry[s.prompt_token_ids[pos + 1]] = float(out["prompt_token_logprob"][j])
                lps.append(entry)

    @staticmethod
    def stream_deltas(req: Request) -> list[str]:
        """Text added to each sample since the last call (see the module docstring)."""
        out = []
        for i, s in enumerate(req.seqs):
            text = s.text if s.state is SeqState.FINISHED else _streamable(s.text, s.params.stop)
            sent = req.streamed_chars[i]
            out.append(text[sent:] if len(text) > sent else "")
            req.streamed_chars[i] = max(sent, len(text))
        return out


def _streamable(text: str, stops: list[str]) -> str:
    """`text` less a trailing partial character and its longest tail that begins a stop string."""
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[: len(text) - hold]
