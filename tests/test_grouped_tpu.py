"""The library's own grouped matmuls for many rows on TPUs
(`moe_eqx._gmm.grouped_tpu`: `grouped_matmul`, `grouped_weight_gradient`) in Pallas'
interpreter on the CPU: values against `lax.ragged_dot` and a one-hot contraction
over group layouts edges first, both orientations, the contraction whole and tiled,
each visit's rows multiplied in chunks and whole; and Mosaic's lowering at a model
shape. `tests/test_tpu.py` runs them compiled."""

import re

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from moe_eqx._gmm.grouped_tpu import grouped_matmul, grouped_weight_gradient

G, K, N, M = 6, 64, 256, 200

# Group sizes, edges first: every row in one group (first, last), no row at all,
# empty groups first / between / last, groups that straddle tiles, one row a group,
# rows past the groups' sum.
LAYOUTS = {
    "all in the first": [200, 0, 0, 0, 0, 0],
    "all in the last": [0, 0, 0, 0, 0, 200],
    "no rows": [0, 0, 0, 0, 0, 0],
    "empty between": [0, 37, 0, 80, 1, 40],
    "even": [33, 33, 33, 33, 33, 35],
    "one row each, rest past": [1, 1, 1, 1, 1, 1],
    "rows past the sum": [17, 0, 50, 3, 0, 29],
}


def _reference(lhs, rhs, sizes, transpose):
    if transpose:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = jax.lax.ragged_dot(lhs, rhs, sizes, precision=jax.lax.Precision.HIGHEST)
    real = jnp.arange(lhs.shape[0]) < jnp.sum(sizes)
    return jnp.where(real[:, None], out, 0.0)


# (tiles, chunk): the contraction tiled with 16-row chunks, whole tiles (as megablox),
# and one row tile for all the rows. Each layout takes one in turn (Pallas'
# interpreter is slow), so that each tiling meets edges of several kinds.
TILINGS = [((64, 32, 128), 16), ((64, 64, 256), None), ((256, 64, 128), 128)]
CASES = pytest.mark.parametrize(
    ("layout", "tiles", "chunk"),
    [(name, *TILINGS[i % len(TILINGS)]) for i, name in enumerate(LAYOUTS)],
)


@CASES
@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
def test_matches_ragged_dot(layout, transpose, tiles, chunk):
    sizes = jnp.array(LAYOUTS[layout], jnp.int32)
    lhs = jr.normal(jr.key(0), (M, K))
    rhs = jr.normal(jr.key(1), (G, N, K) if transpose else (G, K, N))
    total = int(jnp.sum(sizes))
    out = grouped_matmul(
        lhs.at[total:].set(jnp.nan),  # rows past the groups must not show
        rhs,
        sizes,
        tiles=tiles,
        chunk=chunk,
        transpose_rhs=transpose,
        interpret=True,
    )
    assert out.shape == (M, N) and out.dtype == lhs.dtype
    want = _reference(lhs, rhs, sizes, transpose)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-4, rtol=0)
    # Rows past the groups are zero (written by the kernel, not left over).
    assert not np.any(np.asarray(out[total:]))


@CASES
@pytest.mark.parametrize("partial", [False, True], ids=["dividing", "partial"])
def test_weight_gradient_matches_a_one_hot_contraction(layout, tiles, chunk, partial):
    """Each group's `lhs^T @ d` over its own rows only (rows past the groups and
    other groups' rows masked out of shared tiles); an empty group's is zero. Also
    with output columns (`N` = 320, not a multiple of the column tile) in tiles
    whose last one overhangs the output."""
    n = 320 if partial else N
    sizes = jnp.array(LAYOUTS[layout], jnp.int32)
    lhs = jr.normal(jr.key(4), (M, K))
    d = jr.normal(jr.key(5), (M, n))
    total = int(jnp.sum(sizes))
    # Rows past the groups hold NaN in both operands (a cotangent there may): they
    # must not reach any group's block.
    out = grouped_weight_gradient(
        lhs.at[total:].set(jnp.nan),
        d.at[total:].set(jnp.nan),
        sizes,
        tiles=tiles,
        chunk=chunk,
        partial_columns=partial,
        interpret=True,
    )
    assert out.shape == (G, K, n) and out.dtype == lhs.dtype
    group = jnp.repeat(jnp.arange(G), sizes, total_repeat_length=M)
    real = jnp.arange(M) < jnp.sum(sizes)
    one_hot = ((group[:, None] == jnp.arange(G)[None, :]) & real[:, None]).astype(
        lhs.dtype
    )
    want = jnp.einsum(
        "mg,mk,mn->gkn", one_hot, lhs, d, precision=jax.lax.Precision.HIGHEST
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-3, rtol=0)
    for e in np.flatnonzero(np.asarray(sizes) == 0):
        assert not np.any(np.asarray(out[e])), e


@pytest.mark.parametrize(
    ("layout", "tiles", "chunk"),
    [
        ("all in the first", *TILINGS[0]),
        ("empty between", *TILINGS[1]),
        ("rows past the sum", *TILINGS[0]),
        ("no rows", *TILINGS[1]),
    ],
)
def test_overhanging_row_tiles_equal_padded_rows(layout, tiles, chunk):
    """With `overhang_rows` (M = 200, not a multiple of a 64-row tile: no padding,
    no slice; a 256-row tile is more than M and pads as before) both kernels give
    exactly what they give on padded rows, NaN in the rows past the groups."""
    sizes = jnp.array(LAYOUTS[layout], jnp.int32)
    total = int(jnp.sum(sizes))
    lhs = jr.normal(jr.key(8), (M, K)).at[total:].set(jnp.nan)
    rhs = jr.normal(jr.key(9), (G, K, N))
    d = jr.normal(jr.key(10), (M, N)).at[total:].set(jnp.nan)
    for overhang in (False, True):
        kw = dict(tiles=tiles, chunk=chunk, overhang_rows=overhang, interpret=True)
        out = grouped_matmul(lhs, rhs, sizes, **kw)
        grad = grouped_weight_gradient(lhs, d, sizes, **kw)
        if not overhang:
            want_out, want_grad = out, grad
    assert out.shape == (M, N) and grad.shape == (G, K, N)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))
    assert not np.any(np.isnan(np.asarray(grad)))


@pytest.mark.lowering_only
def test_row_tiles_overhang_by_default_and_lower_for_tpu():
    """The three products as `gmm_backend="auto"` runs them on a TPU
    (`_GroupedProducts` at its defaults), on a pair buffer that is not a multiple of
    the row tile (29492 rows: a fallback piece's buffer at the DeepSeek-V2-Lite-like
    shape, `buffer_factor=0.6`; any buffer but the worst case of one shard is such):
    the last row tile overhangs, no pad or slice of the rows is left in the program
    (on the chip, a copy of the rows each way around each product), and Mosaic's
    lowering accepts all three kernels."""
    from moe_eqx._gmm._products import gmm
    from moe_eqx._gmm.grouped_tpu import _GroupedProducts

    m, k, n, g = 29492, 2048, 2816, 64
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
    d = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

    def step(a, b, s, cot):
        y, pullback = jax.vjp(lambda a, b: gmm(_GroupedProducts(), a, b, s), a, b)
        return y, pullback(cot)

    traced = jax.jit(step).trace(lhs, rhs, sizes, d)
    copies = re.findall(r"bf16\[\d+,\d+\] = (?:pad|slice)", str(traced.jaxpr))
    assert not copies, copies
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3


def test_weight_gradient_takes_partial_column_tiles_where_divisors_are_small():
    """By default the weights' kernel overhangs the output with its column tile
    where the largest tile dividing `N` is under half of it (`N` = 640 = 5 x 128,
    tile 512: 2 column tiles, not 5 of 128), and keeps dividing tiles otherwise;
    the values are the same."""
    sizes = jnp.array([120, 0, 80], jnp.int32)
    lhs = jr.normal(jr.key(6), (M, K))
    d = jr.normal(jr.key(7), (M, 640))

    def run(partial, tn=512):
        fn = lambda a, b: grouped_weight_gradient(
            a, b, sizes, tiles=(64, 64, tn), partial_columns=partial, interpret=True
        )
        return fn(lhs, d), str(jax.make_jaxpr(fn)(lhs, d))

    (got, auto), (want, dividing) = run(None), run(False)
    assert "grid=(1, 2," in auto and "grid=(1, 5," in dividing
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)
    # A dividing tile at least half the asked one is kept: 640 columns, tile 256
    # asked, 128 divides (half of 256).
    assert "grid=(1, 5," in run(None, 256)[1]


def test_bfloat16_and_rows_not_a_multiple_of_the_tile():
    sizes = jnp.array([5, 0, 60, 2, 30, 0], jnp.int32)
    lhs = jr.normal(jr.key(2), (99, K), jnp.bfloat16)
    rhs = jr.normal(jr.key(3), (G, K, N), jnp.bfloat16)
    out = grouped_matmul(lhs, rhs, sizes, tiles=(32, 64, 128), chunk=16, interpret=True)
    assert out.shape == (99, N) and out.dtype == jnp.bfloat16
    want = _reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, False)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want), atol=0.1, rtol=2e-2
    )
    grad = grouped_weight_gradient(
        lhs,
        out,
        sizes,
        tiles=(32, 64, 128),
        chunk=16,
        out_dtype=jnp.float32,
        interpret=True,
    )
    assert grad.dtype == jnp.float32
    f32 = (lhs.astype(jnp.float32), out.astype(jnp.float32))
    want = jnp.stack(
        [
            f32[0][int(a) : int(b)].T @ f32[1][int(a) : int(b)]
            for a, b in zip(
                np.concatenate([[0], np.cumsum(sizes)[:-1]]),
                np.cumsum(sizes),
                strict=True,
            )
        ]
    )
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), atol=0.5, rtol=2e-2)


@pytest.mark.lowering_only
@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
@pytest.mark.parametrize("chunk", [128, None])
def test_lowers_for_tpu_at_a_model_shape(transpose, chunk):
    """Mosaic's lowering (run here, on the CPU) accepts the kernel at the
    Qwen3-30B-A3B-like up projection (65536 rows, 128 groups, 2048 -> 1536)."""
    m, k, n, g = 65536, 2048, 1536, 128
    lhs = jax.ShapeDtypeStruct((m, n if transpose else k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

    def run(a, b, s):
        return grouped_matmul(
            a, b, s, tiles=(512, 4096, 768), chunk=chunk, transpose_rhs=transpose
        )

    text = (
        jax.jit(run).trace(lhs, rhs, sizes).lower(lowering_platforms=("tpu",)).as_text()
    )
    assert text.count("tpu_custom_call") == 1


@pytest.mark.lowering_only
def test_weight_gradient_with_overhanging_tiles_lowers_for_tpu():
    """Mosaic's lowering accepts the weights' kernel at the DeepSeek-V2-Lite-like
    gate+up (49152 rows, 64 groups, 2048 x 2816: the default overhangs 768-column
    tiles over the 2816 columns, 4 column tiles instead of 11 dividing ones)."""
    m, k, n, g = 49152, 2048, 2816, 64
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    d = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    traced = jax.jit(grouped_weight_gradient).trace(lhs, d, sizes)
    assert "grid=(1, 4," in str(traced.jaxpr)
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


@pytest.mark.lowering_only
@pytest.mark.parametrize("write_behind", [True, False], ids=["own copies", "pipeline"])
def test_weight_gradient_lowers_for_tpu_both_writes(write_behind):
    """Mosaic's lowering accepts the weights' kernel at the Qwen3-like down
    projection (65536 rows, 128 groups, 768 x 2048, dividing column tiles), its
    output copied by its own DMAs (`write_behind`, the default) or by the
    pipeline."""
    m, k, n, g = 65536, 768, 2048, 128
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    d = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

    def run(a, b, s):
        return grouped_weight_gradient(a, b, s, write_behind=write_behind)

    traced = jax.jit(run).trace(lhs, d, sizes)
    assert ("dma_start" in str(traced.jaxpr)) == write_behind
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


def test_products_have_the_derivatives_of_ragged_dot():
    """The three products on these kernels (`_GroupedProducts`) through
    `moe_eqx._gmm._products.gmm`: the value, both reverse-mode derivatives, forward
    mode and a second derivative equal `me.RaggedDotGMM`'s."""
    import moe_eqx as me
    from moe_eqx._gmm._products import gmm
    from moe_eqx._gmm.grouped_tpu import _GroupedProducts

    products = _GroupedProducts(
        tiles=(64, 32, 128), tgmm_tiles=(64, 32, 128), chunk=16, interpret=True
    )
    sizes = jnp.array(LAYOUTS["rows past the sum"], jnp.int32)
    lhs = jr.normal(jr.key(6), (M, K))
    rhs = jr.normal(jr.key(7), (G, K, N))
    cot = jr.normal(jr.key(8), (M, N))

    def ours(a, b):
        return gmm(products, a, b, sizes)

    def ref(a, b):
        return me.RaggedDotGMM()(a, b, sizes)

    def close(x, y):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-3, rtol=1e-4)

    close(ours(lhs, rhs), ref(lhs, rhs))
    got = jax.jit(jax.grad(lambda a, b: jnp.sum(ours(a, b) * cot), (0, 1)))(lhs, rhs)
    want = jax.grad(lambda a, b: jnp.sum(ref(a, b) * cot), (0, 1))(lhs, rhs)
    for x, y in zip(got, want, strict=True):
        close(x, y)
    tangents = (jr.normal(jr.key(9), lhs.shape), jr.normal(jr.key(10), rhs.shape))
    close(jax.jvp(ours, (lhs, rhs), tangents)[1], jax.jvp(ref, (lhs, rhs), tangents)[1])

    # A second derivative: the weights' gradient of a loss of the input's gradient
    # (relative to its largest entry: float32 sums of another order).
    def inner(fn):
        return lambda a, b: jnp.sum(
            jax.grad(lambda a: jnp.sum(jnp.tanh(fn(a, b) / 8)))(a) ** 2
        )

    got = jax.jit(jax.grad(inner(ours), 1))(lhs, rhs)
    want = jax.grad(inner(ref), 1)(lhs, rhs)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * scale)


def test_tiles_shrink_to_the_vmem_a_call_may_ask_for(monkeypatch):
    """Tiles whose double-buffered blocks need more scoped VMEM than a call may ask
    for are made smaller (the largest first), each still dividing its axis; tiles
    that fit are kept; the products stay exact at the smaller tiles."""
    from moe_eqx._gmm import grouped_tpu as gt

    def blocks_of(dtype):
        def blocks(tm, tk, tn):
            return [((tm, tk), dtype), ((tk, tn), dtype), ((tm, tn), dtype)] + [
                ((tm, tn), jnp.float32)
            ]

        return blocks

    # The Qwen3-like up projection at the default tiles fits as it is.
    bf16 = blocks_of(jnp.bfloat16)
    fitted = gt._fit(gt.GMM_TILES, gt.CHUNK, 65536, 2048, 1536, jnp.bfloat16, bf16)
    assert fitted[:4] == (512, 2048, 1536, 128)
    # float32 at tiles far past the cap: made to fit, each tile dividing its axis.
    f32 = blocks_of(jnp.float32)
    tm, tk, tn, ch, _ = gt._fit(
        (2048, 8192, 8192), 256, 65536, 8192, 7168, jnp.float32, f32
    )
    assert gt._vmem_need(f32(tm, tk, tn)) <= gt._VMEM_CAP
    assert 8192 % tk == 0 and 7168 % tn == 0 and tm % 8 == 0 and tm % ch == 0
    assert min(tm, tk, tn) >= 512, (tm, tk, tn)  # the largest cut first

    # Values at tiles shrunk by a small cap (here: both kernels, every axis cut).
    monkeypatch.setattr(gt, "_VMEM_CAP", 10 << 20)
    fitted = gt._fit((256, 512, 1024), None, M, 512, 1024, jnp.float32, f32)
    assert fitted[1:3] == (256, 256), fitted  # (and the rows, 200, in one tile)
    sizes = jnp.array([40, 0, 90, 7, 50, 13], jnp.int32)
    lhs = jr.normal(jr.key(7), (M, 512))
    rhs = jr.normal(jr.key(8), (G, 512, 1024))
    out = grouped_matmul(lhs, rhs, sizes, tiles=(256, 512, 1024), interpret=True)
    want = _reference(lhs, rhs, sizes, False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-3, rtol=0)
    d = jr.normal(jr.key(9), (M, 1024))
    grad = grouped_weight_gradient(
        lhs, d, sizes, tiles=(256, 512, 1024), interpret=True
    )
    ends = np.cumsum(np.asarray(sizes))
    for e, (a, b) in enumerate(zip(ends - np.asarray(sizes), ends, strict=True)):
        np.testing.assert_allclose(
            np.asarray(grad[e]),
            np.asarray(lhs[a:b].T @ d[a:b]),
            atol=1e-3 * max(1, b - a),
            rtol=0,
        )


# The weights' kernel's own copies of each group's result (`write_behind`) under
# Pallas' TPU interpreter, its DMAs and semaphores modelled (a wait for a copy
# never started does not return), and race detection on.
_TPU_INTERPRET = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    ("tiles", "n", "dtype"),
    [((64, 4096, 128), 384, "float32"), ((64, 32, 256), 640, "bfloat16")],
    ids=["3 column tiles", "overhanging column tile, 2 row tiles of out"],
)
def test_weight_gradient_writes_behind(layout, tiles, n, dtype):
    """`write_behind` (the default): each group's result copied to the output by
    the kernel's own DMA, two staging buffers in turn. Every layout, edges first
    (no rows, empty groups first, between and last, one group), several column
    tiles and output row tiles, the last column tile overhanging `N` (its copies
    narrower), both output dtypes: the values the pipeline's own write gives, and
    the reference's; rows past the groups NaN."""
    sizes = jnp.array(LAYOUTS[layout], jnp.int32)
    total = int(jnp.sum(sizes))
    lhs = jr.normal(jr.key(13), (M, K)).at[total:].set(jnp.nan)
    d = jr.normal(jr.key(14), (M, n)).at[total:].set(jnp.nan)
    kw = dict(tiles=tiles, chunk=16, out_dtype=jnp.dtype(dtype), partial_columns=True)
    behind = grouped_weight_gradient(
        lhs, d, sizes, write_behind=True, interpret=_TPU_INTERPRET, **kw
    )
    piped = grouped_weight_gradient(
        lhs, d, sizes, write_behind=False, interpret=True, **kw
    )
    np.testing.assert_array_equal(
        np.asarray(behind, np.float32), np.asarray(piped, np.float32)
    )
    ends = np.cumsum(np.asarray(sizes))
    for e, (a, b) in enumerate(zip(ends - np.asarray(sizes), ends, strict=True)):
        np.testing.assert_allclose(
            np.asarray(behind[e], np.float32),
            np.asarray(lhs[a:b].T @ d[a:b]),
            atol=(1e-3 if dtype == "float32" else 3e-2) * max(1, b - a),
            rtol=1e-2 if dtype == "bfloat16" else 0,
        )


def test_weight_gradient_write_behind_copies_each_group_once():
    """The kernel with `write_behind` starts one copy per group and column tile
    and waits for each (two staging buffers: each wait before its buffer is
    refilled, the last two at the sweep's end); without it, none. Counted from the
    kernel's program: two branches (the overhanging tile's width and the others')
    for each start and each wait, and the pipeline's output block replaced by the
    output in HBM."""
    sizes = jnp.array(LAYOUTS["even"], jnp.int32)
    lhs, d = jr.normal(jr.key(15), (M, K)), jr.normal(jr.key(16), (M, 384))

    def kernel_text(behind):
        fn = lambda a, b: grouped_weight_gradient(  # noqa: E731
            a,
            b,
            sizes,
            tiles=(64, 4096, 256),
            partial_columns=True,
            write_behind=behind,
            interpret=True,
        )
        return str(jax.make_jaxpr(fn)(lhs, d))

    text, piped = kernel_text(True), kernel_text(False)
    # one start per width; a wait per width before refilling, and two at the end
    assert (text.count("dma_start"), text.count("dma_wait")) == (2, 6)
    assert "dma_start" not in piped and "dma_wait" not in piped
