"""Paged attention as a Pallas TPU (Mosaic) kernel; `attention.paged_attention` is its reference.

Same contract as `jlora.kernels.attention.paged_attention`: q [B, Q, H, Dh], a cache
`[L, NB, bs, KVH*Dh]` of every layer, the layer as a traced scalar, positions [B, Q] (-1 =
padding) and block tables [B, MB]; causal, grouped-query, optional sliding window. Why a kernel:
on a v5e chip the XLA loop gathered 128-position chunks through the block table and widened them
to float32 (~11 ms of a 40 ms decode step), and XLA re-laid out the whole cache around it.

How it reads the cache. The cache stays in HBM (`memory_space=ANY`, the whole [L, ...] array: a
dynamic slice of one layer would copy it). Grid (sequence b, query block i); each program walks
its key chunks (`chunk` positions = `chunk // bs` pages) from the first any of its queries can
see to the last, copying into VMEM only the pages its sequence reaches, one DMA per page for K
and one for V, double-buffered: chunk c+1 is in flight while c is computed, and during a
program's last chunk the next program's first is (programs run in order, so none starts by
waiting for its first copy). A page is [bs, KVH*Dh], one contiguous run of HBM, every KV head at
once; a full chunk is waited for once for K and once for V (semaphores count bytes), a partial
one page by page. Block tables, chunk ranges and page counts are scalar-prefetched into SMEM.
Page size matters more than anything else here: on a v5e chip, 64 rows x 1,024 positions read at
45% of HBM with 16-position pages and 61-72% with 32-256 (2026-12-06), which is why
the engine's TPU default block size is a sixteenth of max_model_len. (Copying whole
chunks instead read 512 positions for a 40-token sequence: on a v5e chip, 238 us of attention
per layer for 64 such rows, 40% of a decode step's roofline -> 52% once only reached pages move.)

How it multiplies. The KV heads sit side by side on the lanes, so the kernel works per lane tile
of LT lanes (`lane_tiles`): LT = Dh when Dh is a multiple of 128 (one head per tile), 128 when Dh
divides 128 (two heads per tile at Dh = 64), else the whole KVH*Dh row (e.g. 3 x 64). Each query
row carries its head's vector at that head's lanes of the tile and zeros elsewhere, so
`q_tile @ k_tile^T` gives every row its own head's scores with no lane shuffles, and
`p @ v_tile` gives each row its own head's values in its own lanes (the other lanes of the row
are discarded outside). Every key and value element passes through the MXU once, as it must;
the zeros cost MXU rows, not HBM bytes. Softmax is online across chunks, in float32.

How much it computes. A chunk is sized for long sequences (1,024 positions at the 1B shape), so a
short sequence's program copied two pages but computed all eight. A decode program (few query
rows: `compute_block`) computes a chunk whose pages were all copied at once, and a partial one (a
sequence's last) in steps of whole pages, at least 128 positions, skipping the steps past its
last page. On a v5e chip (64 rows, bf16, 128-position pages, 1,024-position chunks) steps for
every chunk took 64 x 256 positions from 170 to 149 us but 64 x 1,024 from 218 to 408 (a step
costs more than its share of a whole chunk), hence steps only where a chunk is partial. A prefill
program (hundreds of rows) takes a full chunk at once, and a partial one as one smaller block
covering its copied pages (`AttentionOptions.prefill_round`): rescaling its accumulator each step would cost more
than the empty rest it skips.

`AttentionOptions.seqs_per_program` (an experiment, `jlora bench tpu --kernel-variants ...+seqsN`; default 1): a
decode program walks several sequences one after the other, each as a program would, so the
grid's per-program cost (its q and output blocks' copies, the pipeline's steps) is paid once for
several short sequences. At short contexts a program per sequence costs ~1.1-2.3 us (64 x 160-256
positions, v5e, 2026-12-06) against ~0.3-0.6 us of DMA.

An int8 cache (`jlora.kernels.kv_quant`) comes with f32 scales [L, NB, KVH, bs]: each page's
[KVH, bs] scales are DMA'd beside its K and V pages (own semaphores), the int8 rows are converted
to q's dtype in VMEM, and the scales applied where they cost least: each score row times its
head's key scales ([rows, size], a select of [1, size] rows per head of the tile), each weight
row times its head's value scales before `p @ v`. Never a dequantized copy of the cache in HBM.

`paged_attention_tpu(..., interpret=True)` runs on the CPU (tests/test_attention_tpu.py holds it
against the reference); `jax.export` lowers it for platforms=["tpu"] without the chip.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial, reduce

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jlora.kernels.attention import validate_attention_args
from jlora.tuning import AttentionOptions

NO_WINDOW = 1 << 30  # a window past any position
# What a program's blocks may take of the scoped VMEM (16 MiB by default on a v5e), by
# `vmem_estimate`. Measured on the chip: estimates of 9 MB compiled (1B shape, 512 rows, 512-position
# chunks); 14 and 15 MB did not ("CompileTimeScopedVmemOom", 18.6-19.9 MB actually needed: the
# 1B shape with 1,024-position chunks, the 8B's prefill with 512 rows).
VMEM_BUDGET = 10 * 2**20
DEFAULT_SCOPED_VMEM = 16 * 2**20  # Mosaic's scoped VMEM limit on a v5e unless vmem_limit is given
# Chunks of at most this many pages issue their DMAs as straight-line code (pl.when per page);
# longer ones loop.
UNROLL_PAGES = 16
# Programs with at most this many query rows (decode: a query's heads) compute a chunk in steps.
SMALL_PROGRAM_ROWS = 64
DEFAULT_OPTIONS = AttentionOptions()


def default_chunk(kd: int, itemsize: int) -> int:
    """The engine's key chunk for this kernel (`attn_chunk=None`): 1,024 positions where a chunk's
    K and V double buffers (`vmem_estimate` without query rows) take at most 4 MiB of VMEM (a
    [bs, KVH*Dh] row of 1 KB or less, as at the 1B shape), else 512 (the 8B's 2 KB rows, whose
    prefill blocks need the room). On a v5e chip 1,024 took the 1B seed workload's decode step
    from 9.93 to 9.33 ms (2026-12-06)."""
    return 1024 if vmem_estimate(0, 1024, kd, itemsize) <= 4 * 2**20 else 512


def lane_tiles(kvh: int, dh: int) -> tuple[int, int]:
    """(lane tile width LT, KV heads per tile) for a [.., KVH*Dh] cache row."""
    if dh % 128 == 0:
        return dh, 1
    if 128 % dh == 0 and (kvh * dh) % 128 == 0:
        return 128, 128 // dh
    return kvh * dh, kvh


def cache_lanes(kvh: int, dh: int) -> int:
    """Lanes of a cache row this kernel reads: KVH*Dh, rounded up to whole 128-lane tiles where Dh
    divides 128. SmolLM2's 3 KV heads of 64 (192 lanes) become 256, 4 heads of which the last is
    padding: in a compile for v5e (`jlora bench tpu-compile`) XLA:TPU copied the whole 192-lane
    cache into another layout around the step, and the TPU stores a row in 128-lane tiles anyway,
    so the padding costs no memory there."""
    kd = kvh * dh
    return kd if kd % 128 == 0 or 128 % dh else -(-kd // 128) * 128


def compute_block(chunk: int, bs: int, rows: int, prefill_step: int | None = None) -> int:
    """Key positions per compute step of a program with `rows` query rows: a decode program (at
    most SMALL_PROGRAM_ROWS rows) computes a chunk in steps of at least 128 positions (whole
    pages), skipping those past its sequence's last page; a prefill program takes the chunk at
    once (its rows' rescaling each step cost more than the causal rest it skips), or in steps of
    `prefill_step` positions where that is set (`AttentionOptions.prefill_step`)."""
    if rows > SMALL_PROGRAM_ROWS:
        if not prefill_step:
            return chunk
        return min(chunk, bs * -(-prefill_step // bs))
    return min(chunk, bs * -(-128 // bs))


def prefill_sizes(chunk: int, bs: int, rows: int, round_to: int | None) -> tuple[int, ...]:
    """Block sizes a program with `rows` query rows may compute a partial chunk as, ascending, the
    last the whole chunk: multiples of `round_to` (whole pages) for a prefill program with
    `round_to` set, else the whole chunk alone."""
    if rows <= SMALL_PROGRAM_ROWS or not round_to:
        return (chunk,)
    step = bs * -(-round_to // bs)
    return tuple(range(step, chunk, step)) + (chunk,)


def vmem_estimate(rows: int, chunk: int, kd: int, itemsize: int) -> int:
    """Bytes of VMEM a program uses: the K and V chunk buffers (two slots each), and per query row
    its float32 accumulator, its output block and its query block (both double-buffered by the
    pipeline) across the KVH*Dh lanes, and the [rows, chunk] float32 scores and weights of a tile."""
    buffers = 2 * 2 * chunk * kd * itemsize
    per_row = kd * (4 + 2 * 4 + 2 * itemsize) + chunk * 4 * 3
    return buffers + rows * per_row


def query_block(nq: int, rows_per_query: int, sublanes: int, chunk: int = 0, kd: int = 0, itemsize: int = 2,
                budget: int = VMEM_BUDGET, max_rows: int = DEFAULT_OPTIONS.max_block_rows) -> int:
    """Queries per program: the largest divisor of Q whose rows fit `max_rows`
    (`AttentionOptions.max_block_rows`) and `budget` (`vmem_estimate`; chunk=0 skips that check)
    and tile the sublanes (or all Q, which any block shape allows)."""
    limit = max_rows

    def fits(d: int) -> bool:
        rows = d * rows_per_query
        return rows <= limit and (not chunk or d == 1 or vmem_estimate(rows, chunk, kd, itemsize) <= budget)

    for d in range(nq, 0, -1):
        if nq % d == 0 and fits(d) and (d == nq or d * rows_per_query % sublanes == 0):
            return d
    return nq


def _kernel(meta_ref, tables_ref, lo_ref, hi_ref, npages_ref,  # SMEM: (layer, window), [B*MB], [B*NQB] x3
            qpos_ref, q_ref, k_hbm, v_hbm,  # [(S,) rows, 1] i32, [(S,) NT, rows, LT], cache [L, NB, bs, KD] x2 in HBM
            *refs,  # int8: scales [L, NB, KVH, bs] x2 in HBM; then the output and the scratch below
            # o_ref [(S,) NT, rows, LT], f32 or q's dtype;
            # kbuf, vbuf VMEM [2, P, bs, KD] (int8: + ksbuf, vsbuf [2, P, KVH, bs]), DMA sems [2 or 4, 2],
            # m_ref, l_ref [NT, rows, 1], acc_ref [NT, rows, LT];
            # state_ref SMEM i32[2]: the buffer slot of this program's first chunk, whether it is already in flight
            pages: int, sub: int, sizes: tuple[int, ...], seqs: int, blocks_per_seq: int, n_qblocks: int,
            n_programs: int, lane_tile: int, n_tiles: int, regions: bool, quantized: bool = False,
            heads_per_tile: int = 1, groups: int = 1):
    if quantized:
        ks_hbm, vs_hbm, o_ref, kbuf, vbuf, ksbuf, vsbuf, sems, m_ref, l_ref, acc_ref, state_ref = refs
        pairs = ((k_hbm, kbuf), (v_hbm, vbuf), (ks_hbm, ksbuf), (vs_hbm, vsbuf))
    else:
        o_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref, state_ref = refs
        pairs = ((k_hbm, kbuf), (v_hbm, vbuf))
    layer, window = meta_ref[0], meta_ref[1]

    def region(name: str):
        """A named scope, which Mosaic lowers to a trace region of the profile, where `regions` is on."""
        return jax.named_scope(name) if regions else contextlib.nullcontext()
    bs = kbuf.shape[2]
    chunk = pages * bs

    def chunk_copies(owner, c, slot, n_pages, action):
        """Start (or wait for) the DMAs of program `owner`'s key chunk c into buffer `slot`: only the
        pages its rows reach (`n_pages` of the sequence), one K and one V copy per page."""
        row = jax.lax.div(owner, n_qblocks) * blocks_per_seq  # (no floor division: Mosaic's needs the chip)
        first = c * pages
        n = jnp.clip(n_pages - first, 0, pages)

        def one(p):
            page = tables_ref[row + first + p]
            for kind, (src, dst) in enumerate(pairs):
                action(pltpu.make_async_copy(src.at[layer, page], dst.at[slot, p], sems.at[kind, slot]))

        if pages <= UNROLL_PAGES:  # straight-line scalar code: no loop counter on the scalar core
            for p in range(pages):
                pl.when(p < n)(partial(one, p))
        else:
            jax.lax.fori_loop(0, n, lambda p, carry: (one(p), carry)[1], 0)

    def run(prog, q_view, qpos_view, o_view):
        """One program's work for one sequence (`prog`: its index in execution order) and q block."""
        lo, hi, npg = lo_ref[prog], hi_ref[prog], npages_ref[prog]

        def wait_chunk(c, slot):
            """Wait for key chunk c. A full chunk is one wait per K and V (a DMA semaphore counts bytes,
            so one wait the size of the whole buffer covers its pages); a partial one, page by page."""
            full = (npg - c * pages) >= pages

            @pl.when(full)
            def _whole():
                for kind, (src, dst) in enumerate(pairs):
                    pltpu.make_async_copy(src.at[layer, pl.ds(0, pages)], dst.at[slot], sems.at[kind, slot]).wait()

            @pl.when(jnp.logical_not(full))
            def _pages():
                chunk_copies(prog, c, slot, npg, wait)

        def _block(c, slot, j0, size, qpos, mask):
            """Online softmax over positions [j0, j0 + size) of key chunk c, every lane tile. `mask`: the
            block may reach pages that were not copied, whose buffer rows hold anything (NaN included),
            which the masked scores drop but a product with a zero weight would not."""
            key0 = c * chunk + j0
            visible_key = key0 + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
            visible = (visible_key <= qpos) & (visible_key > qpos - window)  # [rows, size]
            copied = None
            if mask:
                copied = (key0 + jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)) < npg * bs  # [size, 1]

            def rows_of(buf, lanes):  # [size, LT] of this block from the [2, P, bs, KD] buffer
                if size >= bs:
                    return buf[slot, pl.ds(j0 // bs, size // bs), :, lanes].reshape(size, lane_tile)
                return buf[slot, j0 // bs, pl.ds(j0 % bs, size), lanes]

            def scales_of(buf, t):  # [rows, size]: each query row's own KV head's scales, from [2, P, KVH, bs]
                def head_row(hd):  # [1, size]: head hd's scales over this block's positions
                    if size >= bs:
                        return jnp.concatenate([buf[slot, j0 // bs + p, pl.ds(hd, 1), :] for p in range(size // bs)],
                                               axis=1)
                    return buf[slot, j0 // bs, pl.ds(hd, 1), pl.ds(j0 % bs, size)]
                rows = q_view.shape[-2]
                row_head = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), groups) % heads_per_tile
                return reduce(lambda acc, j: jnp.where(row_head == j, head_row(t * heads_per_tile + j), acc),
                              range(1, heads_per_tile), jnp.broadcast_to(head_row(t * heads_per_tile), (rows, size)))

            for t in range(n_tiles):
                lanes = slice(t * lane_tile, (t + 1) * lane_tile)
                k = rows_of(kbuf, lanes)
                v = rows_of(vbuf, lanes)
                if quantized:  # int8 -> q's dtype in VMEM; the scales multiply the scores and the weights
                    k, v = k.astype(q_view.dtype), v.astype(q_view.dtype)
                if copied is not None:
                    v = jnp.where(copied, v, 0)
                with region("scores"):
                    s = jax.lax.dot_general(q_view[t], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    if quantized:
                        s = s * scales_of(ksbuf, t)  # pages not copied: anything, dropped by the mask below
                with region("softmax"):
                    s = jnp.where(visible, s, -jnp.inf)
                    m_prev = m_ref[t]
                    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
                    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    p = jnp.exp(s - m_safe)
                    alpha = jnp.exp(m_prev - m_safe)
                    l_ref[t] = alpha * l_ref[t] + p.sum(axis=1, keepdims=True)
                with region("values"):
                    if quantized:
                        vs = scales_of(vsbuf, t)
                        if copied is not None:  # a weight of 0 times a stale NaN scale would be NaN
                            lane_copied = (key0 + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)) < npg * bs
                            vs = jnp.where(lane_copied, vs, 0.0)
                        p = p * vs
                    acc_ref[t] = alpha * acc_ref[t] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
                    m_ref[t] = m_new

        start, wait = (lambda cp: cp.start()), (lambda cp: cp.wait())

        @pl.when(prog == 0)
        def _init():
            state_ref[0] = 0
            state_ref[1] = 0

        slot0 = state_ref[0]
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when((lo < hi) & (state_ref[1] == 0))
        def _first():
            chunk_copies(prog, lo, slot0, npg, start)

        # The next program's first chunk goes in flight during this one's last (programs run in order):
        # no program waits for its first DMA with nothing to compute.
        nxt = jnp.minimum(prog + 1, n_programs - 1)
        next_lo, next_hi, next_npg = lo_ref[nxt], hi_ref[nxt], npages_ref[nxt]
        prefetch_next = (prog + 1 < n_programs) & (next_lo < next_hi)

        def body(c, carry):
            slot = jax.lax.rem(slot0 + c - lo, 2)

            @pl.when(c + 1 < hi)
            def _next_chunk():
                chunk_copies(prog, c + 1, 1 - slot, npg, start)

            @pl.when((c + 1 == hi) & prefetch_next)
            def _next_program():
                chunk_copies(nxt, next_lo, 1 - slot, next_npg, start)

            with region("wait"):
                wait_chunk(c, slot)
            qpos = qpos_view[...]  # [rows, 1]
            if sub == chunk and len(sizes) == 1:
                _block(c, slot, 0, chunk, qpos, mask=pages > 1)
                return carry
            if sub == chunk:
                # One block of the smallest size covering the copied pages of this chunk (all of it
                # where the chunk is full). A size more than a page past the one below it may reach
                # pages not copied: masked.
                reach = npg * bs - c * chunk
                below = 0
                for size in sizes:
                    fits = reach > below if size == chunk else (reach > below) & (reach <= size)
                    pl.when(fits)(partial(_block, c, slot, 0, size, qpos, size - below > bs))
                    below = size
                return carry
            # A chunk with every page copied is computed at once; a partial one (a sequence's last) in
            # steps, skipping those past its last page: steps cost more each than one whole chunk.
            full = (npg - c * pages) >= pages
            pl.when(full)(partial(_block, c, slot, 0, chunk, qpos, False))

            @pl.when(jnp.logical_not(full))
            def _steps():
                for j in range(chunk // sub):
                    step = partial(_block, c, slot, j * sub, sub, qpos, sub > bs)
                    if j == 0:  # every visited chunk has its first page
                        step()
                    else:
                        pl.when(c * chunk + j * sub < npg * bs)(step)
            return carry

        jax.lax.fori_loop(lo, hi, body, 0)
        # Where the next program's first chunk is (the slot after this one's last), if in flight.
        state_ref[0] = jnp.where(lo < hi, 1 - jax.lax.rem(slot0 + hi - lo - 1, 2), 0)
        state_ref[1] = jnp.where(lo < hi, prefetch_next.astype(jnp.int32), 0)
        l = l_ref[...]
        with region("finish"):
            o_view[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_view.dtype)

    b, i = pl.program_id(0), pl.program_id(1)
    if seqs == 1:
        run(b * n_qblocks + i, q_ref, qpos_ref, o_ref)
    else:  # several decode sequences a program (one q block each): one after the other, as programs run
        def one(s, carry):
            run(b * seqs + s, q_ref.at[s], qpos_ref.at[s], o_ref.at[s])
            return carry

        jax.lax.fori_loop(0, seqs, one, 0)


@partial(jax.jit, static_argnames=("chunk", "interpret", "kv_heads", "options"))
def paged_attention_tpu(
    q: jax.Array,  # [B, Q, H, Dh]
    cache_k: jax.Array,  # [L, NB, bs, KVH*Dh], float32 / bfloat16 / float16
    cache_v: jax.Array,  # [L, NB, bs, KVH*Dh]
    layer: jax.Array,  # i32 scalar
    positions: jax.Array,  # i32[B, Q], -1 = padding
    block_tables: jax.Array,  # i32[B, MB]
    window: jax.Array | None = None,  # i32 scalar sliding window; None = full causal
    *,
    chunk: int,  # key positions per DMA'd chunk, a multiple of bs
    interpret: bool | pltpu.InterpretParams | None = None,  # None: interpret unless running on a TPU
    kv_heads: int | None = None,  # the model's KV heads where the cache row is padded (`cache_lanes`)
    options: AttentionOptions = DEFAULT_OPTIONS,  # how the work is split (jlora.tuning); static
    k_scale: jax.Array | None = None,  # f32[L, NB, KVH, bs]: an int8 cache's scales (jlora.kernels.kv_quant)
    v_scale: jax.Array | None = None,  # f32[L, NB, KVH, bs]
) -> jax.Array:  # [B, Q, H, Dh] in q's dtype, zeros for a padded query
    h_out = q.shape[2]
    if kv_heads is not None and kv_heads * q.shape[3] != cache_k.shape[-1]:
        # The pad lanes are KV heads no query reads: q gets their query heads as zeros, their
        # outputs are dropped.
        dh, kd = q.shape[3], cache_k.shape[-1]
        if kd % dh or kv_heads * dh > kd or h_out % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} of {dh} lanes does not fit a cache row of {kd} lanes "
                             f"with q's {h_out} heads")
        q = jnp.pad(q, ((0, 0), (0, 0), (0, (kd // dh - kv_heads) * (h_out // kv_heads)), (0, 0)))
    validate_attention_args(q, cache_k, cache_v, layer, positions, block_tables, chunk, window, k_scale, v_scale)
    if cache_k.dtype == jnp.uint16:
        raise ValueError("paged_attention_tpu reads real float caches; uint16 (bf16 bits) is XLA:CPU's storage, "
                         "use attention.paged_attention there")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    bsz, nq, h, dh = q.shape
    _, _, bs, kd = cache_k.shape
    kvh, mb = kd // dh, block_tables.shape[1]
    g = h // kvh
    lt, hpt = lane_tiles(kvh, dh)
    nt = kd // lt
    rq = hpt * g  # rows per query in a tile: its heads in the tile x the query heads of each
    quantized = cache_k.dtype == jnp.int8
    cdt = q.dtype if quantized else cache_k.dtype  # what the MXU multiplies (int8 converted in VMEM)
    if not isinstance(options, AttentionOptions):
        raise ValueError(f"options must be a jlora.tuning.AttentionOptions, got {type(options).__name__}")
    vmem_limit = options.vmem_limit
    budget = VMEM_BUDGET if vmem_limit is None else VMEM_BUDGET * vmem_limit // DEFAULT_SCOPED_VMEM
    # (int8 pages take half of bf16's VMEM; counted at the compute dtype's size: room for the converted tiles)
    qb = query_block(nq, rq, 16 if jnp.dtype(cdt).itemsize == 2 else 8, chunk, kd, jnp.dtype(cdt).itemsize, budget,
                     options.max_block_rows)
    nqb, rows = nq // qb, qb * rq

    # Each row: its query head's vector at its KV head's lanes of the tile, zeros elsewhere. Built
    # from [rows, Dh] slabs and lane concatenations: a 7-D einsum with an identity here made
    # XLA:TPU tile its (heads, Dh) minor axes and re-lay them out, ~200 us a layer at a
    # 1,024-token prefill (more than the kernel itself; 2026-12-06).
    rows_q = (q.astype(jnp.float32) / math.sqrt(dh)).astype(cdt).reshape(bsz, nq, nt, hpt * g, dh)
    rows_q = rows_q.transpose(0, 2, 1, 3, 4).reshape(bsz, nt, nq * rq, dh)  # rows (query, head, group)
    head = (jnp.arange(nq * rq, dtype=jnp.int32) // g % hpt)[:, None]  # each row's head within its tile
    # One select of lane-shifted copies (pads fuse into it): a concatenation of per-head selects
    # was two passes over [.., LT] in a v5e compile.
    shifted = [jnp.pad(rows_q, ((0, 0), (0, 0), (0, 0), (j * dh, (hpt - 1 - j) * dh))) for j in range(hpt)]
    qt = reduce(lambda acc, j: jnp.where(head == j, shifted[j], acc), range(1, hpt), shifted[0])
    qpos = jnp.broadcast_to(positions.astype(jnp.int32)[:, :, None], (bsz, nq, rq)).reshape(bsz, nq * rq, 1)

    # The key chunks each program visits: up to its furthest query, from the first its window shows.
    blocks = positions.astype(jnp.int32).reshape(bsz, nqb, qb)
    hi = (jnp.max(blocks, axis=2) + chunk) // chunk  # 0 when all padding
    win = NO_WINDOW if window is None else jnp.asarray(window, jnp.int32)
    lo = jnp.zeros_like(hi)
    if window is not None:
        lowest = jnp.min(jnp.where(blocks >= 0, blocks, jnp.iinfo(jnp.int32).max), axis=2)
        lo = jnp.minimum(jnp.maximum(lowest - win + 1, 0) // chunk, hi)
    meta = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(win, jnp.int32)])
    npages = (jnp.max(blocks, axis=2) + bs) // bs  # pages up to the furthest query (0: all padding)

    pages = chunk // bs
    sub = compute_block(chunk, bs, rows, options.prefill_step) if options.sub_block is None else options.sub_block
    if sub <= 0 or chunk % sub or (sub % bs and bs % sub):
        raise ValueError(f"options.sub_block must divide the chunk {chunk} and be a multiple or a divisor of the "
                         f"block size {bs}; got {sub}")
    sizes = prefill_sizes(chunk, bs, rows, options.prefill_round)
    seqs = 1 if nqb > 1 else max(d for d in range(1, min(options.seqs_per_program, bsz) + 1) if bsz % d == 0)
    kernel = partial(_kernel, pages=pages, sub=sub, sizes=sizes, seqs=seqs, regions=options.trace_regions,
                     blocks_per_seq=mb, n_qblocks=nqb,
                     n_programs=bsz * nqb, lane_tile=lt, n_tiles=nt, quantized=quantized, heads_per_tile=hpt, groups=g)
    lead = None if seqs == 1 else seqs  # a squeezed sequence axis, or S sequences a block
    # Rows are written in q's dtype where they fill its sublane tiles (a prefill block: a bf16
    # step writes and reads back half the bytes of f32, 8 MB a layer at 1,024 tokens), else in f32
    # (a decode program's 8 rows), cast with the lane select below.
    odt = q.dtype if rows % (32 // jnp.dtype(q.dtype).itemsize) == 0 else jnp.float32
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((bsz, nt, nq * rq, lt), odt),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(bsz // seqs, nqb),
            in_specs=[
                pl.BlockSpec((lead, rows, 1), lambda b, i, *_: (b, i, 0)),
                pl.BlockSpec((lead, nt, rows, lt), lambda b, i, *_: (b, 0, i, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ] + [pl.BlockSpec(memory_space=pl.ANY)] * (2 if quantized else 0),
            out_specs=pl.BlockSpec((lead, nt, rows, lt), lambda b, i, *_: (b, 0, i, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, pages, bs, kd), cache_k.dtype), pltpu.VMEM((2, pages, bs, kd), cache_k.dtype),
            ] + ([pltpu.VMEM((2, pages, kvh, bs), k_scale.dtype), pltpu.VMEM((2, pages, kvh, bs), v_scale.dtype)]
                 if quantized else []) + [
                pltpu.SemaphoreType.DMA((4 if quantized else 2, 2)),
                pltpu.VMEM((nt, rows, 1), jnp.float32), pltpu.VMEM((nt, rows, 1), jnp.float32),
                pltpu.VMEM((nt, rows, lt), jnp.float32),
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit, disable_bounds_checks=not options.bounds_checks),
        interpret=interpret,
        name="jlora_paged_attention",
    )(meta, block_tables.astype(jnp.int32).reshape(-1), lo.reshape(-1), hi.reshape(-1),
      npages.reshape(-1), qpos, qt, cache_k, cache_v, *((k_scale, v_scale) if quantized else ()))

    # Keep each row's own head's lanes, then back to [B, Q, H, Dh].
    if hpt > 1:
        out = sum(jnp.where(head == j, out[..., j * dh:(j + 1) * dh], jnp.zeros((), odt)) for j in range(hpt))
    out = out.astype(q.dtype).reshape(bsz, nt, nq, hpt * g, dh).transpose(0, 2, 1, 3, 4)
    return out.reshape(bsz, nq, h, dh)[:, :, :h_out]
