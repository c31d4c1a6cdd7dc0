"""Page-wise KV writes (`page_writes` / `write_pages`, the engine's prefill chunks) against the row
scatter they replace: the same cache, bit for bit, for chunks that start mid-page, end mid-page,
span several pages, pad rows and columns, and reach a sequence's last block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.models.llama import AttnGroup, page_writes, write_pages


def row_scatter(c, layer, rows, g: AttnGroup):
    nb, bs = c.shape[1:3]
    pos = g.positions.reshape(-1)
    block = jnp.take_along_axis(g.block_tables, jnp.maximum(g.positions, 0) // bs, axis=1).reshape(-1)
    block = jnp.where(pos >= 0, block, nb)
    return c.at[layer, block, jnp.maximum(pos, 0) % bs].set(rows, mode="drop")


@pytest.mark.parametrize("bs,q,rows", [
    (4, 8, [(0, 8), (3, 5), (6, 0)]),  # from a page start; mid-page start and end; a padding row
    (16, 32, [(5, 32), (17, 30), (0, 1)]),  # Q a multiple of bs, crossing pages; one token
    (16, 12, [(28, 12), (52, 12)]),  # Q not a multiple of bs; ending on the table's last position
    (128, 32, [(100, 32), (0, 32)]),  # a page bigger than the chunk (the TPU's 128-position pages)
])
def test_page_writes_equal_row_scatter(bs, q, rows):
    rng = np.random.default_rng(bs + q)
    layers, nb, d, mb = 2, 64, 8, 64 // bs if bs < 64 else 4
    cache = jnp.asarray(rng.standard_normal((layers, max(nb, mb * len(rows)), bs, d)), jnp.float32)
    positions = np.full((len(rows), q), -1, np.int32)
    tables = np.zeros((len(rows), mb), np.int32)
    perm = rng.permutation(cache.shape[1])
    for i, (start, n) in enumerate(rows):
        positions[i, :n] = np.arange(start, start + n)
        tables[i] = perm[i * mb: (i + 1) * mb]  # each row its own blocks, in no order
    g = AttnGroup(jnp.asarray(positions), jnp.asarray(tables), runs=True)
    new = jnp.asarray(rng.standard_normal((len(rows) * q, d)), jnp.float32)
    where = page_writes(g, bs, cache.shape[1])
    for layer in range(layers):
        got = jax.jit(write_pages)(cache, jnp.int32(layer), new, where)
        want = row_scatter(cache, layer, new, g)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(cache))  # something was written
