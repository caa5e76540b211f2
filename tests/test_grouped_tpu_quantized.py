"""Quantized experts on the library's own many-row TPU kernel (`grouped_matmul` with a
`QuantizedArray`, which `me.PallasTPUGMM` takes for prefill): each visit's weight
tile dequantized in VMEM, once per group and column tile, in Pallas' interpreter on
the CPU against the same kernel on the weights dequantized first; every stored byte
through the kernel; the layer; and Mosaic's lowering at a model shape, with no float
copy of the experts. `tests/test_tpu.py` runs them compiled."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import compile_as_users, every_code_weight

import moe_eqx as me
from moe_eqx._activation import SWIGLU
from moe_eqx._gmm.grouped_tpu import grouped_matmul
from moe_eqx._gmm.pallas_tpu import PallasTPUGMM, _TrainingProducts
from moe_eqx.internal import quantize

K, M = 256, 200
# An empty group first, one over several row tiles, rows past the groups' sum.
SIZES = [0, 120, 30, 0]

# (format, columns, parts): FP8 also in two parts whose width is not whole blocks.
FORMATS = {
    "int8": ("int8", 256, 1),
    "fp8": ("float8_e4m3fn", 256, 1),
    "fp8-parts": ("float8_e4m3fn", 384, 2),
    "mxfp4": ("mxfp4", 256, 1),
}


def _parts(w, fmt, parts):
    """`w` quantized in `parts` column blocks side by side, each blocked from its
    own first column (a gate and an up projection)."""
    pieces = [quantize(p, fmt) for p in jnp.split(w, parts, axis=-1)]
    values = jnp.concatenate([p.values for p in pieces], -1)
    scales = jnp.concatenate([p.scales for p in pieces], -1)
    return me.QuantizedArray(values, scales, fmt, jnp.float32, parts)


def _raw(n, groups=None, seed=1):
    groups = len(SIZES) if groups is None else groups
    w = jr.normal(jr.key(seed), (groups, K, n))
    return w * jnp.exp2(jr.randint(jr.key(seed + 1), (groups, 1, n), -3, 3))


def _both(lhs, w, sizes, dt, **kw):
    ours = grouped_matmul(lhs, w, sizes, interpret=True, **kw)
    first = grouped_matmul(lhs, w.dequantize(dt), sizes, interpret=True, **kw)
    return np.asarray(ours, np.float32), np.asarray(first, np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("case", "tk"),
    [("int8", K), ("int8", 128), ("fp8", K), ("fp8", 128), ("fp8-parts", K)]
    + [("mxfp4", K)],
)
def test_equals_dequantizing_first(case, tk, dtype):
    """Skewed groups (an empty one first, one over several row tiles, rows past
    the sum holding NaN), two or three column tiles, the contraction whole or in
    tiles: exactly the values of the kernel on the weights dequantized first."""
    fmt, n, parts = FORMATS[case]
    dt = jnp.dtype(dtype)
    w = _parts(_raw(n), fmt, parts)
    sizes = jnp.array(SIZES, jnp.int32)
    lhs = jr.normal(jr.key(0), (M, K), dt).at[sum(SIZES) :].set(jnp.nan)
    ours, first = _both(lhs, w, sizes, dt, tiles=(32, tk, 128), chunk=16)
    assert not np.isnan(first[: sum(SIZES)]).any()
    assert not np.any(ours[sum(SIZES) :]), "rows past the groups"
    np.testing.assert_array_equal(ours, first)


@pytest.mark.parametrize(("k", "dtype"), [(448, "float32"), (704, "bfloat16")])
def test_mxfp4_transposed_equals_dequantizing_first(k, dtype, mxfp4_transposed):
    """MXFP4 bytes read in their transposed orientation (`[G, K / 2, N]`, as a TPU
    lays out `K / 2 = 704`; dequantized 256 rows at a time, the last piece short
    where `K / 2` is not a multiple of 128): exactly the kernel on the weights
    dequantized first, groups as above."""
    dt = jnp.dtype(dtype)
    w = jr.normal(jr.key(1), (len(SIZES), k, 256))
    w = quantize(
        w * jnp.exp2(jr.randint(jr.key(2), (len(SIZES), k, 1), -3, 3)), "mxfp4"
    )
    sizes = jnp.array(SIZES, jnp.int32)
    lhs = jr.normal(jr.key(0), (M, k), dt).at[sum(SIZES) :].set(jnp.nan)
    ours, first = _both(lhs, w, sizes, dt, tiles=(32, k, 128), chunk=16)
    assert mxfp4_transposed == [w.values.shape]
    assert not np.isnan(first[: sum(SIZES)]).any()
    assert not np.any(ours[sum(SIZES) :]), "rows past the groups"
    np.testing.assert_array_equal(ours, first)


def test_one_group_dequantizes_each_column_tile():
    """One group whose rows fill every visit: the tile held from the first column
    tile must not be taken for the second (each column tile's first visit
    dequantizes its own)."""
    w = _parts(_raw(256, groups=1), "int8", 1)
    lhs = jr.normal(jr.key(0), (64, K))
    sizes = jnp.array([64], jnp.int32)
    ours, first = _both(lhs, w, sizes, jnp.float32, tiles=(32, K, 128), chunk=None)
    np.testing.assert_array_equal(ours, first)


@pytest.mark.parametrize(
    ("fmt", "n", "parts"),
    [FORMATS[c] for c in FORMATS] + [("mxfp4-kn", 256, 1)],
    ids=[*FORMATS, "mxfp4-kn"],
)
def test_every_code_dequantizes_exactly(fmt, n, parts, request):
    """Rows of the identity times the kernel's dequantized tile give the tile back:
    it equals `QuantizedArray.dequantize` for every stored byte (NaN where it is
    NaN), over several column tiles and two row tiles; MXFP4 read in both
    orientations."""
    asked = None
    if fmt == "mxfp4-kn":
        asked = request.getfixturevalue("mxfp4_transposed")
        fmt = "mxfp4"
    w = every_code_weight(fmt, K, n, jr.key(11), parts)
    want = np.asarray(w.dequantize(jnp.float32)[0], np.float32)
    got = grouped_matmul(
        jnp.eye(K),
        w,
        jnp.array([K], jnp.int32),
        tiles=(128, K, 128),
        interpret=True,
    )
    got = np.asarray(got, np.float32)
    assert np.isnan(want).any() == (fmt == "float8_e4m3fn")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    mask = ~np.isnan(want)
    np.testing.assert_array_equal(got[mask], want[mask])
    assert asked is None or asked


@pytest.mark.parametrize(
    ("case", "tn", "dtype"),
    [("int8", 128, "float32"), ("int8", K, "bfloat16"), ("fp8", 128, "float32")]
    + [("fp8-parts", K, "bfloat16"), ("mxfp4", K, "float32")]
    + [("mxfp4-kn", K, "bfloat16")],
)
def test_input_gradient_product_equals_dequantizing_first(case, tn, dtype, request):
    """The input's gradient's product (`transpose_rhs`: rows times each group's
    weight transposed) on the stored bytes, the weight's `K` the output columns
    (whole for MXFP4, else one or two tiles) and its `N` the contraction over two
    or three tiles: exactly the kernel on the weights dequantized first, the
    groups as above."""
    asked = None
    if case == "mxfp4-kn":
        asked = request.getfixturevalue("mxfp4_transposed")
        case = "mxfp4"
    fmt, n, parts = FORMATS[case]
    dt = jnp.dtype(dtype)
    w = _parts(_raw(n), fmt, parts)
    sizes = jnp.array(SIZES, jnp.int32)
    lhs = jr.normal(jr.key(0), (M, n), dt).at[sum(SIZES) :].set(jnp.nan)
    kw = dict(tiles=(32, 128, tn), chunk=16, transpose_rhs=True)
    ours, first = _both(lhs, w, sizes, dt, **kw)
    assert ours.shape == (M, K)
    assert not np.isnan(first[: sum(SIZES)]).any()
    assert not np.any(ours[sum(SIZES) :]), "rows past the groups"
    np.testing.assert_array_equal(ours, first)
    assert asked is None or asked


def _prefill_layer(fmt):
    """A layer with `fmt` experts on `PallasTPUGMM` past its decode rows (4), so
    that its pairs take the many-row kernel."""
    cfg = me.MoEConfig(
        d_model=64,
        d_ff=64,
        num_experts=4,
        top_k=2,
        gmm_backend=PallasTPUGMM(max_rows=4, interpret=True),
    )
    return me.quantize_experts(me.MoELayer(cfg, key=jr.key(5)), fmt)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4", "mxfp4-kn"])
def test_layer_prefill_equals_the_dequantized_layer(fmt, request):
    """The layer on `PallasTPUGMM` past its decode rows (the many-row kernel reading
    the stored bytes): its output, its input's gradient and its forward-mode tangent
    are those of the same layer with its experts dequantized (MXFP4 in both
    orientations)."""
    asked = None
    if fmt == "mxfp4-kn":
        asked = request.getfixturevalue("mxfp4_transposed")
        fmt = "mxfp4"
    layer = _prefill_layer(fmt)
    floats = me.dequantize_experts(layer)
    x = jr.normal(jr.key(7), (24, 64))

    def close(a, b):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max(), rtol=0)

    y, stats = jax.jit(lambda x: layer(x))(x)
    stats.check()  # every pair computed, none lost
    close(y, floats(x)[0])
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(layer(x)[0])))(x)
    close(grad, jax.grad(lambda x: jnp.sum(jnp.sin(floats(x)[0])))(x))
    # Forward mode: the tangent through the kernel reading the stored bytes.
    t = jr.normal(jr.key(9), x.shape)
    _, tangent = jax.jvp(lambda x: layer(x)[0], (x,), (t,))
    close(tangent, jax.jvp(lambda x: floats(x)[0], (x,), (t,))[1])
    assert asked is None or asked


def _expert_arrays(text, g, k, n):
    """Float arrays of a whole expert weight's shape in a lowered program."""
    return re.findall(rf"tensor<{g}x{k}x{n}x(?:bf16|f32)>", text)


@pytest.mark.lowering_only
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4", "mxfp4-kn"])
def test_prefill_lowers_for_tpu_without_a_float_copy_of_the_experts(fmt, request):
    """A DeepSeek-V2-Lite-like expert FFN at 4096 tokens' pairs, bfloat16, lowered
    for TPU, forward and the input's gradient: Mosaic takes both products' kernels
    and both of their input gradients' (and the gated activation's backward
    kernel between them), and no float array of either weight's
    shape is in the program (the experts dequantized whole before the kernels, as
    the forward once did and the input's gradient after it, would be; MXFP4 checks
    the kernels' FFN, the part outside its edge-scale check, in both
    orientations)."""
    asked = None
    if fmt == "mxfp4-kn":
        asked = request.getfixturevalue("mxfp4_transposed")
        fmt = "mxfp4"
    g, d, f, rows = 64, 2048, 1408, 4096 * 6
    w1 = jax.eval_shape(lambda: quantize(jnp.zeros((g, d, 2 * f)), fmt))
    w2 = jax.eval_shape(lambda: quantize(jnp.zeros((g, f, d)), fmt))
    x = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    backend = PallasTPUGMM()
    if fmt == "mxfp4":

        def ffn(x, w1, w2, s):
            return backend._ffn(x, w1, w2, s, SWIGLU, _TrainingProducts(False))
    else:
        ffn = backend.ffn

    def value_and_grad(x, w1, w2, s):
        return jax.value_and_grad(lambda x: jnp.sum(ffn(x, w1, w2, s)))(x)

    for fn, kernels, activation in ((ffn, 2, 0), (value_and_grad, 4, 1)):
        text = (
            jax.jit(fn)
            .trace(x, w1, w2, sizes)
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
        assert text.count('kernel_name = "moe_eqx_gated_vjp"') == activation
        assert text.count("tpu_custom_call") == kernels + activation
        assert not _expert_arrays(text, g, d, 2 * f) + _expert_arrays(text, g, f, d)
    assert asked is None or asked


def _with_scale_byte(w, byte):
    """MXFP4 `w` with its first scale byte of every row set to `byte`."""
    scales = jax.lax.bitcast_convert_type(w.scales, jnp.uint8).at[:, :, 0].set(byte)
    return eqx.tree_at(
        lambda w: w.scales, w, jax.lax.bitcast_convert_type(scales, jnp.int8)
    )


@pytest.mark.parametrize("byte", [0, 1])
def test_prefill_with_edge_scales_takes_the_exact_path(byte):
    """MXFP4 scale bytes outside `[2, 254]` at many rows: the kernels' float
    scaling would flush them, so the layer takes the experts dequantized exactly
    (one at a time); its output and its input's gradient are the dequantized
    layer's, finite."""
    layer = _prefill_layer("mxfp4")
    w = _with_scale_byte(layer.experts.w_gate_up, byte)
    layer = eqx.tree_at(lambda l: l.experts.w_gate_up, layer, w)
    floats = me.dequantize_experts(layer)
    x = jr.normal(jr.key(8), (24, 64)) * 1e30
    y, want = layer(x)[0], floats(x)[0]
    np.testing.assert_allclose(y, want, atol=1e-5 * np.abs(want).max(), rtol=0)

    def loss(layer, x):
        return jnp.sum(jnp.sin(layer(x)[0]))

    x = x / 1e30  # (at 1e30 the router's gradient is not finite, float layer too)
    grad = jax.grad(loss, argnums=1)(layer, x)
    assert np.all(np.isfinite(np.asarray(grad)))
    want = jax.grad(loss, argnums=1)(floats, x)
    np.testing.assert_allclose(grad, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_mxfp4_edge_check_passes_no_dequantized_experts_to_the_backward():
    """Under reverse mode the scale-byte check's `cond` returns its branches'
    residuals, the untaken branch's as zeros built in every step: the exact
    branch is rematerialised, so none of them is a float array of an expert
    weight's shape or of the rows' products (before: both weights dequantized and
    both products' rows, 1.3 GB of zeros at 4096 tokens of a DeepSeek-V2-Lite-like
    layer)."""
    g, d, f, rows = 64, 2048, 1408, 4096 * 6
    w1 = jax.eval_shape(lambda: quantize(jnp.zeros((g, d, 2 * f)), "mxfp4"))
    w2 = jax.eval_shape(lambda: quantize(jnp.zeros((g, f, d)), "mxfp4"))
    x = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    backend = PallasTPUGMM()

    def value_and_grad(x, w1, w2, s):
        def loss(x):
            return jnp.sum(backend.ffn(x, w1, w2, s).astype(jnp.float32))

        return jax.value_and_grad(loss)(x)

    jaxpr = jax.make_jaxpr(value_and_grad)(x, w1, w2, sizes).jaxpr
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert conds
    shapes = {(g, d, 2 * f), (g, f, d), (rows, 2 * f), (rows, f)}
    for eqn in conds:
        for v in eqn.outvars:
            assert not (v.aval.shape in shapes and v.aval.dtype == jnp.bfloat16), v.aval


def test_mxfp4_prefill_holds_no_float32_copy_of_the_experts():
    """The many-row MXFP4 FFN, its exact branch for edge scale bytes included,
    compiled (CPU): its temporaries under the experts' float32 bytes (0.53x with
    JAX 0.10, 0.85x with 0.12). Before, at many rows it dequantized both weights
    whole ahead of the kernels: 1.34x."""
    g, d, f, rows = 32, 256, 256, 64
    w1 = jax.eval_shape(lambda: quantize(jnp.zeros((g, d, 2 * f)), "mxfp4"))
    w2 = jax.eval_shape(lambda: quantize(jnp.zeros((g, f, d)), "mxfp4"))
    x = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    backend = PallasTPUGMM(max_rows=4, interpret=True)
    compiled = compile_as_users(jax.jit(backend.ffn).lower(x, w1, w2, sizes))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < (g * d * 2 * f + g * f * d) * 4, temp
