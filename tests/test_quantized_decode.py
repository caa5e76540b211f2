"""Quantized experts at fewer rows than experts (decode): the gathering backend
takes each row's expert's stored bytes and block scales and dequantizes only those,
with the outputs and gradients of dequantizing every expert first."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import compile_as_users

import moe_eqx as me
from moe_eqx import _quant
from moe_eqx._gmm._base import gmm_ffn
from moe_eqx._gmm.gathered import GatheredGMM

FORMATS = ("float8_e4m3fn", "mxfp4", "int8")
G, H, F = 4, 64, 32  # experts, d_model, d_ff (multiples of 32 for MXFP4)
# `M` rows: one (a single decode token's pair) and three whose last is past
# `sum(group_sizes)`, with empty groups between.
SIZES = {1: [0, 0, 1, 0], 3: [1, 0, 0, 1]}


def _weights(seed, shape):
    """Normal values scaled by a power of two per expert and per row, so that every
    expert's blocks have their own scales."""
    key1, key2, key3 = jr.split(jr.key(seed), 3)
    w = jr.normal(key1, shape, jnp.float32)
    per_row = jnp.exp2(jr.randint(key2, (*shape[:-1], 1), -2, 2))
    per_expert = jnp.exp2(jr.randint(key3, (shape[0], 1, 1), -2, 2))
    return w * per_row * per_expert / shape[-2]


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request):
    fmt = request.param
    return (
        fmt,
        _quant.quantize(_weights(0, (G, H, 2 * F)), fmt),
        _quant.quantize(_weights(1, (G, F, H)), fmt),
    )


def _new(x, w1, w2, sizes):
    return GatheredGMM().ffn(x, w1, w2, sizes)


def _old(x, w1, w2, sizes):
    """The dequantize-whole version: every expert's float weights, then gathered."""
    return gmm_ffn(GatheredGMM(), x, w1, w2, sizes)


def _value_and_grads(ffn):
    """`(out, d loss / d x, d loss / d w_down)`: `w_down` is float here (a layer may
    hold one weight quantized and the other float), the gate-up weight quantized."""

    def loss(x, w2, w1, sizes):
        return jnp.sum(jnp.sin(ffn(x, w1, w2, sizes)))

    def run(x, w1, w2, w2_float, sizes):
        grads = jax.grad(loss, argnums=(0, 1))(x, w2_float, w1, sizes)
        return ffn(x, w1, w2, sizes), *grads

    return jax.jit(run)


_run_new, _run_old = _value_and_grads(_new), _value_and_grads(_old)


@pytest.mark.parametrize("m", sorted(SIZES))
def test_gathered_quantized_equals_dequantize_whole(quantized, m):
    _, w1, w2 = quantized
    x = jr.normal(jr.key(m), (m, H), jnp.float32)
    sizes = jnp.asarray(SIZES[m], jnp.int32)
    w2_float = w2.dequantize()
    got = _run_new(x, w1, w2, w2_float, sizes)
    want = _run_old(x, w1, w2, w2_float, sizes)
    # Equal up to float32 rounding: the same products, summed in XLA's order.
    for a, b in zip(got, want, strict=True):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale)
    out, dx, dw2 = got
    assert np.all(np.asarray(out[sum(SIZES[m]) :]) == 0)
    assert np.any(np.asarray(out[: sum(SIZES[m])]) != 0)
    assert np.any(np.asarray(dw2) != 0) and np.any(np.asarray(dx) != 0)
    # Each expert's scales matter: with two experts' scales swapped (what gathering
    # another row's scales would give), the rows of the used experts change.
    used = int(np.flatnonzero(SIZES[m])[0])
    other = (used + 1) % G
    swap = jnp.arange(G).at[used].set(other).at[other].set(used)
    wrong = dataclasses.replace(w1, scales=w1.scales[swap])
    assert not np.allclose(_run_old(x, wrong, w2, w2_float, sizes)[0], out)


def _float_shapes(jaxpr):
    """`(shape, dtype)` of every float value any equation of `jaxpr` (and of the
    jaxprs inside it) produces."""
    out = set()
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if jnp.issubdtype(v.aval.dtype, jnp.floating):
                out.add(tuple(v.aval.shape))
        for sub in _sub_jaxprs(list(eqn.params.values())):
            out |= _float_shapes(sub)
    return out


def _sub_jaxprs(params):
    for p in params:
        if isinstance(p, list | tuple):
            yield from _sub_jaxprs(p)
        elif hasattr(p, "eqns"):
            yield p
        elif hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):  # a closed jaxpr
            yield p.jaxpr


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_float_copy_of_all_experts(fmt):
    """The traced decode step (the tiled backend at one row, which gathers) holds
    one row's `[K, N]` float matrices and never a `[G, K, N]` one; the
    dequantize-whole version does build them (the check can fail)."""
    w1 = jax.eval_shape(lambda: _quant.quantize(jnp.zeros((G, H, 2 * F)), fmt))
    w2 = jax.eval_shape(lambda: _quant.quantize(jnp.zeros((G, F, H)), fmt))
    x, sizes = jnp.zeros((1, H)), jnp.asarray(SIZES[1], jnp.int32)
    whole = {(G, H, 2 * F), (G, F, H)}

    def forward(ffn):
        return lambda x, w1, w2: ffn(x, w1, w2, sizes)

    def grad_of(ffn):
        return jax.grad(lambda x, w1, w2: jnp.sum(ffn(x, w1, w2, sizes)))

    def float_shapes(fn):
        return _float_shapes(jax.make_jaxpr(fn)(x, w1, w2).jaxpr)

    for ffn in (me.TiledGMM().ffn, _new):
        for fn in (forward(ffn), grad_of(ffn)):
            shapes = float_shapes(fn)
            assert {(H, 2 * F), (F, H)} <= shapes
            assert not whole & shapes, whole & shapes
    assert whole <= float_shapes(forward(_old))


def test_layer_decode_step_gathers_quantized_experts():
    """A layer's decode step on one device (3 tokens, top-2 of 16 experts: 6 rows):
    its grouped matmuls gather, and the quantized layer's output and `x`-gradient
    are the dequantized layer's."""
    cfg = me.MoEConfig(d_model=H, d_ff=F, num_experts=16, top_k=2)
    q = me.quantize_experts(me.MoELayer(cfg, key=jr.key(5)), "mxfp4")
    d = me.dequantize_experts(q)
    x = jr.normal(jr.key(6), (3, H), jnp.float32)

    def compiled(layer):
        arrays, static = eqx.partition(layer, eqx.is_array)

        def value_and_grad(arrays, x):
            model = eqx.combine(arrays, static)
            return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(model(x)[0])))(x)

        lowered = jax.jit(value_and_grad).lower(arrays, x)
        return lowered.as_text(debug_info=True), lowered.compile()(arrays, x)

    (text, (v_q, g_q)), (_, (v_d, g_d)) = compiled(q), compiled(d)
    assert "moe_eqx.gmm.gathered" in text and "moe_eqx.gmm.tiled" not in text
    np.testing.assert_allclose(v_q, v_d, rtol=1e-6)
    np.testing.assert_allclose(g_q, g_d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "biases"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_memory_within_the_stored_experts(fmt, bias):
    """The experts' compiled temporaries at 1, 48 and 64 rows of 64 experts
    (`d_model = d_ff = 256`, bfloat16 rows; below 64 rows they gather, the same
    code at every count; at 64 the loop runs): at most 1.25x the quantized
    experts' stored bytes, forward and backward, with and without per-expert biases (GPT-OSS's). Gathering one float
    matrix per row (3x at 48 rows) or dequantizing every expert to fold the biases in
    (5-12x) would break it."""
    g, h, f = 64, 256, 256
    options = me.ExpertOptions(bias=bias)
    cfg = me.MoEConfig(
        d_model=h, d_ff=f, num_experts=g, top_k=2, expert_options=options
    )
    experts = me.quantize_experts(me.MoELayer(cfg, key=jr.key(0)), fmt).experts
    stored = experts.w_gate_up.nbytes + experts.w_down.nbytes
    params, static = eqx.partition(experts, eqx.is_inexact_array)

    def forward(params, x, sizes):
        return eqx.combine(params, static)(x, sizes)

    def backward(params, x, sizes):
        def loss(params, x):
            y = forward(params, x, sizes)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))

        return jax.grad(loss, argnums=(0, 1))(params, x)

    for rows in (1, 48, 64):
        x = jnp.zeros((rows, h), jnp.bfloat16)
        sizes = jnp.zeros((g,), jnp.int32).at[jnp.arange(rows) % g].add(1)
        for fn in (forward, backward):
            compiled = compile_as_users(jax.jit(fn).lower(params, x, sizes))
            temp = compiled.memory_analysis().temp_size_in_bytes
            assert temp <= 1.25 * stored, (rows, fn.__name__, temp / stored)
