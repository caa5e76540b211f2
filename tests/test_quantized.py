"""Experts kept quantized in memory (`me.quantize_experts`): each format against its
definition, its bytes, and the quantized layer against the dequantized one on every
CPU backend (outputs and `x`-gradients); the quantized weights are constants."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import compile_as_users, cpu_devices, mesh

import moe_eqx as me
from moe_eqx import _quant
from moe_eqx._sharding import with_fsdp_axes

# The built-in formats (a test module may register its own beside them).
FORMATS = ("float8_e4m3fn", "mxfp4", "int8")
assert set(FORMATS) <= set(_quant.quant_formats())
# Bytes of the quantized experts over bfloat16's (the issue's goals).
MAX_BYTES_RATIO = {"float8_e4m3fn": 0.55, "mxfp4": 0.30, "int8": 0.55}


def _weights(seed, shape):
    """Normal values whose magnitude changes by powers of two across rows and
    columns, so that blocks get different scales."""
    key1, key2 = jr.split(jr.key(seed))
    w = jr.normal(key1, shape, jnp.float32)
    return w * jnp.exp2(jr.randint(key2, shape[:-2] + (shape[-2], 1), -6, 6))


def test_fp8_round_trip_is_within_half_a_step():
    # Partial blocks on both axes (200 = 128 + 72, 136 = 128 + 8).
    w = _weights(0, (2, 200, 136))
    q = _quant.quantize(w, "float8_e4m3fn")
    assert q.values.dtype == jnp.int8 and q.scales.shape == (2, 2, 2)
    got = np.asarray(q.dequantize())
    scale = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.float32))
    full = np.repeat(np.repeat(scale, 128, axis=1)[:, :200], 128, axis=2)[..., :136]
    w = np.asarray(w)
    # E4M3: 3 mantissa bits (half a step is 2^-4 of the value) down to 2^-6, then
    # subnormal steps of 2^-9; each block's largest magnitude maps to 448.
    bound = np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * full) * (1 + 1e-6)
    assert np.all(np.abs(got - w) <= bound)
    blocks = np.abs(w).reshape(2, 1, 200, 1, 136)
    # To one ulp: XLA:CPU's float32 division is not correctly rounded
    # (docs/measured.md, "Quantized experts"), so a block's scale, and its largest
    # magnitude back from 448 times it, may be one ulp off.
    want = np.abs(w[0, :128, :128]).max() / 448
    np.testing.assert_allclose(scale[0, 0, 0], want, rtol=2.0**-22)
    np.testing.assert_allclose(np.abs(got).max(), blocks.max(), rtol=2.0**-22)


def _mxfp4_nearest(w):
    """Each value's nearest `code * 2^(floor(log2(amax)) - 2)` over its block of 32
    along the contracting axis (FP4 E2M1 saturates at 6): the format's definition."""
    blocks = np.swapaxes(w, -1, -2).reshape(*w.shape[:-2], w.shape[-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.exp2(np.floor(np.log2(amax)) - 2)
    grid = np.asarray(_quant.FP4_E2M1_VALUES, np.float32)
    dist = np.abs(blocks[..., None] - grid * scale[..., None])
    return dist.min(-1)


def test_mxfp4_round_trip_is_the_nearest_code():
    w = np.asarray(_weights(1, (2, 64, 24)))
    q = _quant.quantize(jnp.asarray(w), "mxfp4")
    assert q.values.shape == (2, 24, 32) and q.scales.shape == (2, 24, 2)
    assert q.values.dtype == q.scales.dtype == jnp.int8  # bytes
    got = np.asarray(q.dequantize())
    err = np.swapaxes(np.abs(got - w), -1, -2).reshape(2, 24, 2, 32)
    np.testing.assert_allclose(err, _mxfp4_nearest(w), rtol=1e-6, atol=0)
    # Quantizing the dequantized weight gives the same bytes back.
    again = _quant.quantize(jnp.asarray(got), "mxfp4")
    np.testing.assert_array_equal(again.values, q.values)
    np.testing.assert_array_equal(again.scales, q.scales)


def test_mxfp4_ties_round_to_an_even_code():
    # One block whose largest value (4) sets the scale to 1: each midpoint between
    # two codes goes to the even one (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2,
    # 3.5 -> 4, 5 -> 4), and 7 saturates at 6.
    mid = [0.25, 0.75, 1.25, 2.5, 3.5, 5.0, -0.75, 7.0]
    want = [0.0, 1.0, 1.0, 2.0, 4.0, 4.0, -1.0, 6.0]
    col = np.zeros(32, np.float32)
    col[: len(mid)], col[-1] = mid, 4.0
    q = _quant.quantize(jnp.asarray(col[:, None]), "mxfp4")
    np.testing.assert_array_equal(np.asarray(q.dequantize())[: len(mid), 0], want)


def test_int8_round_trip_is_within_half_a_step():
    w = np.asarray(_weights(2, (2, 48, 40)))
    q = _quant.quantize(jnp.asarray(w), "int8")
    assert q.values.dtype == jnp.int8 and q.scales.shape == (2, 1, 40)
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    got = np.asarray(q.dequantize())
    assert np.all(np.abs(got - w) <= scale / 2 * (1 + 1e-5))
    np.testing.assert_allclose(np.abs(got).max(1), np.abs(w).max(1), rtol=1e-6)


CONFIG = me.MoEConfig(
    d_model=64, d_ff=64, num_experts=4, top_k=2, shared_d_ff=32, shared_gate=True
)


@pytest.fixture(scope="module")
def layer():
    return me.MoELayer(CONFIG, key=jr.key(3))


@pytest.fixture(scope="module")
def x():
    return jr.normal(jr.key(4), (24, CONFIG.d_model), jnp.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_bytes(fmt):
    # Bytes depend on shapes only: a layer of DeepSeek-like expert widths, abstract.
    cfg = me.MoEConfig(d_model=1024, d_ff=512, num_experts=4, top_k=2)
    layer = jax.eval_shape(lambda: me.MoELayer(cfg, key=jr.key(0)))
    q = jax.eval_shape(lambda m: me.quantize_experts(m, fmt), layer).experts
    assert q.w_gate_up.shape == (4, 1024, 1024) and q.w_down.shape == (4, 512, 1024)
    stored = sum(
        a.size * a.dtype.itemsize for a in jax.tree.leaves((q.w_gate_up, q.w_down))
    )
    ratio = stored / (2 * 4 * (1024 * 1024 + 512 * 1024))
    assert ratio <= MAX_BYTES_RATIO[fmt], ratio


# Every format through the tiled backend (which dequantizes per group); the others
# dequantize the whole weight by the same rule.
@pytest.mark.parametrize(
    "fmt, backend",
    [
        *((fmt, "tiled") for fmt in FORMATS),
        ("float8_e4m3fn", "dense"),
        ("mxfp4", "ragged_dot"),
        ("int8", "dense"),
    ],
)
def test_forward_equals_dequantized_layer(layer, x, fmt, backend):
    q = me.quantize_experts(layer.with_config(gmm_backend=backend), fmt)
    d = me.dequantize_experts(q)
    assert isinstance(q.experts.w_gate_up, me.QuantizedArray)
    assert d.experts.w_gate_up.dtype == layer.experts.w_gate_up.dtype
    y, want = _forward(q, x), _forward(d, x)
    if backend == "tiled":  # dequantized per group, inside the loop
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    else:  # dequantized whole, then the same products
        np.testing.assert_array_equal(y, want)


def _loss(model, x):
    return jnp.sum(jnp.sin(model(x)[0]))


# One compiled program per layer structure (format, backend), shared by the tests.
_forward = eqx.filter_jit(lambda m, x: m(x)[0])
_grad = eqx.filter_jit(eqx.filter_grad(lambda model_x: _loss(*model_x)))


@pytest.mark.parametrize(
    "fmt, backend",
    [("float8_e4m3fn", "tiled"), ("mxfp4", "ragged_dot"), ("int8", "tiled")],
)
def test_gradients_flow_to_x_router_and_shared_experts(layer, x, fmt, backend):
    q = me.quantize_experts(layer.with_config(gmm_backend=backend), fmt)
    d = me.dequantize_experts(q)
    (g_q, gx_q), (g_d, gx_d) = _grad((q, x)), _grad((d, x))
    np.testing.assert_allclose(gx_q, gx_d, rtol=1e-5, atol=1e-6)
    # The quantized weights are constants: no gradient leaf at all.
    assert g_q.experts.w_gate_up.values is None and g_q.experts.w_gate_up.scales is None
    for pick in (
        lambda g: g.router.weight,
        lambda g: g.shared_experts.w_gate_up,
        lambda g: g.shared_experts.gate,
    ):
        np.testing.assert_allclose(pick(g_q), pick(g_d), rtol=1e-5, atol=1e-6)


def test_bad_input(layer):
    with pytest.raises(ValueError, match="`fmt` 'fp4'"):
        me.quantize_experts(layer, "fp4")
    with pytest.raises(ValueError, match="already quantized"):
        me.quantize_experts(me.quantize_experts(layer, "int8"), "int8")
    # A quantized layer takes a new parallel setting like a float one.
    me.quantize_experts(layer, "int8").with_config(on_overflow="drop")
    with pytest.raises(ValueError, match="multiple of 32"):
        _quant.quantize(jnp.zeros((2, 40, 8)), "mxfp4")


# Expert parallelism: EP8 over 16 experts, every path of the layer with quantized
# experts against the same layer dequantized, on the same mesh.
EP_CONFIG = me.MoEConfig(d_model=64, d_ff=64, num_experts=16, top_k=2)


def _value_and_grad(model, x, mesh):
    def loss(model_x):
        y, stats = model_x[0](model_x[1], mesh=mesh)
        return jnp.sum(jnp.sin(y)), stats

    return eqx.filter_value_and_grad(loss, has_aux=True)((model, x))


_ep_value_and_grad = eqx.filter_jit(_value_and_grad)


@pytest.fixture(scope="module")
def ep_layer():
    return me.MoELayer(EP_CONFIG, key=jr.key(5))


@pytest.fixture(scope="module")
def ep_x():
    return jr.normal(jr.key(6), (64, EP_CONFIG.d_model), jnp.float32)


def _assert_same_value_and_grad(q, d, x, mesh):
    (loss_q, stats_q), (g_q, gx_q) = _ep_value_and_grad(q, x, mesh)
    (loss_d, stats_d), (g_d, gx_d) = _ep_value_and_grad(d, x, mesh)
    np.testing.assert_allclose(loss_q, loss_d, rtol=1e-6)
    np.testing.assert_allclose(gx_q, gx_d, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        g_q.router.weight, g_d.router.weight, rtol=1e-5, atol=1e-6
    )
    assert g_q.experts.w_gate_up.values is None and g_q.experts.w_down.scales is None
    return stats_q, stats_d


def test_ep8_drop(ep_layer, ep_x):
    q = me.quantize_experts(
        ep_layer.with_config(on_overflow="drop", buffer_factor=0.3), "int8"
    )
    d = me.dequantize_experts(q)
    m = mesh(8)
    (y_q, stats_q), (y_d, stats_d) = _ep_forward(q, ep_x, m), _ep_forward(d, ep_x, m)
    assert int(stats_q.dropped_pairs) > 0
    assert int(stats_q.dropped_pairs) == int(stats_d.dropped_pairs)
    np.testing.assert_allclose(y_q, y_d, rtol=1e-6, atol=1e-6)


_ep_forward = eqx.filter_jit(lambda model, x, mesh: model(x, mesh=mesh))


def test_ep8_fallback(ep_layer, ep_x):
    q = me.quantize_experts(ep_layer.with_config(buffer_factor=0.1), "float8_e4m3fn")
    d = me.dequantize_experts(q)
    stats, _ = _assert_same_value_and_grad(q, d, ep_x, mesh(8))
    assert bool(stats.fallback_used)
    # Forward mode too (the fallback's tangent loop gets no tangent for the weights).
    t = jr.normal(jr.key(11), ep_x.shape)
    np.testing.assert_allclose(
        _ep_jvp(q, ep_x, t, mesh(8)), _ep_jvp(d, ep_x, t, mesh(8)), rtol=1e-5, atol=1e-6
    )


@eqx.filter_jit
def _ep_jvp(model, x, t, mesh):
    return jax.jvp(lambda x: model(x, mesh=mesh)[0], (x,), (t,))[1]


def test_ep8_slots_carry_the_quantized_weights(ep_layer, ep_x):
    # Expert 0 hot: the planner copies it (its bytes and scales) into spare slots.
    hot = eqx.tree_at(
        lambda m: m.router.bias,
        ep_layer.with_config(num_slots=1),
        jnp.zeros(16).at[0].set(4.0),
        is_leaf=lambda n: n is None,
    )
    q = me.quantize_experts(hot, "mxfp4")
    stats, _ = _assert_same_value_and_grad(q, me.dequantize_experts(q), ep_x, mesh(8))
    assert float(stats.max_over_mean) < float(stats.max_over_mean_before)


def test_fsdp_splits_quantized_experts_by_expert(ep_layer, ep_x):
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=cpu_devices()[:8])
    layer = with_fsdp_axes(ep_layer, ("data",))
    q = me.shard_model(me.quantize_experts(layer, "mxfp4"), m)
    # Each device holds one of its shard's four experts: 1/8 of the bytes and scales.
    assert q.experts.w_gate_up.values.addressable_shards[0].data.shape[0] == 2
    assert q.experts.w_gate_up.scales.addressable_shards[0].data.shape[0] == 2
    d = me.dequantize_experts(me.quantize_experts(layer, "mxfp4"))
    _assert_same_value_and_grad(q, d, ep_x, m)
    # Split within d_ff (one expert per shard): refused, naming the fsdp axes.
    small = with_fsdp_axes(
        me.MoELayer(dataclasses.replace(EP_CONFIG, num_experts=4), key=jr.key(0)),
        ("data",),
    )
    with pytest.raises(ValueError, match="whole experts"):
        me.shard_specs(me.quantize_experts(small, "int8"), m)


# Memory: a compiled forward's temporaries (XLA's buffer assignment), one device,
# the tiled backend. Eight experts whose weights outweigh the activations, so that a
# float copy of all of them would show.
MEM_CONFIG = me.MoEConfig(d_model=128, d_ff=128, num_experts=8, top_k=2)


def _temp_bytes(model, x):
    arrays, static = eqx.partition(model, eqx.is_array)
    forward = jax.jit(lambda a, x: eqx.combine(a, static)(x)[0])
    compiled = compile_as_users(forward.lower(arrays, x))
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def float_temps():
    """`{dtype: (layer, x, the float layer's temporaries)}`."""
    out = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        layer = me.MoELayer(MEM_CONFIG, dtype=dtype, key=jr.key(7))
        x = jr.normal(jr.key(8), (16, MEM_CONFIG.d_model), dtype)
        out[dtype] = (layer, x, _temp_bytes(layer, x))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_temporaries_hold_one_dequantized_expert(float_temps, fmt):
    h, f = MEM_CONFIG.d_model, MEM_CONFIG.d_ff
    for dtype, (layer, x, float_temp) in float_temps.items():
        one_expert = (h * 2 * f + f * h) * jnp.dtype(dtype).itemsize
        temp = _temp_bytes(me.quantize_experts(layer, fmt), x)
        assert temp <= float_temp + one_expert, (dtype, temp, float_temp, one_expert)


def test_expert_biases_get_gradients(x):
    """Experts with biases (GPT-OSS): the quantized weights are dequantized before
    the bias rows join them; the biases get the dequantized layer's gradient."""
    cfg = dataclasses.replace(CONFIG, expert_options=me.ExpertOptions(bias=True))
    layer = me.MoELayer(cfg, key=jr.key(9))
    bias = 0.1 * jr.normal(jr.key(10), layer.experts.b_gate_up.shape)
    layer = eqx.tree_at(lambda m: m.experts.b_gate_up, layer, bias)
    q = me.quantize_experts(layer, "mxfp4")
    (g_q, gx_q), (g_d, gx_d) = _grad((q, x)), _grad((me.dequantize_experts(q), x))
    for pick in (lambda g: g.experts.b_gate_up, lambda g: g.experts.b_down):
        np.testing.assert_allclose(pick(g_q), pick(g_d), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx_q, gx_d, rtol=1e-5, atol=1e-6)
    assert g_q.experts.w_down.values is None


def test_rebalance_moves_quantized_experts(layer, x):
    q = me.quantize_experts(layer.with_config(gmm_backend="tiled"), "float8_e4m3fn")
    moved = me.rebalance_experts(q, jnp.array([10.0, 10.0, 1.0, 1.0]), num_shards=2)
    assert not np.array_equal(moved.expert_ids, np.arange(4))
    assert isinstance(moved.experts.w_down, me.QuantizedArray)
    np.testing.assert_allclose(_forward(moved, x), _forward(q, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_arrays_cannot_be_built_or_indexed_invalid(fmt):
    """A `QuantizedArray` checks its values' and scales' dtypes and the scales'
    shape against the values' (uint8 values read as int8 would dequantize to
    0..255), and indexes its leading (expert) axes only: `q[:, 0]` of a
    `(4, 64, 96)` MXFP4 weight would have given a `(64, 4)` one."""
    q = _quant.quantize(jr.normal(jr.key(0), (4, 64, 96)), fmt)
    assert q[1].shape == (64, 96) and q[1:3].shape == (2, 64, 96)
    assert q[jnp.asarray([0, 3])].shape == (2, 64, 96)
    np.testing.assert_array_equal(q[2].dequantize(), q.dequantize()[2])
    for index in ((slice(None), 0), (0, 0), Ellipsis, None, 0.5, (1, slice(None), 3)):
        with pytest.raises(ValueError, match="QuantizedArray"):
            q[index]
    if fmt == "int8":  # integers: unsigned ones would mean other values
        wrong_values = q.values.view(jnp.uint8)
    else:  # bit patterns: the other signedness is the same bytes, reinterpreted
        wrong_values = q.values.astype(jnp.int32)
        same = _quant.QuantizedArray(
            np.asarray(q.values).view(np.uint8),
            jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
            if fmt == "mxfp4"
            else q.scales,
            fmt,
            jnp.float32,
        )
        assert same.values.dtype == q.values.dtype
        np.testing.assert_array_equal(same.dequantize(), q.dequantize())
    with pytest.raises(
        ValueError, match=r"`QuantizedArray.values` of format .* must be"
    ):
        _quant.QuantizedArray(wrong_values, q.scales, fmt, jnp.float32)
    with pytest.raises(ValueError, match=r"`QuantizedArray.scales` of format .* must"):
        _quant.QuantizedArray(q.values, q.scales[:2], fmt, jnp.float32)
    with pytest.raises(ValueError, match=r"`QuantizedArray.dtype` must be a floating"):
        _quant.QuantizedArray(q.values, q.scales, fmt, jnp.int32)


def test_mxfp4_takes_the_checkpoints_blocks_reshaped():
    """gpt-oss's `*_blocks` `[..., N, K / 32, 16]` are the format's bytes: as they
    are, a clear error saying how to lay them out; reshaped, the same weight as
    `dequantize_mxfp4` of the blocks."""
    w = _weights(2, (2, 64, 24))
    q = _quant.quantize(w, "mxfp4")
    blocks = q.values.reshape(2, 24, 2, 16)
    with pytest.raises(ValueError, match=r"reshape them to `\[\.\.\., N, K / 2\]`"):
        me.QuantizedArray(blocks, q.scales, "mxfp4", jnp.float32)
    want = _quant.dequantize_mxfp4(
        np.asarray(blocks).view(np.uint8), np.asarray(q.scales).view(np.uint8)
    )
    np.testing.assert_array_equal(q.dequantize(), np.swapaxes(want, -1, -2))
