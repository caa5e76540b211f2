"""No recompiles: new values (weights, tokens, routing that overflows) reuse one trace."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from helpers import make_layer, mesh, tokens, with_bias


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
