"""The scheduler: which sequences run in the next step, with which KV blocks and adapter slot.

It owns the waiting queue, the running list and the block allocator, and hands the engine a
`StepPlan`: per sequence, the tokens it runs this step. It never touches arrays or the device
(the runner turns a plan into arrays); adapter slots it only assigns, through the manager, whose
queued slot writes ride in the plan (`StepPlan.slot_writes`) for the runner to apply.

Admission, preemption and the prefill shape choice are as `docs/engine.md` describes. With prefix
caching (`jlora.engine.prefix_cache`) a sequence is admitted with the cached blocks of its longest
computed prefix under its own adapter version, and its prefill starts after them; the block of
its last token is always its own (computed for its logits, never shared, so no sequence ever
writes into a shared block). Computed full blocks are registered when their step commits. When a
device step raises, the scheduler keeps its requests under suspicion and runs them one at a
time (`step_failed`, `_schedulable`), so one request that breaks the step is found and failed
alone while the others keep their tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Callable

from jlora.adapters.manager import AdapterManager, NoFreeSlotError, SlotWrite
from jlora.engine.blocks import BlockAllocator
from jlora.engine.config import EngineConfig, bucket_for
from jlora.engine.prefix_cache import PrefixCache, extend_hashes, root_hash
from jlora.engine.sequence import Sequence, SeqState

STEP_COST_TOKENS = 64  # a step's weight pass costs about as much as this many tokens' compute (SmolLM2, 2 cores)


@dataclasses.dataclass
class StepPlan:
    """One step: R decode rows, then P prefill chunks of Q tokens (shape (R, P, Q)).

    decode[i] runs its last token at row i; prefill[j] = (seq, start, n) runs tokens
    [start, start + n) of `seq.all_ids` as chunk j; sampled[k] is the sequence sampled at row k
    (the decode rows, then each prefill that completes its prompt in this step)."""

    shape: tuple[int, int, int]
    decode: list[Sequence]
    prefill: list[tuple[Sequence, int, int]]
    sampled: list[Sequence]
    slot_writes: tuple[SlotWrite, ...] = ()  # applied by the runner before this step (adapters admitted for it)

    @property
    def request_ids(self) -> list[str]:
        """The requests in this step, in row order, each once."""
        seqs = itertools.chain(self.decode, (s for s, _, _ in self.prefill))
        return list(dict.fromkeys(s.request_id for s in seqs))


class Scheduler:
    def __init__(self, config: EngineConfig, adapters: AdapterManager):
        self.config = config
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache = PrefixCache() if config.enable_prefix_caching else None
        self.kv = BlockAllocator(config.num_kv_blocks, self.prefix_cache)
        # TuningOptions.prefill_slack: how prefill shapes are chosen. Read each step and changes no
        # graph, so a bench may set it between workloads to compare policies on one engine.
        self.prefill_slack: float | None = config.tuning.prefill_slack
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens prefilled: what prefix caching saves
        # Requests of a step that raised, oldest first: each runs alone for one step, and the one that
        # fails alone is failed; the rest go back to batching.
        self._suspects: deque[str] = deque()
        # Whether a step shape's graph is compiled (ModelRunner.can_run): during a background warm-up
        # the scheduler keeps to the shapes that are, padding a step into a larger one.
        self.can_run: Callable[[tuple[int, int, int]], bool] = lambda shape: True

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- a plan ------------------------------------------------------------------------------------

    def schedule(self, is_live: Callable[[str], bool]) -> StepPlan | None:
        """The next step's plan, or None when nothing can run. `is_live(request_id)`: whether a
        suspect request is still unfinished (finished ones leave the suspect list)."""
        self._reserve_decode_blocks()  # running sequences first: admission gets what is left
        self._admit()
        decoding, prefilling = self._schedulable(is_live)
        if not decoding and not prefilling:
            return None
        c = self.config
        (p, q), chunks = self._choose_prefill(prefilling)
        # Rows are packed afresh each step: decoding sequences first, then prompts completing now.
        r = c.max_num_seqs if chunks else bucket_for(
            len(decoding), tuple(b for b in c.decode_row_buckets if self.can_run((b, 0, 0))))
        prefill = [(s, s.num_computed, min(q, s.total_len - s.num_computed)) for s in chunks]
        completing = [s for s, start, n in prefill if start + n == s.total_len]
        return StepPlan((r, p, q), decoding, prefill, decoding + completing, self.adapters.take_writes())

    def commit(self, plan: StepPlan) -> None:
        """The plan's step ran: its prefill chunks are in the KV cache now (not before, so a step
        that raised computed nothing), and a suspect that ran alone is cleared."""
        for s, _, n in plan.prefill:
            s.num_computed += n
            self.num_prefill_tokens += n
            self._register(s, s.num_computed)
        for s in plan.decode:  # its last token's key and value went in with this step
            self._register(s, s.total_len)
        if self._suspects and plan.request_ids == [self._suspects[0]]:
            self._suspects.popleft()

    def has_suspects(self) -> bool:
        """Whether a failed step's requests are being retried one at a time."""
        return bool(self._suspects)

    def step_failed(self, plan: StepPlan, cache_lost: bool) -> str | None:
        """The plan's device step raised. With the KV cache gone, every running sequence is
        recomputed. Returns the request to fail: the plan's only request; with several, None (they
        are put under suspicion and retried one at a time)."""
        if cache_lost:
            for seq in list(reversed(self.running)):  # latest first, so the queue keeps FIFO order
                self.preempt(seq)
            self.kv.drop_cache()  # the cached prefixes went with the cache
        ids = plan.request_ids
        if len(ids) == 1:
            if self._suspects and self._suspects[0] == ids[0]:
                self._suspects.popleft()
            return ids[0]
        self._suspects.extend(r for r in ids if r not in self._suspects)
        return None

    def _schedulable(self, is_live: Callable[[str], bool]) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences this step may carry (decoding, prefilling). While a failed step's
        requests are being retried, the oldest of them runs alone if it is running; otherwise the
        sequences of requests not under suspicion run (so the queue keeps moving)."""
        while self._suspects and not is_live(self._suspects[0]):
            self._suspects.popleft()
        running = self.running
        if self._suspects:
            solo = [s for s in running if s.request_id == self._suspects[0]]
            suspects = set(self._suspects)
            running = solo or [s for s in running if s.request_id not in suspects]
        return ([s for s in running if s.state is SeqState.DECODE],
                [s for s in running if s.state is SeqState.PREFILL])

    def _choose_prefill(self, seqs: list[Sequence]) -> tuple[tuple[int, int], list[Sequence]]:
        """The prefill shape (P sequences x Q tokens) and the sequences (oldest first) that waste
        the least: prompt tokens carried per token computed, counting the decode rows and the weight
        pass every step pays (about STEP_COST_TOKENS tokens of compute on a 2-core CPU)."""
        if not seqs:
            return (0, 0), []
        options = []
        for p, q in self.config.prefill_shapes():
            if not self.can_run((self.config.max_num_seqs, p, q)):
                continue
            take = seqs[:p]
            useful = sum(min(q, s.total_len - s.num_computed) for s in take)
            options.append((useful / (p * q + self.config.max_num_seqs + STEP_COST_TOKENS), (p, q), take))
        best = max(o[0] for o in options)
        slack = self.prefill_slack
        if slack is None:  # the best yield only, the first shape of equals
            near = [o for o in options if o[0] == best]
        else:  # the fewest sequences among the near-best, then the best yield among those
            near = [o for o in options if o[0] >= best * (1 - slack)]
            fewest = min(len(o[2]) for o in near)
            near = [o for o in near if len(o[2]) == fewest]
            top = max(o[0] for o in near)
            near = [o for o in near if o[0] == top]
        _, shape, take = near[0]  # the first of equals
        return shape, take

    # ---- admission and preemption ----------------------------------------------------------------

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
            hits, pending = self._cached_prefix(seq)
            if pending:  # a running sequence is computing its next blocks: wait for them, not compute them twice
                i += 1
                continue
            need = c.blocks_for(seq.total_len) - len(hits)
            if need + self.kv.num_parked_among(hits) > self.kv.num_free:
                return
            if seq.lora is not None:
                try:
                    seq.slot = self.adapters.acquire(seq.lora_handle, protect=needed)
                except NoFreeSlotError:
                    if c.scheduling_policy == "fcfs" or seq.num_overtaken >= c.max_overtakes:
                        return
                    i += 1
                    continue
            del self.waiting[i]
            for passed in itertools.islice(self.waiting, i):
                passed.num_overtaken += 1
            seq.blocks = self.kv.share(hits) + self.kv.allocate(need)  # shared first: allocate may evict parked ones
            seq.num_cached_blocks = len(hits)
            seq.num_computed = len(hits) * c.block_size
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed
            if self._cacheable(seq):
                self._count_lookup(seq)
                self.prefix_cache.claim(self._hashes(seq, seq.total_len // c.block_size)[len(hits):], seq)
            seq.state = SeqState.PREFILL
            self.running.append(seq)

    # ---- prefix caching ---------------------------------------------------------------------------

    def _cacheable(self, seq: Sequence) -> bool:
        # A sequence with an adapter but no handle has no version to key its blocks by.
        return self.prefix_cache is not None and (seq.lora is None or seq.lora_handle is not None)

    def _hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """The chain hashes of `seq`'s first `n_blocks` full blocks (extended as it grows; tokens never change)."""
        if len(seq.block_hashes) < n_blocks:
            root = b"" if seq.block_hashes else root_hash(seq.lora_handle.version if seq.lora is not None else None)
            extend_hashes(seq.block_hashes, root, seq.all_ids, self.config.block_size, n_blocks)
        return seq.block_hashes[:n_blocks]

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], bool]:
        """The cached blocks `seq` may start from, and whether its next block is being computed by
        a running sequence. prompt_logprobs requests skip the cache (as vLLM's): they need the
        logits at every prompt position."""
        if not self._cacheable(seq) or seq.params.prompt_logprobs is not None:
            return [], False
        cap = (seq.total_len - 1) // self.config.block_size  # the last token's block is computed, never shared
        hashes = self._hashes(seq, cap)
        hits = self.prefix_cache.lookup(hashes)
        return hits, len(hits) < cap and self.prefix_cache.claimed(hashes[len(hits)])

    def _count_lookup(self, seq: Sequence) -> None:
        """vLLM's prefix_cache_queries / prefix_cache_hits, in tokens, once per admission."""
        if seq.params.prompt_logprobs is None:
            self.prefix_cache.queries += seq.total_len
            self.prefix_cache.hits += seq.num_computed

    def _register(self, seq: Sequence, computed: int) -> None:
        """`seq`'s first `computed` tokens are in the KV cache: its full blocks among them are cached."""
        full = computed // self.config.block_size
        if full <= seq.num_cached_blocks or not self._cacheable(seq):
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.prefix_cache.register(hashes[i], seq.blocks[i])
        seq.num_cached_blocks = full

    def prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` are cached or being computed here (data-parallel routing)."""
        if self.prefix_cache is None:
            return 0
        n = len(self.prefix_cache.lookup(hashes))
        while n < len(hashes) and self.prefix_cache.claimed(hashes[n]):
            n += 1
        return n

    # ---- decode blocks -----------------------------------------------------------------------------

    def _reserve_decode_blocks(self) -> None:
        """Every decoding sequence needs a block for the position it writes next. When none is
        free, preempt the most recently admitted sequence (possibly the one asking)."""
        for seq in [s for s in self.running if s.state is SeqState.DECODE]:
            if seq.state is not SeqState.DECODE:
                continue  # preempted for an earlier sequence in this loop
            need = self.config.blocks_for(seq.total_len) - len(seq.blocks)
            while need > 0 and self.kv.num_free < need:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.state is SeqState.DECODE and need > 0:
                seq.blocks += self.kv.allocate(need)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0  # recomputed from scratch: prompt + the tokens generated so far
        seq.state = SeqState.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # victims go latest-first, so FIFO order is kept

    # ---- leaving ---------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """`seq` is finishing: out of the queue or the running list, its blocks and slot pin freed."""
        if seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        elif seq.state is not SeqState.FINISHED:
            self._release(seq)

    def free_request(self, request_id: str, seqs: list[Sequence]) -> None:
        """Free all of a request's unfinished sequences in time linear in them: its waiting ones
        leave the queue in one pass (not one `deque.remove` each)."""
        if any(s.state is SeqState.WAITING for s in seqs):
            self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        for s in seqs:
            if s.state not in (SeqState.WAITING, SeqState.FINISHED):
                self._release(s)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_claims(seq.block_hashes, seq)
        self.kv.free(seq.blocks)  # cached ones stay in the prefix cache until evicted
        seq.blocks = []
        seq.num_cached_blocks = 0
        if seq.slot >= 0:
            self.adapters.release(seq.slot)
            seq.slot = -1
