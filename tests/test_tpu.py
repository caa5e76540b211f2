"""The layer on a TPU chip against the dense oracle (`reference_moe`), run by
`benchmarks/tpu_check.sh`; skipped where there is no TPU.

Float32 at `jax.default_matmul_precision("highest")` (the suite's setting) is compared
tightly, bfloat16 loosely; one device and a one-chip mesh, capped and with the
fallback taken, outputs and gradients (input, router, experts), every quantized
format against its dequantized layer (the decode kernel at few tokens, the
library's own grouped kernels at many), the gated activation's backward kernel, the
hash router, routing replay, and `jax.jit` with the layer closed over (the call that
once aborted the TPU compiler).
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import every_code_weight, kernel_operand_sources

import moe_eqx as me


def _has_tpu() -> bool:
    try:
        return bool(jax.devices("tpu"))
    except RuntimeError:
        return False


pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(not _has_tpu(), reason="needs a TPU"),
]


def _layer(dtype=jnp.float32, **overrides):
    cfg = me.MoEConfig(d_model=256, d_ff=128, num_experts=16, top_k=4, **overrides)
    layer = me.MoELayer(cfg, key=jr.key(0))
    return jax.tree.map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, layer
    )


def _mesh():
    return jax.make_mesh((1,), ("expert",), devices=jax.devices("tpu")[:1])


def _loss(y):
    c = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y.astype(jnp.float32) * c)


def _value_and_grads(fn, layer, x):
    def loss(args):
        return _loss(fn(*args))

    return eqx.filter_jit(eqx.filter_value_and_grad(loss))((layer, x))


def _close(a, b, tol):
    a, b = (np.asarray(jnp.asarray(t, jnp.float32)) for t in (a, b))
    scale = max(float(np.max(np.abs(b))), 1e-6)
    assert np.max(np.abs(a - b)) <= tol * scale, (np.max(np.abs(a - b)), scale)


def _check_against_oracle(layer, x, mesh, tol, experts=None):
    def run(layer, x):
        y, stats = layer(x, mesh=mesh, experts=experts)
        return y, stats

    y, stats = eqx.filter_jit(run)(layer, x)
    stats.check()
    assert int(stats.lost_pairs) == 0
    y_ref = eqx.filter_jit(lambda l, x: me.reference_moe(l, x, experts=experts))(
        layer, x
    )
    _close(y, y_ref, tol)
    v, (g_layer, g_x) = _value_and_grads(lambda l, x: run(l, x)[0], layer, x)
    v_ref, (r_layer, r_x) = _value_and_grads(
        lambda l, x: me.reference_moe(l, x, experts=experts), layer, x
    )
    _close(g_x, r_x, tol)
    weight = lambda l: getattr(l.router, "scorer", l.router).weight  # noqa: E731
    _close(weight(g_layer), weight(r_layer), tol)
    _close(g_layer.experts.w_gate_up, r_layer.experts.w_gate_up, tol)
    _close(g_layer.experts.w_down, r_layer.experts.w_down, tol)
    return stats


@pytest.mark.parametrize("where", ["one device", "one-chip mesh"])
@pytest.mark.parametrize("buffer_factor", [2.0, 0.6], ids=["capped", "fallback"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_matches_oracle(where, buffer_factor, dtype):
    if where == "one device" and buffer_factor != 2.0:
        pytest.skip("the fallback is a mesh path")
    dt = jnp.dtype(dtype)
    layer = _layer(dt, buffer_factor=buffer_factor)
    x = jr.normal(jr.key(1), (512, 256), dt)
    mesh = _mesh() if where == "one-chip mesh" else None
    tol = 1e-5 if dt == jnp.float32 else 4e-2
    stats = _check_against_oracle(layer, x, mesh, tol)
    if mesh is not None:
        assert bool(stats.fallback_used) == (buffer_factor < 1.0)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 8, 512])
@pytest.mark.parametrize("where", ["one device", "one-chip mesh"])
def test_quantized_matches_dequantized(fmt, tokens, where):
    layer = me.quantize_experts(_layer(jnp.bfloat16), fmt)
    floats = me.dequantize_experts(layer)
    x = jr.normal(jr.key(2), (tokens, 256), jnp.bfloat16)
    mesh = _mesh() if where == "one-chip mesh" else None

    def run(layer, x):
        return layer(x, mesh=mesh)[0]

    y = jax.jit(lambda x: run(layer, x))(x)  # closed over, as a server would
    y_ref = jax.jit(lambda x: run(floats, x))(x)
    _close(y, y_ref, 2e-2)
    # The input's gradient through the quantized experts (constants).
    g = jax.jit(jax.grad(lambda x: _loss(run(layer, x))))(x)
    g_ref = jax.jit(jax.grad(lambda x: _loss(run(floats, x))))(x)
    _close(g, g_ref, 3e-2)


@pytest.mark.parametrize("tokens", [1, 512])
def test_mxfp4_as_arguments_matches_dequantized(tokens):
    """MXFP4 experts as the call's arguments (the down projection's bytes, 64 a
    row, arrive in the chip's layout with `N` minor-most and are read as they lie,
    transposed): the same output and input gradient as the dequantized layer."""
    from moe_eqx._gmm.quantized_tpu import stores_transposed

    layer = me.quantize_experts(_layer(jnp.bfloat16), "mxfp4")
    values = layer.experts.w_down.values
    assert stores_transposed(values.shape, values.dtype), values.shape
    floats = me.dequantize_experts(layer)
    x = jr.normal(jr.key(2), (tokens, 256), jnp.bfloat16)
    y = eqx.filter_jit(lambda l, x: l(x)[0])(layer, x)
    _close(y, floats(x)[0], 2e-2)
    g = eqx.filter_jit(jax.grad(lambda x, l: _loss(l(x)[0])))(x, layer)
    _close(g, jax.grad(lambda x: _loss(floats(x)[0]))(x), 3e-2)


@pytest.mark.parametrize("tokens", [1, 8, 4096])
def test_mxfp4_arguments_are_not_copied(tokens):
    """A DeepSeek-V2-Lite-like MXFP4 layer compiled with its arrays as arguments:
    the kernels read both projections' stored bytes as the call's arguments lie,
    the down projection's (`[64, 2048, 704]`, which the chip lays out with `N`
    minor-most) through a bitcast of its transposed view, the up projection's
    (`K / 2 = 1024`, row-major) as they are: no copy of them precedes a kernel.
    (Their scale bytes, a sixteenth of the size, are still copied into the
    kernels' layout: docs/measured.md, "TPU".)"""
    cfg = me.MoEConfig(d_model=2048, d_ff=1408, num_experts=64, top_k=6)

    def build():
        layer = me.MoELayer(cfg, key=jr.key(0))
        layer = jax.tree.map(
            lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, layer
        )
        return me.quantize_experts(layer, "mxfp4")

    shapes = eqx.filter_eval_shape(build)
    params, static = eqx.partition(
        shapes, lambda a: isinstance(a, jax.ShapeDtypeStruct)
    )
    x = jax.ShapeDtypeStruct((tokens, 2048), jnp.bfloat16)

    def run(params, x):
        return eqx.combine(params, static)(x)[0]

    text = jax.jit(run).lower(params, x).compile().as_text()
    down = kernel_operand_sources(text, r"s8\[64,(?:704,2048|2048,704)\]")
    up = kernel_operand_sources(text, r"s8\[64,(?:2816,1024|1024,2816)\]")
    assert down and up, "no kernel reads the stored bytes"
    assert set(down) | set(up) == {"parameter"}, (down, up)


@pytest.mark.parametrize(
    ("fmt", "k", "n"),
    [
        (None, 2048, 2816),
        ("int8", 2048, 2816),
        ("float8_e4m3fn", 2048, 2816),
        ("mxfp4", 2048, 2816),
        # Row-major MXFP4 whose scale bytes are row-major too (`K / 32 = 128`):
        # their words in place, where at `K = 2048` they are copied first.
        ("mxfp4", 4096, 128),
    ],
)
def test_decode_kernel_matches_ragged_dot(fmt, k, n):
    """The Pallas decode kernel at a DeepSeek-V2-Lite-like expert shape on the chip,
    float32 activations at highest precision: equal to dequantizing first."""
    from moe_eqx._gmm.pallas_tpu import decode_gmm
    from moe_eqx.internal import quantize

    g, m = 64, 48
    rhs = jr.normal(jr.key(3), (g, k, n), jnp.float32) * 0.05
    if fmt is not None:
        rhs = quantize(rhs, fmt)
    lhs = jr.normal(jr.key(4), (m, k), jnp.float32)
    sizes = (
        jnp.zeros((g,), jnp.int32)
        .at[jnp.array([1, 5, 9, 63])]
        .set(jnp.array([20, 1, 17, 10]))
    )
    if fmt == "mxfp4":  # row-major on the word kernel
        from moe_eqx._gmm.pallas_tpu import _weight_operands

        tn = 128 if n == 128 else 256
        assert _weight_operands(rhs, k, n, tn, sizes[:1])[0] == "mxfp4_words"
    dense = rhs if fmt is None else rhs.dequantize(jnp.float32)
    ref = jax.jit(me.RaggedDotGMM())(lhs, dense, sizes)
    out = jax.jit(decode_gmm)(lhs, rhs, sizes)
    _close(out, ref, 1e-5)


# (fmt, k, n, block, path): MXFP4 transposed (`K / 2 = 704`, laid out with `N`
# minor-most) on the word kernel, and off it (`K = 1440`: not whole words of
# eight), and row-major on the word kernel and off it (half a step's columns not
# whole lanes).
_EVERY_CODE = [
    ("int8", 512, 256, 128, "int8"),
    ("float8_e4m3fn", 512, 256, 128, "fp8_blocks"),
    ("mxfp4", 1408, 256, 128, "mxfp4_kn_words"),
    ("mxfp4", 512, 512, 256, "mxfp4_words"),
    ("mxfp4", 512, 256, 128, "mxfp4"),
    ("mxfp4", 1440, 256, 128, "mxfp4_kn"),
]


@pytest.mark.parametrize(("fmt", "k", "n", "block", "path"), _EVERY_CODE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernel_dequantizes_every_code_exactly(fmt, k, n, block, path, dtype):
    """Every stored byte through the compiled kernel (rows of the identity times
    its tile) equals `QuantizedArray.dequantize` on the chip: FP8's subnormal codes
    are built without a float32 subnormal (which the chip would flush to zero);
    MXFP4's bfloat16 bits built as whole words (read transposed) too."""
    from moe_eqx._gmm.pallas_tpu import _weight_operands, decode_gmm

    dt = jnp.dtype(dtype)
    w = every_code_weight(fmt, k, n, jr.key(11))
    assert _weight_operands(w, k, n, block, jnp.zeros((1,), jnp.int32))[0] == path
    want = np.asarray(jax.jit(lambda w: w.dequantize(dt))(w)[0], np.float32)
    sizes = jnp.array([k], jnp.int32)
    fn = jax.jit(ft.partial(decode_gmm, block_n=block))  # several steps
    got = np.asarray(fn(jnp.eye(k, dtype=dt), w, sizes), np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    mask = ~np.isnan(want)
    np.testing.assert_array_equal(got[mask], want[mask])


def test_hash_router_and_replay():
    layer = _layer(jnp.float32)
    table = jr.randint(jr.key(5), (100, 4), 0, 16)
    table = (table[:, :1] + jnp.arange(4)[None, :]) % 16  # distinct per token
    hashed = eqx.tree_at(
        lambda l: l.router, layer, me.HashRouter(scorer=layer.router, tid2eid=table)
    )
    x = jr.normal(jr.key(6), (256, 256), jnp.float32)
    ids = hashed.router.experts_for(jr.randint(jr.key(7), (256,), 0, 100))
    for mesh in (None, _mesh()):
        _check_against_oracle(hashed, x, mesh, 1e-5, experts=ids)
        _check_against_oracle(layer, x, mesh, 1e-5, experts=ids)  # replay


def test_jit_with_the_layer_closed_over():
    """The call that once aborted the TPU compiler (a scatter whose indices and
    updates were one constant), forward and gradient, bfloat16."""
    layer = _layer(jnp.bfloat16)
    x = jr.normal(jr.key(8), (1024, 256), jnp.bfloat16)
    y = jax.jit(lambda x: layer(x)[0])(x)
    g = jax.jit(jax.grad(lambda x: _loss(layer(x)[0])))(x)
    y_ref = jax.jit(lambda x: me.reference_moe(layer, x))(x)
    _close(y, y_ref, 4e-2)
    assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))


@pytest.mark.parametrize(
    "act",
    [
        me.SwiGLU(),
        me.SwiGLU(limit=7.0, limit_after=True),
        me.GeGLU(approximate=True),
        me.ClampedSwiGLU(limit=7.0),
        me.SoftcapSwiGLU(gate_cap=10.0, up_cap=20.0),
    ],
    ids=repr,
)
@pytest.mark.parametrize("d_ff", [768, 1408])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_activation_backward_matches_jax(act, d_ff, dtype):
    """The gated activation's backward kernel (`moe_eqx._gmm.activation_tpu`, which
    `auto` takes between its many-row products) compiled for the chip, against
    JAX's own vjp of the whole activation: 1000 rows (a partial last step)."""
    from moe_eqx._gmm.activation_tpu import gated_vjp

    dt = jnp.dtype(dtype)
    h = (4 * jr.normal(jr.key(9), (1000, 2 * d_ff))).astype(dt)
    ct = jr.normal(jr.key(10), (1000, d_ff)).astype(dt)
    got = jax.jit(lambda h, ct: gated_vjp(act, h, ct))(h, ct)

    def formula(h, ct):  # JAX's own vjp of the whole activation
        return act.vjp(h.astype(jnp.float32), ct).astype(dt)

    _close(got, jax.jit(formula)(h, ct), 1e-2 if dt == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("skew", ["balanced", "skewed"])
def test_megablox_matches_ragged_dot(dtype, skew):
    """`me.MegabloxGMM` compiled on the chip at its tuned Qwen3-like tiles' shape
    (and a row count that needs padding): values and both derivatives against
    `lax.ragged_dot`; rows past the groups zero."""
    dt = jnp.dtype(dtype)
    g, k, n, m = 128, 2048, 1536, 4000
    if skew == "balanced":
        sizes = jnp.full((g,), 30, jnp.int32)
    else:
        sizes = (
            jnp.zeros((g,), jnp.int32)
            .at[jnp.array([0, 7, 127])]
            .set(jnp.array([3000, 1, 839]))
        )
    lhs = jr.normal(jr.key(1), (m, k), dt)
    rhs = (jr.normal(jr.key(2), (g, k, n), jnp.float32) * 0.05).astype(dt)
    cot = jr.normal(jr.key(3), (m, n), dt)

    def grads(backend):
        def loss(a, b):
            return jnp.sum((backend(a, b, sizes) * cot).astype(jnp.float32))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs)

    out = jax.jit(me.MegabloxGMM())(lhs, rhs, sizes)
    ref = jax.jit(me.RaggedDotGMM())(lhs, rhs, sizes)
    tol = 1e-5 if dt == jnp.float32 else 2e-2
    _close(out, ref, tol)
    assert not np.any(np.asarray(out[int(sizes.sum()) :], np.float32))
    (_, (da, db)), (_, (ra, rb)) = grads(me.MegabloxGMM()), grads(me.RaggedDotGMM())
    _close(da, ra, tol)
    _close(db, rb, tol)


_OWN_CASES = pytest.mark.parametrize(
    ("chunk", "overhang"),
    [(128, False), (None, False), (128, True)],
    ids=["chunks", "whole tiles", "chunks, overhanging rows"],
)


@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
@_OWN_CASES
def test_own_grouped_matmul_matches_ragged_dot(transpose, chunk, overhang):
    """The library's own many-row kernel compiled on the chip at a Qwen3-like
    shape's tiles, skewed groups and rows past them: against `lax.ragged_dot` in
    float32 on the same bfloat16 values; rows past the groups zero. With
    `overhang_rows`, the last row tile overhangs the 4000 rows (not a multiple of
    512) instead of padding them."""
    from moe_eqx._gmm.grouped_tpu import grouped_matmul

    g, k, n, m = 128, 2048, 1536, 4000
    sizes = (
        jnp.zeros((g,), jnp.int32)
        .at[jnp.array([0, 7, 127])]
        .set(jnp.array([2900, 1, 839]))
    )
    lhs = jr.normal(jr.key(1), (m, n if transpose else k), jnp.bfloat16)
    rhs = (jr.normal(jr.key(2), (g, k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
    run = ft.partial(
        grouped_matmul,
        tiles=(512, 4096, 768),
        chunk=chunk,
        transpose_rhs=transpose,
        overhang_rows=overhang,
    )
    out = jax.jit(run)(lhs, rhs, sizes)
    dense = jnp.swapaxes(rhs, 1, 2) if transpose else rhs
    ref = jax.jit(
        lambda a, b: jax.lax.ragged_dot(
            a.astype(jnp.float32),
            b.astype(jnp.float32),
            sizes,
            precision=jax.lax.Precision.HIGHEST,
        )
    )(lhs, dense)
    total = int(jnp.sum(sizes))
    _close(out[:total], ref[:total], 2e-2)
    assert not np.any(np.asarray(out[total:], np.float32))


@_OWN_CASES
@pytest.mark.parametrize("mode", ["", "pipeline write", "overhanging columns"])
def test_own_weight_gradient_matches_ragged_dot(chunk, overhang, mode):
    """The library's own weights'-gradient kernel compiled on the chip, skewed and
    empty groups, against `lax.ragged_dot`'s transpose in float32 (with
    `overhang_rows`, the rows past the last whole tile read by an overhanging one;
    `pipeline write`, the output written by the pipeline instead of the kernel's
    own copies (`write_behind`); `overhanging columns`, 640-column tiles over
    1536, the last tile's copies 256 wide)."""
    from moe_eqx._gmm.grouped_tpu import grouped_weight_gradient

    g, k, n, m = 128, 2048, 1536, 4000
    sizes = (
        jnp.zeros((g,), jnp.int32)
        .at[jnp.array([0, 7, 127])]
        .set(jnp.array([2900, 1, 839]))
    )
    lhs = jr.normal(jr.key(3), (m, k), jnp.bfloat16)
    d = jr.normal(jr.key(4), (m, n), jnp.bfloat16)
    run = ft.partial(
        grouped_weight_gradient,
        tiles=(256, 2048, 640 if mode == "overhanging columns" else 512),
        chunk=chunk,
        out_dtype=jnp.float32,
        partial_columns=mode == "overhanging columns",
        overhang_rows=overhang,
        write_behind=mode != "pipeline write",
    )
    out = jax.jit(run)(lhs, d, sizes)

    def product(w):
        return jax.lax.ragged_dot(
            lhs.astype(jnp.float32), w, sizes, precision=jax.lax.Precision.HIGHEST
        )

    w0 = jnp.zeros((g, k, n), jnp.float32)
    _, vjp = jax.vjp(product, w0)
    (ref,) = jax.jit(vjp)(d.astype(jnp.float32))
    _close(out, ref, 2e-2)


@pytest.mark.parametrize("transpose", [False, True], ids=["gmm", "gmm_t"])
@pytest.mark.parametrize(("k", "n"), [(2048, 2816), (1408, 2048)], ids=["up", "down"])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4"])
def test_own_grouped_matmul_reads_quantized_weights(fmt, k, n, transpose):
    """The many-row kernel on quantized weights (each visit's tile dequantized in
    VMEM) compiled on the chip at DeepSeek-V2-Lite-like expert shapes (the down
    projection's MXFP4 bytes 704 a row, not a multiple of 128 lanes, which the
    chip lays out transposed), skewed groups (one over several row tiles) and rows
    past them, the forward and the input's gradient's product: the same values as
    the kernel on the weights dequantized first, bfloat16."""
    from moe_eqx._gmm.grouped_tpu import grouped_matmul
    from moe_eqx.internal import quantize

    run = jax.jit(ft.partial(grouped_matmul, transpose_rhs=transpose))

    g, m = 64, 4000
    sizes = (
        jnp.zeros((g,), jnp.int32)
        .at[jnp.array([0, 7, 63])]
        .set(jnp.array([2900, 1, 839]))
    )
    w = quantize(jr.normal(jr.key(2), (g, k, n), jnp.float32) * 0.05, fmt)
    lhs = jr.normal(jr.key(1), (m, n if transpose else k), jnp.bfloat16)
    out = run(lhs, w, sizes)
    dense = jax.jit(lambda w: w.dequantize(jnp.bfloat16))(w)
    ref = run(lhs, dense, sizes)
    total = int(jnp.sum(sizes))
    _close(out[:total], ref[:total], 1e-2)
    assert not np.any(np.asarray(out[total:], np.float32))


@pytest.mark.parametrize("k", [512, 448])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_own_grouped_matmul_dequantizes_every_code_exactly(fmt, dtype, k):
    """Every stored byte through the compiled many-row kernel (rows of the identity
    times its tile, two row tiles and two column tiles; `K = 448`: MXFP4 rows of
    224 bytes, FP8's last block of 64 rows) equals `QuantizedArray.dequantize` on
    the chip."""
    from moe_eqx._gmm.grouped_tpu import grouped_matmul

    dt = jnp.dtype(dtype)
    n = 256
    w = every_code_weight(fmt, k, n, jr.key(11))
    want = np.asarray(jax.jit(lambda w: w.dequantize(dt))(w)[0], np.float32)
    sizes = jnp.array([k], jnp.int32)
    fn = jax.jit(ft.partial(grouped_matmul, tiles=(256, k, 128)))
    got = np.asarray(fn(jnp.eye(k, dtype=dt), w, sizes), np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    mask = ~np.isnan(want)
    np.testing.assert_array_equal(got[mask], want[mask])
