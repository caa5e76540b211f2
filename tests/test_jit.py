"""No recompiles: new values (weights, tokens, routing that overflows) reuse one trace."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from helpers import assert_nothing_lost, make_layer, mesh, tokens, with_bias


def test_one_trace_across_values_and_branches(getkey):
    layer = make_layer(getkey(), mesh_size=4, bias_kind="uniform", buffer_factor=2.0)
    m = mesh(4)
    traces = 0

    @eqx.filter_jit
    def f(layer, x):
        nonlocal traces
        traces += 1
        return layer(x, mesh=m)

    _, s1 = f(layer, tokens(getkey(), 64))
    perturbed = eqx.tree_at(lambda l: l.experts.w_down, layer, layer.experts.w_down * 2)
    f(perturbed, tokens(getkey(), 64))
    bias = jnp.zeros(8).at[0].set(20.0).at[1].set(19.0)
    _, s3 = f(with_bias(layer, bias), tokens(getkey(), 64))
    assert traces == 1
    assert not bool(s1.fallback_used) and bool(s3.fallback_used)
    assert_nothing_lost(s1, 64, 2)
    assert_nothing_lost(s3, 64, 2)


def test_single_device_one_trace(getkey):
    layer = make_layer(getkey())
    traces = 0

    @eqx.filter_jit
    def f(layer, x):
        nonlocal traces
        traces += 1
        return layer(x)

    for _ in range(3):
        f(layer, jr.normal(getkey(), (32, 16)))
    assert traces == 1


def test_training_steps_share_one_trace(getkey):
    import jax
    import optax

    import moe_eqx as me

    m = mesh(4)
    layer = me.shard_model(make_layer(getkey(), mesh_size=4), m)
    opt = optax.sgd(0.1)  # optax.adam mixes int and float under strict promotion
    state = opt.init(eqx.filter(layer, eqx.is_array))
    traces = 0

    @eqx.filter_jit
    def step(layer, state, x):
        nonlocal traces
        traces += 1

        def loss(layer):
            return jnp.mean(jnp.square(layer(x, mesh=m)[0] - 1.0))

        value, grads = eqx.filter_value_and_grad(loss)(layer)
        updates, state = opt.update(grads, state)
        return eqx.apply_updates(layer, updates), state, value

    x = tokens(getkey(), 64)
    losses = []
    for _ in range(3):
        layer, state, value = step(layer, state, x)
        losses.append(float(value))
    assert traces == 1
    assert losses[-1] < losses[0]
    assert isinstance(layer.experts.w_down, jax.Array)
