"""LLMEngine: continuous batching over a paged KV cache and a fixed set of adapter slots.

A step is four rooms in a row (vLLM v1's shape): the `Scheduler` decides which tokens of which
sequences run (a `StepPlan`, with their KV blocks and slots); the `ModelRunner` turns the plan into
its arrays and runs the one device call (the model and the sampler in one graph); the
`OutputProcessor` appends the sampled tokens, detokenizes incrementally and decides who stops;
the engine keeps the requests and returns what changed. `add_request` validates and queues,
`abort` drops a request and frees its KV blocks and slot pin, `stats()` is the public snapshot.

No request can hurt another: every field is checked at `add_request`; a row that still fails to
build on the host fails only its own request (finish_reason "error", `RequestOutput.error`); and a
device step that raises is retried without blame falling on bystanders: its requests run one at a
time until the one that fails again is found and failed alone (`Scheduler.step_failed`).
When a decoding sequence needs a KV block and none is free, the most recently admitted sequence
is preempted and later recomputed, so nothing is dropped and greedy outputs do not change.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from typing import Any, Sequence

import jax

from jlora.closing import Closable
from jlora.adapters.manager import AdapterHandle, AdapterManager
from jlora.adapters.request import LoRACombination, LoRARequest
from jlora.engine.config import EngineConfig
from jlora.engine.detokenizer import IncrementalDetokenizer
from jlora.engine.output_processor import OutputProcessor
from jlora.engine.runner import ModelRunner, RowFailed
from jlora.engine.scheduler import Scheduler
from jlora.engine.structured import GrammarCompiler
from jlora.engine.sequence import Request, Sequence, SeqState
from jlora.engine.step_listener import StepListener
from jlora.outputs import RequestOutput
from jlora.sampling_params import SamplingParams

log = logging.getLogger("jlora.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at `EngineConfig.max_waiting_seqs`; try again later (HTTP 429)."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What the engine is doing, for the server's metrics and for callers: a copy, safe to keep."""

    running: int  # sequences with a place in the step
    waiting: int  # sequences queued for admission
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_failed_steps: int  # device steps that raised (their requests were retried one by one)
    lora_resident: int  # adapters in device slots
    lora: dict[str, int]  # the adapter manager's counters (slot_hits, disk_loads, host_hits, ...)
    # Prefix caching (vLLM's prefix_cache_queries / prefix_cache_hits): prompt tokens looked up at
    # admission and, of them, found computed; cached blocks no sequence uses (free, kept until evicted).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached: int = 0
    prefill_tokens: int = 0  # tokens prefilled (prompts after their cached prefix, and recomputation)


class _Phase:
    """Times a block for the step listeners (`PHASES`); nothing without listeners."""

    __slots__ = ("listeners", "name", "t0")

    def __init__(self, listeners: list[StepListener], name: str):
        self.listeners, self.name = listeners, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter() if self.listeners else 0.0

    def __exit__(self, *exc: Any) -> None:
        if self.listeners:
            seconds = time.perf_counter() - self.t0
            for listener in self.listeners:
                listener.phase(self.name, seconds)


class LLMEngine(Closable):
    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, eos_token_id: int | None,
                 devices: Sequence[Any] | None = None):
        """`devices`: the engine's devices (several: tensor parallel over them; ModelRunner)."""
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.runner = ModelRunner(model, config, eos_token_id, devices)
        self.adapters = AdapterManager(model.cfg, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                       max_cpu_loras=config.max_cpu_loras, dtype=model.dtype,
                                       slot_ranks=config.slot_ranks, modules=config.lora_modules,
                                       dora=config.enable_dora)
        self.scheduler = Scheduler(config, self.adapters)
        self.scheduler.can_run = self.runner.can_run
        self.output = OutputProcessor(config.max_model_len, eos_token_id)
        self.grammars = GrammarCompiler(tokenizer, model.cfg.vocab_size)
        self.requests: dict[str, Request] = {}
        self.num_failed_steps = 0
        self._ids = itertools.count()
        # Async scheduling (see `step`): on by default on a TPU, where the host's work between steps
        # was as long as the device's decode step.
        self._async = config.async_scheduling if config.async_scheduling is not None else \
            jax.default_backend() == "tpu"
        self._inflight: tuple[Any, Any, bool] | None = None  # (plan, launched step, committed) ahead
        # StepListeners (jlora.engine.step_listener), shared with the runner (launch and collect).
        self._listeners: list[StepListener] = []
        self.runner.listeners = self._listeners
        # Under jax.distributed every process must draw the same seeds (they feed one global step).
        self._seed_rng = random.Random(0 if jax.process_count() > 1 else None)

    def _release(self) -> None:
        """`close()`: stop a background warm-up, wait for a step launched ahead, free the device
        arrays (KV cache, weights, LoRA slots) and compiled graphs, and stop the adapter worker;
        `add_request` and `step` raise RuntimeError after it."""
        if self._inflight is not None:
            try:
                self.runner.collect(self._inflight[1])
            except Exception:  # noqa: BLE001 (its outputs are not used)
                pass
            self._inflight = None
        self.runner.close()
        self.adapters.close()

    # Read-only views for tests and benchmarks (callers use `stats()`).
    @property
    def kv(self):
        return self.scheduler.kv

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def async_scheduling(self) -> bool:
        """Whether steps are planned and launched ahead (`EngineConfig.async_scheduling`, resolved
        for the backend). Settable while no step is launched ahead (`has_unfinished()` false): a
        benchmark compares both on one engine's graphs."""
        return self._async

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"async_scheduling must be a bool, got {on!r}")
        if self._inflight is not None:
            raise RuntimeError("async_scheduling cannot change while a step is launched ahead; finish the requests first")
        self._async = on

    def add_step_listener(self, listener: StepListener) -> None:
        """Tell `listener` about every step from now on: its phases' host seconds, each launch and
        collect (jlora.engine.step_listener). Benchmarks and tracing use it."""
        if not isinstance(listener, StepListener):
            raise TypeError(f"listener must be a jlora.engine.step_listener.StepListener, got {type(listener).__name__}")
        self._listeners.append(listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        self._listeners.remove(listener)

    def stats(self) -> EngineStats:
        s, total = self.scheduler, self.config.num_kv_blocks
        queries, hits = (0, 0) if s.prefix_cache is None else (s.prefix_cache.queries, s.prefix_cache.hits)
        return EngineStats(len(s.running), len(s.waiting), total - s.kv.num_free, total, s.num_preemptions,
                           self.num_failed_steps, len(self.adapters.resident()), dict(self.adapters.stats),
                           queries, hits, s.kv.num_cached_free, s.num_prefill_tokens)

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
        self._check_open()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check_for_engine(self.runner.cfg.vocab_size, self.config.max_n)
        cap, waiting = self.config.max_waiting_seqs, len(self.scheduler.waiting)
        if cap is not None and waiting + params.n > cap:
            raise QueueFullError(f"{waiting} sequences are waiting and this request adds {params.n}; "
                                 f"max_waiting_seqs={cap}")
        prompt_text, ids = self._tokenize(prompt)
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={limit} leaves no room to generate "
                             f"(the prompt must be at most {limit - 1} tokens)")
        if any(not 0 <= t < self.runner.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be in [0, {self.runner.cfg.vocab_size})")
        handle = None
        if isinstance(lora_request, LoRACombination):
            handle = self._prepare_combination(lora_request, lora_handle)
        elif lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, a LoRARequest.combine(...) or None, got "
                                 f"{type(lora_request).__name__}")
            if lora_handle is not None and lora_handle.version[0] != lora_request.lora_name:
                raise ValueError(f"lora_handle is for adapter {lora_handle.version[0]!r}, the request names "
                                 f"{lora_request.lora_name!r}")
            # Converts now unless given (raises on a bad adapter); the request keeps this version to the end.
            handle = lora_handle or self.adapters.prepare(lora_request)
            if handle.adapter.is_dora and lora_request.scale != 1.0:
                # A slot's DoRA factor m / ||W + s B A|| is made for the adapter's own scale.
                raise ValueError(f"LoRARequest.scale: adapter {lora_request.lora_name!r} is a DoRA adapter, whose "
                                 f"column norms are computed for its own scale; scale={lora_request.scale} is not "
                                 f"supported with DoRA (use 1.0)")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**32)
        so = params.structured_outputs
        matchers = [self.grammars.matcher(so) for _ in range(params.n)] if so is not None else [None] * params.n
        prompt_lps = [None] if params.prompt_logprobs is not None else None  # shared by the samples
        seqs = [Sequence(request_id, i, ids, params, (base_seed + 7919 * i) % 2**32, lora_request, handle,
                         detok=IncrementalDetokenizer(self.tokenizer), matcher=matchers[i],
                         prompt_logprobs=prompt_lps) for i in range(params.n)]
        req = Request(request_id, prompt_text, ids, params, lora_request, seqs)
        req.metrics.num_prompt_tokens = len(ids)
        req.streamed_chars = [0] * params.n
        self.requests[request_id] = req
        self.scheduler.add(seqs)
        return request_id

    def _prepare_combination(self, combo: LoRACombination,
                             handles: tuple[AdapterHandle, ...] | None) -> tuple[AdapterHandle, ...]:
        """Each part's adapter version (converted now unless given), after checking the parts can
        be in slots at once: no more of them than slots, and a slot of enough rank for each."""
        n = len(combo.parts)
        if n > self.config.max_loras:
            raise ValueError(f"lora_request combines {n} adapters ({combo.lora_name}) but the engine has "
                             f"max_loras={self.config.max_loras} slots; all of a combination's adapters must be "
                             f"in slots at once (raise max_loras or combine fewer)")
        if handles is not None:
            if not isinstance(handles, tuple) or [h.version[0] for h in handles] != [p.lora_name for p in combo.parts]:
                raise ValueError(f"lora_handle must be one handle per part of {combo.lora_name!r}, in order")
        else:
            handles = tuple(self.adapters.prepare(p) for p in combo.parts)
        dora = [h.version[0] for h in handles if h.adapter.is_dora]
        if dora:  # a combination's rows carry one weighted delta, not each part's DoRA factor
            raise ValueError(f"lora_request {combo.lora_name!r}: DoRA adapters cannot be combined ({', '.join(dora)}); "
                             f"serve them on their own")
        # Slot pools of several ranks (lora_slot_ranks): the largest part takes the largest slot, and so on.
        slot_ranks = sorted(self.adapters.slot_ranks, reverse=True)
        ranks = sorted((h.adapter.rank for h in handles), reverse=True)
        if any(r > sr for r, sr in zip(ranks, slot_ranks)):
            raise ValueError(f"lora_request {combo.lora_name!r}: adapters of ranks {ranks} do not fit the slots of "
                             f"ranks {sorted(self.adapters.slot_ranks)} at once")
        return handles

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

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish what is left of a request with "abort"; its final state (None: unknown id). The
        request stays until `pop_finished`."""
        self._fail_request(request_id, "abort")
        req = self.requests.get(request_id)
        return None if req is None else req.to_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`): later requests recompute their
        prompts. False, and nothing forgotten, while requests are unfinished."""
        if self.has_unfinished():
            return False
        self.scheduler.kv.drop_cache()
        return True

    def _fail_request(self, request_id: str, reason: str, error: str | None = None) -> None:
        """Finish every unfinished sequence of a request with `reason` ("abort" or "error"), in time
        linear in its sequences."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        if error is not None:
            req.error = error
        self.scheduler.free_request(request_id, req.seqs)
        for seq in req.seqs:
            if seq.state is not SeqState.FINISHED:
                self._mark_finished(seq, reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        self.scheduler.free(seq)
        self._mark_finished(seq, reason, stop_reason)

    def _mark_finished(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.state = SeqState.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        req = self.requests[seq.request_id]
        req.num_unfinished -= 1
        if req.finished:
            req.metrics.finished_time = time.time()

    def _fail(self, request_id: str, error: str, touched: dict[str, Request]) -> None:
        self._fail_request(request_id, "error", error)
        if request_id in self.requests:
            touched[request_id] = self.requests[request_id]

    def _is_live(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and not req.finished

    # ---- one step -------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One scheduling round, one device call. Returns the requests that changed (their state so
        far; `finished` on the last), including any failed in this step; with `finished_only`, only
        those that finished (vLLM's FINAL_ONLY: `LLM.generate` needs no snapshot of 64 unfinished
        requests on every step).

        With async scheduling (`EngineConfig.async_scheduling`, vLLM's name) the next step is
        planned and launched before this one's tokens reach the host, when nothing in the plan
        depends on their values (`_can_look_ahead`): the device then runs step n+1 while the host
        reads and processes step n, and each decode row's token goes from one step to the next
        on the device. Outputs are the same tokens; a sequence that stops (EOS, a stop string)
        leaves at most one wasted row in the step already launched."""
        self._check_open()
        if not self._listeners:
            return self._step(finished_only)
        for listener in self._listeners:
            listener.step_started()
        t0 = time.perf_counter()
        try:
            return self._step(finished_only)
        finally:
            for listener in self._listeners:
                listener.step_finished(time.perf_counter() - t0)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        outputs = lambda: [r.to_output() for r in touched.values() if r.finished or not finished_only]  # noqa: E731
        if self._inflight is not None:
            plan, handle, committed = self._inflight
            self._inflight = None
        else:
            planned = self._plan(touched)
            if planned is None:
                return outputs()
            plan, batch = planned
            if not self._async:
                try:
                    out = self.runner.step(batch)
                except Exception as e:
                    self._step_failed(plan, e, touched)
                    return outputs()
                self._commit(plan)
                self.output.record_prompt_logprobs(plan, out)
                with _Phase(self._listeners, "process"):
                    self._process(out, plan.sampled, touched)
                return outputs()
            try:
                handle, committed = self.runner.launch(batch), False
            except Exception as e:
                self._step_failed(plan, e, touched)
                return outputs()
        ahead = None
        if self._can_look_ahead(plan):
            self._commit(plan)
            committed = True
            ahead = self._launch_ahead(plan, handle, touched)
        try:
            out = self.runner.collect(handle)
        except Exception as e:
            if ahead is not None:  # built on this step's cache: wait it out and recompute everyone
                try:
                    self.runner.collect(ahead[1])
                except Exception:
                    pass
                self.runner.cache = self.runner._zero_cache()
            self._step_failed(plan, e, touched, cache_lost=ahead is not None or committed)
            return outputs()
        if not committed:
            self._commit(plan)
        self.output.record_prompt_logprobs(plan, out)
        with _Phase(self._listeners, "process"):
            self._process(out, plan.sampled, touched)
        self._inflight = ahead
        if self._inflight is not None and not self.scheduler.has_unfinished():
            self._drain()  # everyone finished: the step launched ahead carries only finished rows
        return outputs()

    def _plan(self, touched: dict[str, Request]) -> tuple[Any, dict[str, Any]] | None:
        """The next plan and its host arrays; a sequence whose row cannot be built fails alone and
        the rest are planned again. None when nothing can run."""
        while True:
            with _Phase(self._listeners, "schedule"):
                plan = self.scheduler.schedule(self._is_live)
            if plan is None:
                return None
            with _Phase(self._listeners, "write_slots"):  # before anything of the plan can fail: the slots are assigned
                self.runner.write_slots(plan.slot_writes)
            try:
                with _Phase(self._listeners, "build_batch"):
                    return plan, self.runner.build_batch(plan)
            except RowFailed as f:
                log.warning("request %s failed on the host: %s", f.seq.request_id, f)
                self._fail(f.seq.request_id, str(f), touched)

    def _step_failed(self, plan: Any, e: Exception, touched: dict[str, Request], cache_lost: bool = False) -> None:
        self.num_failed_steps += 1
        log.error("engine step over requests %s failed: %s: %s", plan.request_ids, type(e).__name__, e)
        lost = self.runner.reset_cache_if_lost() or cache_lost
        culprit = self.scheduler.step_failed(plan, cache_lost=lost)
        if culprit is not None:
            self._fail(culprit, f"the engine step failed for this request: {type(e).__name__}: {e}", touched)

    def _commit(self, plan: Any) -> None:
        """The plan's step ran: the scheduler books it, less sequences that finished meanwhile (a
        row launched ahead of its sequence's stop)."""
        live = lambda s: s.state is not SeqState.FINISHED  # noqa: E731
        with _Phase(self._listeners, "commit"):
            self.scheduler.commit(dataclasses.replace(plan, decode=[s for s in plan.decode if live(s)],
                                                      prefill=[c for c in plan.prefill if live(c[0])]))

    def _can_look_ahead(self, plan: Any) -> bool:
        """Whether the step after `plan` can be planned before `plan`'s tokens are known: a decode-only
        plan whose every row continues by length, samples without the token history (penalties)
        or a grammar, while no failed step is being retried, and whose next KV blocks are free
        (planning must not preempt a sequence whose last token is still on the device)."""
        if not self._async or plan.prefill or not plan.decode or self.scheduler.has_suspects():
            return False
        need = 0
        for s in plan.decode:
            p = s.params
            if s.state is SeqState.FINISHED or s.matcher is not None or p.uses_penalties:
                return False
            max_new = p.max_tokens if p.max_tokens is not None else self.config.max_model_len
            if len(s.output_ids) + 1 >= max_new or s.total_len + 1 >= self.config.max_model_len:
                return False  # it stops by length with this token: plan the next step after it
            need += self.config.blocks_for(s.total_len + 1) - len(s.blocks)
        return need <= self.scheduler.kv.num_free

    def _launch_ahead(self, plan: Any, handle: Any, touched: dict[str, Request]) -> tuple[Any, Any, bool] | None:
        """Plan and launch the step after `plan` while it runs: each of its sequences holds a
        placeholder for the token on the device, which the new step's row reads there."""
        placeholder = -1
        rows = {id(s): i for i, s in enumerate(plan.decode)}
        for s in plan.decode:
            s.output_ids.append(placeholder)
        try:
            planned = self._plan(touched)
        finally:
            for s in plan.decode:
                s.output_ids.pop()
        if planned is None:
            return None
        nplan, batch = planned
        for row, s in enumerate(nplan.decode):
            batch["prev_rows"][row] = rows.get(id(s), -1)
            if batch["prev_rows"][row] < 0 and batch["tokens"][row] == placeholder:  # cannot happen: say so
                raise RuntimeError(f"async scheduling: decode row {row} has no token (request {s.request_id})")
        try:
            return nplan, self.runner.launch(batch, prev=handle), False
        except Exception as e:
            self._step_failed(nplan, e, touched)
            return None

    def _drain(self) -> None:
        plan, handle, _ = self._inflight
        self._inflight = None
        try:
            self.runner.collect(handle)
        except Exception as e:  # nothing of it is used; a lost cache is rebuilt for whoever comes next
            log.warning("a step launched ahead failed after its sequences finished: %s", e)
            if self.runner.reset_cache_if_lost():
                self.scheduler.kv.drop_cache()  # the cached prefixes went with it

    def _process(self, out: dict[str, Any], sampled: list[Sequence], touched: dict[str, Request]) -> None:
        now = time.time()
        stale = {id(s) for s in sampled if s.state is SeqState.FINISHED}  # rows launched ahead of a stop
        for row, s in enumerate(sampled):
            if id(s) in stale or s.request_id not in self.requests:
                continue
            req = self.requests[s.request_id]
            touched[s.request_id] = req
            if s.state is SeqState.FINISHED:  # its request failed on an earlier row of this step
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            before = len(s.output_ids)
            try:
                finish = self.output.append(s, out, row)
            except Exception as e:  # detokenizing or a stop check: this request's failure alone
                log.warning("request %s failed on its sampled token: %s", s.request_id, e)
                self._fail(s.request_id, f"{type(e).__name__}: {e}", touched)
                continue
            req.metrics.num_generated_tokens += len(s.output_ids) - before
            if finish is not None:
                self._finish(s, *finish)

    # ---- outputs ----------------------------------------------------------------------------------

    def get_output(self, request_id: str) -> RequestOutput | None:
        """A request's state so far (None: unknown id)."""
        req = self.requests.get(request_id)
        return None if req is None else req.to_output()

    def pop_finished(self, request_id: str) -> RequestOutput:
        req = self.requests.pop(request_id)
        return req.to_output()

    def stream_deltas(self, request_id: str) -> list[str]:
        """Text added to each sample since the last call; the deltas always join to the final text."""
        return self.output.stream_deltas(self.requests[request_id])
