"""The Pallas TPU decode kernel (`me.PallasTPUGMM`) in Pallas' interpreter on the CPU:
values against `lax.ragged_dot` on the dequantized weights, both derivatives, forward
mode, every quantized format, and the layer built on it. `tests/test_tpu.py` runs it
compiled on a chip."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import every_code_weight, kernel_operand_sources, mesh as cpu_mesh

import moe_eqx as me
from moe_eqx._gmm.pallas_tpu import _weight_operands, decode_gmm
from moe_eqx._gmm.quantized_tpu import fp4_bfloat16_words
from moe_eqx._quant import fp4_value
from moe_eqx.internal import quantize

G, K, N = 8, 64, 128
# Empty groups first, between and last; rows past the sum (padding) at the end.
SIZES = jnp.array([0, 3, 0, 0, 5, 1, 2, 0], jnp.int32)
M = 13


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(b).max()), rtol=0)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4"])
def test_kernel_reads_the_stored_bytes_themselves(fmt):
    """The kernel's weight operands are the stored `int8` bytes themselves: any
    conversion on the way (a bitcast, even `uint8` to `int8`) was a copy of every
    expert's weight in each decode step on a TPU (docs/measured.md, "TPU").
    MXFP4's scales go in by slot: the touched experts' alone."""
    w = quantize(jr.normal(jr.key(1), (G, K, N)), fmt)
    ids = jnp.array([4, 1, 1], jnp.int32)
    _, arrays, blocks = _weight_operands(w, K, N, N, ids)
    assert arrays[0] is w.values and w.values.dtype == jnp.int8
    if fmt == "mxfp4":
        assert blocks[1][0] == "slot" and arrays[1].shape[0] == ids.shape[0]
        bytes_ = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
        for expert, same in ((0, True), (4, False)):  # untouched, touched
            changed = bytes_.at[expert].set(bytes_[expert] ^ 1)
            changed = jax.lax.bitcast_convert_type(changed, jnp.int8)
            w2 = eqx.tree_at(lambda w: w.scales, w, changed)
            other = _weight_operands(w2, K, N, N, ids)[1][1]
            assert np.array_equal(other, arrays[1]) == same, expert


def test_mxfp4_transposed_operands_are_the_stored_bytes_swapped(mxfp4_transposed):
    """Where the platform lays MXFP4 bytes out with `N` minor-most, the kernel's
    operands are the stored arrays with their last two axes swapped (no other
    conversion), which is the bytes as they lie there, and the touched experts'
    scale bytes in the same orientation: on the word kernel, and off it where `K`
    is not whole words of eight rows."""
    asked = mxfp4_transposed
    w = quantize(jr.normal(jr.key(1), (G, K, N)), "mxfp4")
    ids = jnp.array([6, 2], jnp.int32)
    path, arrays, blocks = _weight_operands(w, K, N, 32, ids)
    assert path == "mxfp4_kn_words" and asked == [w.values.shape]
    np.testing.assert_array_equal(arrays[0], jnp.swapaxes(w.values, 1, 2))
    np.testing.assert_array_equal(arrays[1], jnp.swapaxes(w.scales[ids], 1, 2))
    assert blocks == ((None, K // 2, None), ("slot", K // 32, None))
    k = 96  # three blocks of 32 rows: not whole words of eight
    w = quantize(jr.normal(jr.key(1), (G, k, N)), "mxfp4")
    path, arrays, blocks = _weight_operands(w, k, N, 32, ids)
    assert path == "mxfp4_kn"
    np.testing.assert_array_equal(arrays[1], jnp.swapaxes(w.scales[ids], 1, 2))
    assert blocks == ((None, k // 2, None), ("slot", k // 32, None))


def test_mxfp4_row_major_words_take_the_gathered_scale_bytes():
    """Row-major MXFP4 bytes on the word kernel take the stored bytes themselves and
    the touched experts' scale bytes as gathered, `[slots, N, K / 32]` (the
    kernel reads their words in place: no reorder); a step whose half of its
    columns is not whole lanes stays on the byte kernel."""
    ids = jnp.array([6, 2], jnp.int32)
    w = quantize(jr.normal(jr.key(1), (G, 512, 512)), "mxfp4")
    path, arrays, blocks = _weight_operands(w, 512, 512, 256, ids)
    assert path == "mxfp4_words" and arrays[0] is w.values
    np.testing.assert_array_equal(arrays[1], w.scales[ids])
    assert blocks == ((None, None, 256), ("slot", None, 16))
    assert _weight_operands(w, 512, 512, 128, ids)[0] == "mxfp4"


def test_fp4_words_are_every_code_at_every_scale_exactly():
    """The word kernel's bfloat16 bits (`fp4_bfloat16_words`) are
    `QuantizedArray.dequantize`'s values bit for bit (-0.0 too) for every pair of
    codes in a word's halves at every scale byte it takes, `[2, 252]`."""
    byte = np.arange(2, 253, dtype=np.int32)[:, None]
    pairs = np.arange(256, dtype=np.int32)[None, :]  # code s, code s + 4
    words = np.zeros((byte.shape[0], 256), np.int32)
    for s in range(4):  # every pair in every position
        words |= ((pairs & 0xF) << (4 * s)) | ((pairs >> 4) << (4 * s + 16))
    words = jnp.asarray(words)
    shared = jnp.asarray(np.broadcast_to((byte - 1) << 7, words.shape))
    # Each half's own scale: the high half's byte another (`(byte + 96) % 251 +
    # 2`, over the whole range).
    other = (byte + 96) % 251 + 2
    own = jnp.asarray(np.broadcast_to((byte - 1) << 7 | (other - 1) << 23, words.shape))
    for halves, scale, high in ((False, shared, byte), (True, own, other)):
        out = fp4_bfloat16_words(words, [scale] * 4, halves=halves)
        for s, bits in enumerate(out):
            got = np.asarray(bits).view(np.uint32)
            for half, codes, b in ((0, pairs & 0xF, byte), (1, pairs >> 4, high)):
                value = np.asarray(fp4_value(jnp.asarray(codes)), np.float64)
                want = (value * 2.0 ** (b - 127.0)).astype(jnp.bfloat16)
                half_bits = ((got >> (16 * half)) & 0xFFFF).astype(np.uint16)
                np.testing.assert_array_equal(
                    half_bits, want.view(np.uint16), (halves, s, half)
                )


@pytest.mark.parametrize("fmt", [None, "int8", "float8_e4m3fn", "mxfp4", "mxfp4-kn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_values_match_dequantizing_first(fmt, dtype, request):
    asked = None
    if fmt == "mxfp4-kn":  # the bytes read in their transposed orientation
        asked = request.getfixturevalue("mxfp4_transposed")
        fmt = "mxfp4"
    dt = jnp.dtype(dtype)
    lhs = jr.normal(jr.key(0), (M, K), dt)
    rhs = jr.normal(jr.key(1), (G, K, N))
    w = rhs.astype(dt) if fmt is None else quantize(rhs, fmt)
    dense = w if fmt is None else w.dequantize(dt)
    ref = me.RaggedDotGMM()(lhs, dense, SIZES)
    out = decode_gmm(lhs, w, SIZES, block_n=32, interpret=True)
    assert out.dtype == dt and out.shape == (M, N)
    _close(out, ref, 1e-5 if dt == jnp.float32 else 1e-2)
    assert not np.any(np.asarray(out[11:], np.float32)), "rows past the groups"
    assert asked is None or asked


def test_no_rows_and_one_row():
    rhs = jr.normal(jr.key(1), (G, K, N))
    lhs = jr.normal(jr.key(0), (1, K))
    sizes = jnp.zeros((G,), jnp.int32)
    assert not np.any(np.asarray(decode_gmm(lhs, rhs, sizes, interpret=True)))
    none = decode_gmm(jnp.zeros((0, K)), rhs, sizes, interpret=True)
    assert none.shape == (0, N)
    sizes = sizes.at[G - 1].set(1)
    _close(decode_gmm(lhs, rhs, sizes, interpret=True), lhs @ rhs[G - 1], 1e-5)


@pytest.mark.parametrize("fmt", [None, "mxfp4"])
def test_ffn_of_no_rows(fmt):
    """The two products of no rows (a shard with an empty buffer): no grid step,
    and MXFP4's check of its touched experts' scale bytes has none to read."""
    w_gate_up, w_down = jr.normal(jr.key(1), (G, K, N)), jr.normal(jr.key(2), (G, K, K))
    if fmt is not None:
        w_gate_up, w_down = quantize(w_gate_up, fmt), quantize(w_down, fmt)
    backend = me.PallasTPUGMM(interpret=True)
    sizes = jnp.zeros((G,), jnp.int32)
    out = backend.ffn(jnp.zeros((0, K)), w_gate_up, w_down, sizes)
    assert out.shape == (0, K)


def test_derivatives_match_ragged_dot():
    backend = me.PallasTPUGMM(interpret=True)
    ref = me.RaggedDotGMM()
    lhs = jr.normal(jr.key(0), (M, K))
    rhs = jr.normal(jr.key(1), (G, K, N))
    cot = jr.normal(jr.key(2), (M, N))

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, SIZES) * cot)

    got = jax.grad(loss(backend), argnums=(0, 1))(lhs, rhs)
    want = jax.grad(loss(ref), argnums=(0, 1))(lhs, rhs)
    for g, w in zip(got, want, strict=True):
        _close(g, w, 1e-5)
    t_lhs, t_rhs = jr.normal(jr.key(3), lhs.shape), jr.normal(jr.key(4), rhs.shape)
    _, tangent = jax.jvp(lambda a, b: backend(a, b, SIZES), (lhs, rhs), (t_lhs, t_rhs))
    _, want_t = jax.jvp(lambda a, b: ref(a, b, SIZES), (lhs, rhs), (t_lhs, t_rhs))
    _close(tangent, want_t, 1e-5)


def _layer(**overrides):
    cfg = me.MoEConfig(
        d_model=K,
        d_ff=N // 2,
        num_experts=G,
        top_k=2,
        gmm_backend=me.PallasTPUGMM(interpret=True),
        **overrides,
    )
    return me.MoELayer(cfg, key=jr.key(5))


@pytest.mark.parametrize("num_shards", [None, 2])
def test_layer_on_the_kernel_matches_oracle(num_shards):
    layer = _layer(exchange="dense")
    x = jr.normal(jr.key(6), (16, K))
    mesh = None if num_shards is None else cpu_mesh(num_shards)

    def loss(layer, x, fn):
        return jnp.sum(jnp.sin(fn(layer, x)))

    def run(layer, x):
        return layer(x, mesh=mesh)[0]

    y, stats = eqx.filter_jit(lambda l, x: l(x, mesh=mesh))(layer, x)
    stats.check()
    _close(y, me.reference_moe(layer, x), 1e-5)
    got = eqx.filter_jit(eqx.filter_grad(lambda a: loss(*a, run)))((layer, x))
    want = eqx.filter_grad(lambda a: loss(*a, me.reference_moe))((layer, x))
    _close(got[1], want[1], 1e-5)
    _close(got[0].experts.w_gate_up, want[0].experts.w_gate_up, 1e-5)
    _close(got[0].experts.w_down, want[0].experts.w_down, 1e-5)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "mxfp4", "mxfp4-kn"])
def test_quantized_layer_matches_dequantized(fmt, request):
    asked = None
    if fmt == "mxfp4-kn":
        asked = request.getfixturevalue("mxfp4_transposed")
        fmt = "mxfp4"
    layer = me.quantize_experts(_layer(), fmt)
    floats = me.dequantize_experts(layer)
    x = jr.normal(jr.key(7), (8, K))
    _close(jax.jit(lambda x: layer(x)[0])(x), floats(x)[0], 1e-5)
    g = jax.grad(lambda x: jnp.sum(layer(x)[0] ** 2))(x)
    _close(g, jax.grad(lambda x: jnp.sum(floats(x)[0] ** 2))(x), 1e-4)
    assert asked is None or asked


@pytest.mark.parametrize("on_overflow", ["drop", "fallback"])
def test_mxfp4_layer_on_a_mesh_checks_each_shards_touched_scales(on_overflow):
    """Eight tokens on four shards (each shard's few rows on the decode kernel, its
    touched experts its own): a subnormal scale in one expert that a token picks
    takes the exact path on its shard; against the dequantized layer on the same
    mesh, capped and with the fallback compiled in."""
    layer = me.quantize_experts(
        _layer(exchange="dense", on_overflow=on_overflow), "mxfp4"
    )
    x = jr.normal(jr.key(9), (8, K))
    mesh = cpu_mesh(4)
    _, stats = layer(x, mesh=mesh)
    expert = int(np.argmax(np.asarray(stats.expert_counts)))  # a picked expert
    w = layer.experts.w_gate_up
    scales = jax.lax.bitcast_convert_type(w.scales, jnp.uint8).at[expert].set(0)
    w = eqx.tree_at(
        lambda w: w.scales, w, jax.lax.bitcast_convert_type(scales, jnp.int8)
    )
    layer = eqx.tree_at(lambda l: l.experts.w_gate_up, layer, w)
    floats = me.dequantize_experts(layer)
    y, stats = eqx.filter_jit(lambda l, x: l(x, mesh=mesh))(layer, x)
    stats.check()
    want = floats(x, mesh=mesh)[0]
    assert np.all(np.isfinite(np.asarray(want)))
    _close(y, want, 1e-5)


@pytest.mark.parametrize("byte", [0, 1, 255])
def test_mxfp4_edge_scales_take_the_exact_path(byte):
    """A scale byte outside [2, 254] (a subnormal or infinite scale): the kernel's
    float scaling would flush or overflow, so the layer dequantizes exactly; the
    kernel's unused result beside it stays finite, so the gradient is the exact
    path's too (not NaN)."""
    layer = me.quantize_experts(_layer(), "mxfp4")
    w = layer.experts.w_gate_up
    scales = jax.lax.bitcast_convert_type(w.scales, jnp.uint8).at[:, :, 0].set(byte)
    w = eqx.tree_at(
        lambda w: w.scales, w, jax.lax.bitcast_convert_type(scales, jnp.int8)
    )
    layer = eqx.tree_at(lambda l: l.experts.w_gate_up, layer, w)
    floats = me.dequantize_experts(layer)
    x = jr.normal(jr.key(8), (8, K)) * (1e30 if byte < 2 else 1.0)
    if byte == 255:  # infinite weights: compare where the dequantized layer is finite
        y, want = layer(x)[0], floats(x)[0]
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        return
    _close(layer(x)[0], floats(x)[0], 1e-5)

    # The gradient at inputs of ordinary size (at 1e30 the router's is not finite
    # for the float layer either).
    x = x / 1e30

    def loss(layer, x):
        return jnp.sum(jnp.sin(layer(x)[0]))

    g = jax.grad(loss, argnums=1)(layer, x)
    assert np.all(np.isfinite(np.asarray(g)))
    _close(g, jax.grad(loss, argnums=1)(floats, x), 1e-5)


def test_mxfp4_scales_that_overflow_take_the_exact_path_for_few_rows():
    """Scale bytes 253 and 254 overflow some codes to infinity, which the decode
    kernel's exponent arithmetic cannot form (it would give NaN): few rows take
    the exact path for them. Every code of the touched expert is 6 (infinite at
    byte 253), the down projection all ones, the row positive: the exact FFN is
    +inf everywhere."""
    backend = me.PallasTPUGMM(interpret=True)
    w_gate_up = quantize(jnp.ones((G, K, N)), "mxfp4")
    w_down = quantize(jnp.ones((G, N // 2, K)), "mxfp4")
    values = jnp.full_like(w_gate_up.values, 0x77)
    scales = jax.lax.bitcast_convert_type(w_gate_up.scales, jnp.uint8).at[5].set(253)
    w_gate_up = eqx.tree_at(
        lambda w: (w.values, w.scales),
        w_gate_up,
        (values, jax.lax.bitcast_convert_type(scales, jnp.int8)),
    )
    sizes = jnp.array([0, 0, 0, 0, 0, 1, 0, 0], jnp.int32)
    got = backend.ffn(jnp.ones((1, K)), w_gate_up, w_down, sizes)
    assert np.all(np.isposinf(np.asarray(got)))


@pytest.mark.parametrize("where", ["touched", "untouched"])
def test_mxfp4_edge_scales_are_checked_where_the_kernel_reads_them(where):
    """Few rows read only the touched experts' scale bytes, and the check covers
    exactly those: an edge byte (a subnormal scale, which the kernel's float
    scaling gets wrong) in one of the two touched experts of eight takes the
    exact path; in an untouched expert it changes nothing either way."""
    backend = me.PallasTPUGMM(interpret=True)
    w_gate_up = quantize(jr.normal(jr.key(1), (G, K, N)), "mxfp4")
    w_down = quantize(jr.normal(jr.key(2), (G, N // 2, K)), "mxfp4")
    sizes = jnp.array([0, 0, 2, 0, 0, 1, 0, 0], jnp.int32)
    expert = 5 if where == "touched" else 3
    scales = jax.lax.bitcast_convert_type(w_gate_up.scales, jnp.uint8)
    scales = scales.at[expert, :, :].set(0)
    w_gate_up = eqx.tree_at(
        lambda w: w.scales, w_gate_up, jax.lax.bitcast_convert_type(scales, jnp.int8)
    )
    # An edge expert's row large, so that its weights' tiny values show.
    x = jr.normal(jr.key(3), (3, K)).at[2].multiply(1e30 if expert == 5 else 1.0)
    got = backend.ffn(x, w_gate_up, w_down, sizes)
    want = me.RaggedDotGMM().ffn(
        x, w_gate_up.dequantize(jnp.float32), w_down.dequantize(jnp.float32), sizes
    )
    assert np.all(np.isfinite(np.asarray(want)))
    _close(got, want, 1e-5)


@pytest.mark.lowering_only
@pytest.mark.parametrize("fmt", [None, "int8", "float8_e4m3fn", "mxfp4", "mxfp4-kn"])
def test_lowers_for_tpu_at_a_model_shape(fmt, request):
    """Mosaic's lowering (run here, on the CPU) accepts every format's kernel at a
    DeepSeek-V2-Lite-like expert shape, both products: what the interpreter cannot
    check (e.g. an integer division Mosaic has no rule for). MXFP4 in both
    orientations (the down projection's bytes, `K / 2 = 704`, arrive transposed on
    a TPU)."""
    asked = None
    if fmt == "mxfp4-kn":
        asked = request.getfixturevalue("mxfp4_transposed")
        fmt = "mxfp4"
    for k, n in ((2048, 2816), (1408, 2048)):
        lhs = jax.ShapeDtypeStruct((48, k), jnp.bfloat16)
        w = jnp.zeros((64, k, n), jnp.bfloat16)
        rhs = jax.eval_shape(lambda w: w if fmt is None else quantize(w, fmt), w)
        sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
        text = (
            jax.jit(decode_gmm)
            .trace(lhs, rhs, sizes)
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
        assert text.count("tpu_custom_call") == 1, (fmt, k, n)
    assert asked is None or asked


# FP8 in parts whose width is whole blocks (the kernel spreads the block scales
# itself) and is not (a float32 scale per column goes in); MXFP4 row-major, and
# transposed on the word kernel (`K` whole words of eight) and off it.
# (fmt, k, n, block, parts, path)
_LAYOUTS = [
    ("int8", 512, 256, 128, 1, "int8"),
    ("float8_e4m3fn", 512, 256, 128, 1, "fp8_blocks"),
    ("float8_e4m3fn", 512, 256, 128, 2, "fp8_blocks"),
    ("float8_e4m3fn", 512, 384, 128, 2, "float8_e4m3fn"),
    ("mxfp4", 512, 256, 128, 1, "mxfp4"),  # half a step's columns not whole lanes
    ("mxfp4", 512, 512, 256, 1, "mxfp4_words"),
    ("mxfp4", 512, 256, 128, 1, "mxfp4_kn_words"),  # read transposed
    ("mxfp4", 480, 256, 128, 1, "mxfp4_kn"),
]


@pytest.mark.parametrize(("fmt", "k", "n", "block", "parts", "path"), _LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_code_dequantizes_exactly(fmt, k, n, block, parts, path, dtype, request):
    """Rows of the identity times the kernel's dequantized tile give the tile back:
    it equals `QuantizedArray.dequantize` exactly for every stored byte (NaN where
    it is NaN; MXFP4 with every scale byte of finite values), over several grid
    steps."""
    if path.startswith("mxfp4_kn"):
        request.getfixturevalue("mxfp4_transposed")
    dt = jnp.dtype(dtype)
    w = every_code_weight(fmt, k, n, jr.key(11), parts)
    assert _weight_operands(w, k, n, block, jnp.zeros((1,), jnp.int32))[0] == path
    want = np.asarray(w.dequantize(dt)[0], np.float32)
    eye = jnp.eye(k, dtype=dt)
    sizes = jnp.array([k], jnp.int32)
    got = decode_gmm(eye, w, sizes, block_n=block, interpret=True)
    got = np.asarray(got, np.float32)
    assert np.isnan(want).any() == (fmt == "float8_e4m3fn")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    mask = ~np.isnan(want)
    # Exactly equal (a sum of one product and zeros is +0.0 for a -0.0 weight).
    np.testing.assert_array_equal(got[mask], want[mask])


# Lines of the chip's compiled HLO (abridged; `Compiled.as_text()` writes operands
# without their types, a profile with them) before and after MXFP4 bytes laid out
# with `N` minor-most were read transposed: the down projection's bytes copied into
# row-major for the kernel, then a bitcast of the argument.
_COPIED = """
  %p_v.1 = s8[64,2048,704]{1,2,0:T(32,128)(4,1)} parameter(3)
  %slice.10 = bf16[16,704]{1,0} slice(%p_x.1), slice={[0:16:1], [0:1408:2]}
  %copy.38 = s8[64,2048,704]{2,1,0:T(32,128)(4,1)S(1)} copy(%p_v.1)
  %k.3 = bf16[16,2048]{1,0} custom-call(%slice.10, %copy.38), custom_call_target="tpu_custom_call"
"""
_READ = """
  %p_v.1 = s8[64,2048,704]{1,2,0:T(32,128)(4,1)} parameter(3)
  %bitcast.78 = s8[64,704,2048]{2,1,0:T(32,128)(4,1)} bitcast(s8[64,2048,704]{1,2,0:T(32,128)(4,1)} %p_v.1)
  %k.3 = bf16[16,2048]{1,0} custom-call(bf16[16,704]{1,0} %slice.10, s8[64,704,2048]{2,1,0:T(32,128)(4,1)} %bitcast.78), custom_call_target="tpu_custom_call"
"""


def test_kernel_operand_sources_follows_bitcasts_to_the_argument():
    """The check `tests/test_tpu.py` makes of a compiled program: a kernel operand
    that is a copy of an argument is told from one that is the argument itself
    (through a bitcast), its operands written with their types or without."""
    pattern = r"s8\[64,(?:704,2048|2048,704)\]"
    assert kernel_operand_sources(_COPIED, pattern) == ["copy"]
    assert kernel_operand_sources(_READ, pattern) == ["parameter"]
    assert kernel_operand_sources(_READ, r"s8\[64,2816,1024\]") == []
