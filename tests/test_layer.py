"""Single-device layer against the dense oracle; bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_matches_oracle, make_layer, mesh, tokens

import moe_eqx as me


@pytest.mark.parametrize(
    "overrides",
    [
        dict(score_func="softmax"),
        dict(score_func="sigmoid"),
        dict(score_func="softmax", norm_topk=False),
        dict(score_func="sigmoid", norm_topk=False),
        dict(num_groups=4, top_groups=2),
        dict(score_func="sigmoid", num_groups=4, top_groups=2, top_k=3),
    ],
    ids=[
        "softmax",
        "sigmoid",
        "softmax-unnormalised",
        "sigmoid-unnormalised",
        "grouped",
        "sigmoid-grouped",
    ],
)
def test_single_device_matches_oracle(getkey, overrides):
    layer = make_layer(getkey(), **overrides)
    x = tokens(getkey(), 48)
    stats = assert_matches_oracle(layer, x, None)
    assert not bool(stats.overflow)
    assert int(stats.dropped_pairs) == 0
    assert int(jnp.sum(stats.expert_counts)) == 48 * layer.config.top_k


def test_oracle_is_independent_of_dispatch(getkey):
    # Hand-written per-token loop over the documented parameter layout.
    layer = make_layer(getkey())
    x = tokens(getkey(), 6)
    r = layer.router(x)
    w_gu, w_dn = np.asarray(layer.experts.w_gate_up), np.asarray(layer.experts.w_down)
    f = layer.config.d_ff
    want = np.zeros((6, 16), np.float32)
    for t in range(6):
        for j in range(2):
            e = int(r.experts[t, j])
            h = np.asarray(x[t]) @ w_gu[e]
            g, u = h[:f], h[f:]
            want[t] += float(r.weights[t, j]) * ((g / (1 + np.exp(-g)) * u) @ w_dn[e])
    np.testing.assert_allclose(me.reference_moe(layer, x), want, rtol=1e-4, atol=1e-5)
    y, _ = layer(x)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


def test_bfloat16_tokens(getkey):
    layer = make_layer(getkey())
    x = tokens(getkey(), 32)
    y, _ = layer(x.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        y.astype(jnp.float32), me.reference_moe(layer, x), atol=0.1, rtol=0.1
    )


def test_wrong_width_is_rejected(getkey):
    layer = make_layer(getkey())
    with pytest.raises((ValueError, TypeError)):
        layer(jnp.zeros((8, 15)))


@pytest.mark.parametrize("shape", [(2, 8), (3, 2, 4), (16,)])
def test_leading_dimensions(getkey, shape):
    """`x: [..., d_model]`: the leading dimensions are tokens; the output keeps them."""
    layer = make_layer(getkey())
    x = jr.normal(getkey(), (*shape, 16))
    y, stats = layer(x)
    assert y.shape == x.shape
    flat, _ = layer(x.reshape(-1, 16))
    np.testing.assert_allclose(y.reshape(-1, 16), flat, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, me.reference_moe(layer, x), rtol=2e-5, atol=2e-5)
    assert int(stats.lost_pairs) == 0
    assert int(jnp.sum(stats.recv_pairs)) == x.size // 16 * 2


@pytest.mark.parametrize(
    "overrides",
    [
        dict(on_overflow="drop", buffer_factor=None),
        dict(buffer_factor=0.5),  # the fallback runs
        dict(buffer_factor=0.5, num_slots=1),  # and slot copies of the hot experts
        dict(
            buffer_factor=0.5,
            num_slots=1,
            activation="relu2",
            expert_options=me.ExpertOptions(weight_on_input=True),
            score_func="sigmoid",
            norm_topk=False,
        ),  # fmt: skip
        dict(
            on_overflow="drop",
            buffer_factor=None,
            activation=me.ClampedSwiGLU(limit=1.0),
        ),
    ],
    ids=[
        "drop",
        "fallback",
        "fallback+slots",
        "relu2+input-weights",
        "swiglu_oai+drop",
    ],  # fmt: skip
)
def test_bfloat16_weights_expert_parallel(getkey, overrides):
    """bfloat16 expert weights through the exchange, the fallback and the slot
    copies: outputs and every gradient (float32 sums, rounded once) within bfloat16
    precision of the float32 oracle of the same weights, nothing lost."""
    from helpers import routing_bias, with_bias

    config = me.MoEConfig(
        d_model=16, d_ff=24, num_experts=8, top_k=2, use_router_bias=True, **overrides
    )
    layer = me.MoELayer(config, key=getkey(), dtype=jnp.bfloat16)
    layer = with_bias(layer, routing_bias("zipf", 8, 2, 4, seed=3))
    assert layer.experts.w_gate_up.dtype == jnp.bfloat16
    x = tokens(getkey(), 64)
    m = mesh(4)
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(forward):
        def f(params, x):
            y = forward(eqx.combine(params, static), x).astype(jnp.float32)
            return jnp.sum(jnp.sin(y)), y

        return f

    grad = jax.value_and_grad(loss(lambda l, x: l(x, mesh=m)[0]), (0, 1), has_aux=True)
    (_, y), (g_params, g_x) = jax.jit(grad)(params, x)
    ref = jax.value_and_grad(loss(me.reference_moe), (0, 1), has_aux=True)
    (_, y_ref), (r_params, r_x) = jax.jit(ref)(params, x)
    stats = jax.jit(lambda l, x: l(x, mesh=m)[1])(layer, x)
    if "buffer_factor" in overrides and overrides["buffer_factor"]:
        assert bool(stats.fallback_used)
    np.testing.assert_allclose(y, y_ref, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(g_x, r_x, atol=2e-2, rtol=2e-2)
    for got, want in zip(jax.tree.leaves(g_params), jax.tree.leaves(r_params)):
        assert got.dtype == want.dtype
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) + 1e-6
        err = float(
            jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
        )
        assert err <= 2e-2 * scale, (err, scale)


def test_compiled_initialisation_draws_the_same_layer(monkeypatch):
    """Off the CPU a layer's arrays are drawn in one compiled program (each eager
    operation is a compilation of its own there): the same arrays as drawn one
    operation at a time (up to the last bit, where XLA folds the scale into the
    draw), every optional array included; a setting that cannot be hashed (so
    cannot key a compiled program) is drawn eagerly, bit for bit."""
    from moe_eqx import _layer

    cfg = me.MoEConfig(
        d_model=32,
        d_ff=16,
        num_experts=4,
        top_k=2,
        use_router_bias=True,
        shared_d_ff=8,
        shared_gate=True,
        output=me.OutputTransform(bias=True, norm_eps=1e-6),
        expert_options=me.ExpertOptions(bias=True),
    )
    eager = me.MoELayer(cfg, dtype=jnp.bfloat16, key=jr.key(3))
    calls = []
    compiled = _layer._initial_fields_jit

    def counted(*args):
        calls.append(args)
        return compiled(*args)

    monkeypatch.setattr(_layer, "_initial_fields_jit", counted)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    built = me.MoELayer(cfg, dtype=jnp.bfloat16, key=jr.key(3))
    assert len(calls) == 1
    leaves = jax.tree.leaves(eager)
    assert len(leaves) == len(jax.tree.leaves(built)) == 12
    assert jax.tree.structure(eager) == jax.tree.structure(built)
    for a, b in zip(leaves, jax.tree.leaves(built), strict=True):
        assert a.dtype == b.dtype
        # One float32 ulp, or one bfloat16 ulp where that rounding flips.
        rtol = 1e-6 if a.dtype != jnp.bfloat16 else 2.0**-7
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=0
        )

    def unhashable(*args):
        raise TypeError("unhashable")

    monkeypatch.setattr(_layer, "_initial_fields_jit", unhashable)
    again = me.MoELayer(cfg, dtype=jnp.bfloat16, key=jr.key(3))
    for a, b in zip(leaves, jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
