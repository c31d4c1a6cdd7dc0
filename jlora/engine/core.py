"""LLMEngine: continuous batching over a paged KV cache and a fixed set of adapter slots.

`add_request` queues work, `step` runs one scheduling round as one device call: a decode token
for every running sequence that is decoding (packed into the step's rows) plus a prefill part,
the next chunks of the oldest sequences still prefilling, sampled in the same graph.
`abort` drops a request and frees its KV blocks and slot pin.

No request can hurt another: every field is checked at `add_request`; a row that still fails to
build on the host fails only its own request (finish_reason "error", `RequestOutput.error`); and a
device step that raises is retried without blame falling on bystanders: its requests run one at a
time until the one that fails again is found and failed alone (`_suspects`).
When a decoding sequence needs a KV block and none is free, the most recently admitted sequence
is preempted: its blocks are freed and it is recomputed (prompt + tokens so far) when it is
admitted again, so nothing is dropped and greedy outputs do not change.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from collections import deque
from typing import Any, Iterator

import numpy as np

from jlora.adapters.manager import AdapterHandle, AdapterManager, NoFreeSlotError
from jlora.adapters.request import LoRARequest
from jlora.engine.blocks import BlockAllocator
from jlora.engine.config import EngineConfig, bucket_for
from jlora.engine.runner import ModelRunner
from jlora.engine.sequence import Request, Sequence, SeqState
from jlora.outputs import RequestOutput
from jlora.sampling import SamplingParams, SamplingRow, fill_sampling_row


class QueueFullError(RuntimeError):
    """The waiting queue is at `EngineConfig.max_waiting_seqs`; try again later (HTTP 429)."""


class _RowFailed(Exception):
    def __init__(self, seq: Sequence, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.seq = seq

log = logging.getLogger("jlora.engine")

STEP_COST_TOKENS = 64  # a step's weight pass costs about as much as this many tokens' compute (SmolLM2, 2 cores)


class LLMEngine:
    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, eos_token_id: int | None):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.runner = ModelRunner(model, config)
        self.adapters = AdapterManager(model.cfg, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                       max_cpu_loras=config.max_cpu_loras, dtype=model.dtype)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv = BlockAllocator(config.num_kv_blocks)
        self.num_preemptions = 0
        self.num_failed_steps = 0  # device steps that raised (their requests were retried one by one)
        # Requests of a step that raised, oldest first: each runs alone for one step, and the one that
        # fails alone is failed; the rest go back to batching.
        self._suspects: deque[str] = deque()
        self._ids = itertools.count()
        self._seed_rng = random.Random()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | dict[str, Any] | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        request_id: str | None = None,
        lora_handle: AdapterHandle | None = None,
    ) -> str:
        """Validate and queue one request. Raises ValueError/FileNotFoundError for bad input, queuing nothing.

        `lora_handle`: `lora_request`'s adapter as already converted (`adapters.prepare` or
        `prepare_async`), so nothing is converted here, on the stepping thread."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check_for_engine(self.runner.cfg.vocab_size, self.config.max_n)
        cap = self.config.max_waiting_seqs
        if cap is not None and len(self.waiting) + params.n > cap:
            raise QueueFullError(f"{len(self.waiting)} sequences are waiting and this request adds {params.n}; "
                                 f"max_waiting_seqs={cap}")
        prompt_text, ids = self._tokenize(prompt)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={limit} leaves no room to generate "
                             f"(the prompt must be at most {limit - 1} tokens)")
        if any(not 0 <= t < self.runner.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {self.runner.cfg.vocab_size})")
        handle = None
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
            if lora_handle is not None and lora_handle.version[0] != lora_request.lora_name:
                raise ValueError(f"lora_handle is for adapter {lora_handle.version[0]!r}, the request names "
                                 f"{lora_request.lora_name!r}")
            # Converts now unless given (raises on a bad adapter); the request keeps this version to the end.
            handle = lora_handle or self.adapters.prepare(lora_request)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**32)
        seqs = [Sequence(request_id, i, ids, params, (base_seed + 7919 * i) % 2**32, lora_request, handle)
                for i in range(params.n)]
        req = Request(request_id, prompt_text, ids, params, lora_request, seqs)
        req.metrics.num_prompt_tokens = len(ids)
        req.streamed_text = [""] * params.n
        self.requests[request_id] = req
        self.waiting.extend(seqs)
        return request_id

    def _tokenize(self, prompt: str | dict[str, Any] | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = [int(t) for t in prompt["prompt_token_ids"]]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = self.tokenizer.encode(text, add_special_tokens=True)
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, [int(t) for t in prompt]
        else:
            raise ValueError(f"prompt must be a string, a token id list or a dict, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        return text, ids

    def abort(self, request_id: str) -> None:
        self._fail_request(request_id, "abort")

    def _fail_request(self, request_id: str, reason: str, error: str | None = None) -> None:
        """Finish every unfinished sequence of a request with `reason` ("abort" or "error"), in time
        linear in its sequences: its waiting ones leave the queue in one pass."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        if error is not None:
            req.error = error
        if any(s.state is SeqState.WAITING for s in req.seqs):
            self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        for seq in req.seqs:
            self._finish(seq, reason, in_queue=False)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------------------

    def _admit(self) -> None:
        """Admission in queue order: a sequence needs KV blocks for its prefill, a free place and, if it
        uses an adapter, a slot. Preempted sequences rejoin at the head.

        A sequence short of KV blocks stops admission (running sequences will free some). One whose
        adapter cannot get a slot (every slot pinned) stops it too under "fcfs"; under
        "adapter_aware" (the default) it is passed over and later sequences whose adapters are
        resident, or can take a slot, go first, until it has been passed over `max_overtakes` times:
        then it holds the queue until a slot frees, so nothing starves. Slots holding adapters the
        queue still needs are evicted last.
        """
        c = self.config
        needed = {s.lora.lora_name for s in self.waiting if s.lora is not None}
        i = 0
        while i < len(self.waiting) and len(self.running) < c.max_num_seqs:
            seq = self.waiting[i]
            need = c.blocks_for(seq.total_len)
            if need > self.kv.num_free:
                return
            if seq.lora is not None:
                try:
                    seq.slot = self.adapters.acquire(seq.lora, seq.lora_handle, protect=needed)
                except NoFreeSlotError:
                    if c.scheduling_policy == "fcfs" or seq.num_overtaken >= c.max_overtakes:
                        return
                    i += 1
                    continue
            del self.waiting[i]
            for passed in itertools.islice(self.waiting, i):
                passed.num_overtaken += 1
            seq.blocks = self.kv.allocate(need)
            seq.state = SeqState.PREFILL
            self.running.append(seq)

    def _reserve_decode_blocks(self) -> None:
        """Every decoding sequence needs a block for the position it writes next. When none is
        free, preempt the most recently admitted sequence (possibly the one asking)."""
        for seq in [s for s in self.running if s.state is SeqState.DECODE]:
            if seq.state is not SeqState.DECODE:
                continue  # preempted for an earlier sequence in this loop
            need = self.config.blocks_for(seq.total_len) - len(seq.blocks)
            while need > 0 and self.kv.num_free < need:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.state is SeqState.DECODE and need > 0:
                seq.blocks += self.kv.allocate(need)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.blocks)
        seq.blocks = []
        if seq.slot >= 0:
            self.adapters.release(seq.slot)
            seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0  # recomputed from scratch: prompt + the tokens generated so far
        seq.state = SeqState.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # victims go latest-first, so FIFO order is kept

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None, *,
                in_queue: bool = True) -> None:
        """in_queue=False: a waiting `seq` has already been taken out of the queue."""
        if seq.state is SeqState.FINISHED:
            return
        if seq.state is SeqState.WAITING:
            if in_queue:
                self.waiting.remove(seq)
        else:
            self._release(seq)
        seq.state = SeqState.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        req = self.requests[seq.request_id]
        req.num_unfinished -= 1
        if req.finished:
            req.metrics.finished_time = time.time()

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling round, one device call. Returns the requests that changed (state so far)."""
        self._reserve_decode_blocks()  # running sequences first: admission gets what is left
        self._admit()
        touched: dict[str, Request] = {}
        while True:  # a sequence whose row cannot be built fails alone; the rest are packed again
            decoding, prefilling = self._schedulable()
            if not decoding and not prefilling:
                return [req.to_output() for req in touched.values()]
            try:
                batch, rows, advances = self._build_batch(decoding, prefilling)
                break
            except _RowFailed as f:
                log.warning("request %s failed on the host: %s", f.seq.request_id, f)
                self._fail(f.seq.request_id, str(f), touched)
        involved = list(dict.fromkeys(s.request_id for s in itertools.chain(rows.values(), (a[0] for a in advances))))
        try:
            out = self.runner.step(self.adapters.lora_state, batch)
        except Exception as e:
            self._step_failed(e, involved, touched)
            return [req.to_output() for req in touched.values()]
        if self._suspects and involved == [self._suspects[0]]:
            self._suspects.popleft()  # it ran alone and the step did not raise: not the culprit
        for s, n in advances:  # only now: a step that raised computed nothing
            s.num_computed += n
        self._append_sampled(out, rows, touched)
        return [req.to_output() for req in touched.values()]

    def _schedulable(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences this step may carry (decoding, prefilling). While a failed step's
        requests are being retried, the oldest of them runs alone if it is running; otherwise the
        sequences of requests not under suspicion run (so the queue keeps moving)."""
        while self._suspects and (self._suspects[0] not in self.requests or self.requests[self._suspects[0]].finished):
            self._suspects.popleft()
        running = self.running
        if self._suspects:
            solo = [s for s in running if s.request_id == self._suspects[0]]
            suspects = set(self._suspects)
            running = solo or [s for s in running if s.request_id not in suspects]
        return ([s for s in running if s.state is SeqState.DECODE],
                [s for s in running if s.state is SeqState.PREFILL])

    def _build_batch(self, decoding: list[Sequence], prefilling: list[Sequence]):
        """The step's host arrays, the sequence sampled at each row, and the prefill advances
        (sequence, tokens) to apply once the step has run. Raises _RowFailed naming the sequence
        whose row could not be built."""
        c = self.config
        (p, q), chunks = self._choose_prefill(prefilling)
        # Rows are packed afresh each step: decoding sequences first, then prompts completing now.
        r = c.max_num_seqs if chunks else bucket_for(len(decoding), c.decode_row_buckets)
        batch = self.runner.empty_batch((r, p, q))
        rows: dict[int, Sequence] = {}
        advances: list[tuple[Sequence, int]] = []
        for row, s in enumerate(decoding):
            with _blame(s):
                batch["tokens"][row] = s.output_ids[-1]
                batch["slot_ids"][row] = s.slot
                batch["dec_positions"][row] = s.total_len - 1
                batch["dec_tables"][row, : len(s.blocks)] = s.blocks
            rows[row] = s
        for i, s in enumerate(chunks):
            n, start, at = min(q, s.total_len - s.num_computed), s.num_computed, r + i * q
            with _blame(s):
                batch["tokens"][at: at + n] = s.all_ids[start: start + n]
                batch["slot_ids"][at: at + n] = s.slot
                batch["pre_positions"][i, :n] = np.arange(start, start + n)
                batch["pre_tables"][i, : len(s.blocks)] = s.blocks
            advances.append((s, n))
            if start + n == s.total_len:  # the prompt is in: a free row samples its first token
                row = len(rows)
                batch["sample_index"][row] = at + n - 1
                rows[row] = s
        for row, s in rows.items():
            with _blame(s):
                fill_sampling_row(batch["sampling"], row,
                                  SamplingRow(s.params, s.seed, s.prompt_token_ids, s.output_ids, self.eos_token_id))
        return batch, rows, advances

    def _step_failed(self, error: Exception, involved: list[str], touched: dict[str, Request]) -> None:
        """A device step raised. If it took the KV cache with it (donated buffers), every running
        sequence is recomputed from its tokens. A step of one request fails that request; a step of
        several puts them under suspicion, to be retried one at a time (`_schedulable`)."""
        self.num_failed_steps += 1
        log.error("engine step over requests %s failed: %s: %s", involved, type(error).__name__, error)
        if self.runner.reset_cache_if_lost():
            for seq in list(reversed(self.running)):  # latest first, so the queue keeps FIFO order
                self._preempt(seq)
        if len(involved) == 1:
            if self._suspects and self._suspects[0] == involved[0]:
                self._suspects.popleft()
            self._fail(involved[0], f"the engine step failed for this request: {type(error).__name__}: {error}",
                       touched)
        else:
            self._suspects.extend(r for r in involved if r not in self._suspects)

    def _fail(self, request_id: str, error: str, touched: dict[str, Request]) -> None:
        self._fail_request(request_id, "error", error)
        if request_id in self.requests:
            touched[request_id] = self.requests[request_id]

    def _choose_prefill(self, seqs: list[Sequence]) -> tuple[tuple[int, int], list[Sequence]]:
        """The prefill shape (P sequences x Q tokens) and the sequences (oldest first) that waste
        the least: prompt tokens carried per token computed, counting the decode rows and the weight
        pass every step pays (about STEP_COST_TOKENS tokens of compute on a 2-core CPU)."""
        if not seqs:
            return (0, 0), []
        best = None
        for p, q in self.config.prefill_shapes():
            take = seqs[:p]
            useful = sum(min(q, s.total_len - s.num_computed) for s in take)
            key = useful / (p * q + self.config.max_num_seqs + STEP_COST_TOKENS)
            if best is None or key > best[0]:
                best = (key, (p, q), take)
        return best[1], best[2]

    def _append_sampled(self, out: dict[str, np.ndarray], seqs_by_row: dict[int, Sequence], touched) -> None:
        now = time.time()
        for r, s in seqs_by_row.items():
            req = self.requests[s.request_id]
            touched[s.request_id] = req
            if s.state is SeqState.FINISHED:  # its request failed on an earlier row of this step
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            before = len(s.output_ids)
            try:
                tok = int(out["tokens"][r])
                if s.params.logprobs is not None:
                    top = {int(i): float(lp) for i, lp in
                           zip(out["top_ids"][r][: s.params.logprobs], out["top_logprobs"][r][: s.params.logprobs])}
                    top[tok] = float(out["token_logprob"][r])
                    s.logprobs.append(top)
                self._append_token(s, tok)
            except Exception as e:  # detokenizing or a stop check: this request's failure alone
                log.warning("request %s failed on its sampled token: %s", s.request_id, e)
                self._fail(s.request_id, f"{type(e).__name__}: {e}", touched)
            req.metrics.num_generated_tokens += len(s.output_ids) - before

    def _append_token(self, s: Sequence, tok: int) -> None:
        p = s.params
        s.state = SeqState.DECODE
        s.num_computed = s.total_len  # every token but the new one is in the cache
        s.output_ids.append(tok)
        enough = len(s.output_ids) >= p.min_tokens
        if enough and tok in p.stop_token_ids:
            s.pop_last()
            self._update_text(s)
            return self._finish(s, "stop", tok)
        if enough and not p.ignore_eos and tok == self.eos_token_id:
            s.pop_last()
            self._update_text(s)
            return self._finish(s, "stop", None)
        old_len = len(s.text)
        self._update_text(s)
        if enough and p.stop:
            # Only matches this token completed (as vLLM); the earliest one wins.
            hits = [(at, stop) for stop in p.stop if (at := s.text.find(stop, max(0, old_len - len(stop) + 1))) >= 0]
            if hits:
                at, stop = min(hits)
                s.text = s.text[:at]
                return self._finish(s, "stop", stop)
        max_new = p.max_tokens if p.max_tokens is not None else self.config.max_model_len
        if len(s.output_ids) >= max_new or s.total_len >= self.config.max_model_len:
            return self._finish(s, "length")

    def _update_text(self, s: Sequence) -> None:
        s.text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)

    # ---- outputs ----------------------------------------------------------------------------------

    def pop_finished(self, request_id: str) -> RequestOutput:
        req = self.requests.pop(request_id)
        return req.to_output()

    def stream_deltas(self, request_id: str) -> list[str]:
        """Text added to each sample since the last call. Until a sample finishes, holds back a
        trailing partial character and any tail that could still grow into a stop string (which
        would cut it from the final text), so the deltas always join to the final text."""
        req = self.requests[request_id]
        out = []
        for i, s in enumerate(req.seqs):
            text = s.text if s.state is SeqState.FINISHED else _streamable(s.text, s.params.stop)
            delta = text[len(req.streamed_text[i]):] if text.startswith(req.streamed_text[i]) else ""
            req.streamed_text[i] += delta
            out.append(delta)
        return out


@contextlib.contextmanager
def _blame(seq: Sequence) -> Iterator[None]:
    """Whatever fails while `seq`'s row is written is `seq`'s failure alone."""
    try:
        yield
    except Exception as e:
        raise _RowFailed(seq, e) from e


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
