"""A quantized format of a user's own (`me.AbstractQuantFormat`), registered once,
runs the layer like a built-in one: one device on every CPU backend and the TPU
decode kernel in interpret mode, and an 8-device mesh with the fallback taken, each
against the same layer dequantized; bad formats are clear errors."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import mesh

import moe_eqx as me
from moe_eqx import _quant
from moe_eqx._gmm.gathered import GatheredGMM


class Int4(me.AbstractQuantFormat):
    """Signed 4-bit integers per output channel, one per byte; the float32 scales
    stored as their bits (a constant for autodiff, like the built-in formats)."""

    name: ClassVar[str] = "test-int4"
    values_dtype: ClassVar[np.dtype] = np.dtype(np.int8)
    scales_dtype: ClassVar[np.dtype] = np.dtype(np.uint32)

    def scales_shape(self, values_shape, parts):
        return (*values_shape[:-2], 1, values_shape[-1])

    def dequantize(self, values, scales, dtype, parts):
        scale = jax.lax.bitcast_convert_type(scales, jnp.float32)
        return (values.astype(jnp.float32) * scale).astype(dtype)

    def quantize(self, w):
        amax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
        scale = jnp.where(amax > 0, amax / 7, 1.0)
        values = jnp.clip(jnp.round(w / scale), -7, 7).astype(jnp.int8)
        return values, jax.lax.bitcast_convert_type(scale, jnp.uint32)


INT4 = me.register_quant_format(Int4())
CONFIG = me.MoEConfig(d_model=64, d_ff=64, num_experts=16, top_k=2)


@pytest.fixture(scope="module")
def layer():
    return me.MoELayer(CONFIG, key=jr.key(0))


@pytest.fixture(scope="module")
def x():
    return jr.normal(jr.key(1), (32, CONFIG.d_model), jnp.float32)


def test_the_format_is_the_users(layer):
    q = me.quantize_experts(layer, "test-int4")
    w = q.experts.w_gate_up
    assert w.fmt == "test-int4" and w.format is INT4
    assert w.values.dtype == jnp.int8 and w.shape == layer.experts.w_gate_up.shape
    assert int(jnp.max(jnp.abs(w.values))) == 7  # its own rule, not int8's
    # The instance itself is accepted too.
    q2 = me.quantize_experts(layer, INT4)
    np.testing.assert_array_equal(q2.experts.w_down.values, q.experts.w_down.values)
    assert "test-int4" in me.internal.quant_formats()


_forward = eqx.filter_jit(lambda m, x: m(x)[0])


@pytest.mark.parametrize(
    "backend",
    ["tiled", "dense", "ragged_dot", GatheredGMM(), me.PallasTPUGMM(interpret=True)],
)
def test_layer_equals_dequantized(layer, x, backend):
    q = me.quantize_experts(layer.with_config(gmm_backend=backend), "test-int4")
    d = me.dequantize_experts(q)
    y, want = _forward(q, x[:4]), _forward(d, x[:4])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    # Quantized, not the float layer: a 4-bit grid moves the output.
    assert float(jnp.max(jnp.abs(want - _forward(layer, x[:4])))) > 1e-3


@eqx.filter_jit
def _value_and_grad(model, x, mesh):
    def loss(model_x):
        y, stats = model_x[0](model_x[1], mesh=mesh)
        return jnp.sum(jnp.sin(y)), stats

    return eqx.filter_value_and_grad(loss, has_aux=True)((model, x))


def test_mesh_fallback(layer, x):
    q = me.quantize_experts(layer.with_config(buffer_factor=0.1), "test-int4")
    d = me.dequantize_experts(q)
    (loss_q, stats), (g_q, gx_q) = _value_and_grad(q, x, mesh(8))
    (loss_d, _), (_, gx_d) = _value_and_grad(d, x, mesh(8))
    assert bool(stats.fallback_used)
    np.testing.assert_allclose(loss_q, loss_d, rtol=1e-6)
    np.testing.assert_allclose(gx_q, gx_d, rtol=1e-5, atol=1e-6)
    assert g_q.experts.w_gate_up.values is None  # a constant for autodiff


def test_bad_formats():
    class Nameless(Int4):
        name: ClassVar[str] = ""

    with pytest.raises(ValueError, match="non-empty str"):
        me.register_quant_format(Nameless())

    class Other(Int4):
        pass

    with pytest.raises(ValueError, match="'test-int4' is taken by Int4"):
        me.register_quant_format(Other())
    with pytest.raises(TypeError, match="AbstractQuantFormat"):
        me.register_quant_format("test-int4")
    with pytest.raises(ValueError, match="Unknown quantized format `fmt` 'int3'"):
        _quant.quantize(jnp.zeros((2, 8, 8)), "int3")
    values = jnp.zeros((2, 8, 8), jnp.int8)
    with pytest.raises(
        ValueError, match="scales` of format 'test-int4' must be uint32"
    ):
        me.QuantizedArray(values, jnp.zeros((2, 1, 8), jnp.float32), "test-int4", "f4")
    with pytest.raises(ValueError, match="`parts` applies to formats stored in parts"):
        me.QuantizedArray(
            values, jnp.zeros((2, 1, 8), jnp.uint32), "test-int4", "f4", parts=2
        )
