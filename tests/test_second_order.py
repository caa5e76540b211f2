"""Second derivatives through the layer with reverse mode outside: the gradient of a
gradient penalty plus `<grad, v>` (reverse over reverse, so a Hessian-vector product)
plus a directional derivative (reverse over forward), in the input and every
parameter (router weight, expert weights), and `jax.jacrev(jax.jacrev(loss))`, each
equal to the same transformation of the dense oracle `moe_eqx.reference_moe` (plain
JAX, differentiated by JAX), on one device and over an 8-device mesh in drop and
fallback modes, the fallback both passed through and really taken (adversarial
routing)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import make_layer, mesh, routing_bias, tokens, with_bias

import moe_eqx as me

ATOL = RTOL = 5e-5
TOKENS, D_MODEL = 32, 8

# (mesh size, config overrides). The fallback program serves two routings (the
# overflow predicate is traced): uniform, where the fallback's loop runs the capped
# trip once, and every token to experts 0 and 1, where shard 0 overflows and every
# shard runs the chunks.
CASES = {
    "one device": (1, dict()),
    "EP8 drop": (8, dict(on_overflow="drop")),
    "EP8 fallback": (8, dict(on_overflow="fallback")),
}
ROUTINGS = {"EP8 fallback": ("uniform", "one_expert")}


def _loss(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))


def _second_order(forward, params, static, x, v_params, v_x):
    """`(grads, jacrev2)`: the gradient in `(params, x)` of the gradient penalty
    `|d loss / dx|^2` plus `<d loss / d params, v_params>` (reverse over reverse: the
    gradient in `params` holds a Hessian-vector product in the parameters) plus the
    directional derivative along `(v_params, v_x)` (reverse over forward), and
    `jax.jacrev(jax.jacrev(loss))` in two entries of `x`."""

    def loss(params, x):
        return _loss(forward(eqx.combine(params, static), x))

    def penalty(params, x):
        g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, x)
        leaves = zip(jax.tree.leaves(g_params), jax.tree.leaves(v_params), strict=True)
        hvp = sum(jnp.vdot(a, b) for a, b in leaves)
        directional = jax.jvp(loss, (params, x), (v_params, v_x))[1]
        return jnp.sum(jnp.square(g_x)) + hvp + directional

    def of_corner(corner):
        return loss(params, x.at[0, :2].set(corner))

    return (
        jax.grad(penalty, argnums=(0, 1))(params, x),
        jax.jacrev(jax.jacrev(of_corner))(x[0, :2]),
    )


@pytest.fixture(scope="module")
def case_setup():
    """`case -> (layer, mesh, compiled second derivatives of ours, stats)`, built
    once per case (the routings of a case share its program)."""
    built = {}

    def get(case):
        if case in built:
            return built[case]
        num_shards, overrides = CASES[case]
        m = None if num_shards == 1 else mesh(num_shards)
        layer = make_layer(
            jr.key(3),
            d_model=D_MODEL,
            d_ff=8,
            num_experts=8,
            top_k=2,
            use_router_bias=True,
            **overrides,
        )
        params, static = eqx.partition(layer, eqx.is_inexact_array)

        def ours(layer, x):
            return layer(x, mesh=m)[0]

        @jax.jit
        def run(params, x, v_params, v_x):
            stats = eqx.combine(params, static)(x, mesh=m)[1]
            out = _second_order(ours, params, static, x, v_params, v_x)
            return out, stats

        built[case] = (layer, run)
        return built[case]

    return get


@eqx.filter_jit
def _oracle(params, static, x, v_params, v_x):
    return _second_order(me.reference_moe, params, static, x, v_params, v_x)


@pytest.mark.parametrize(
    ("case", "routing"),
    [(c, r) for c in CASES for r in ROUTINGS.get(c, ("uniform",))],
)
def test_second_derivatives_match_the_oracle(case_setup, case, routing):
    layer, run = case_setup(case)
    num_shards = CASES[case][0]
    bias = routing_bias(routing, 8, 2, num_shards)
    layer = with_bias(layer, bias)
    kx, kp, kv = jr.split(jr.key(len(case) + len(routing)), 3)
    x = tokens(kx, TOKENS, D_MODEL)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jr.split(kp, len(leaves))
    v_params = jax.tree.unflatten(
        treedef, [jr.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
    )
    v_x = jr.normal(kv, x.shape)

    got, stats = run(params, x, v_params, v_x)
    assert int(stats.dropped_pairs) == 0  # the oracle computes every pair
    taken = routing == "one_expert"
    assert bool(stats.fallback_used) == (taken and case == "EP8 fallback")
    grads, jacrev2 = got
    want_grads, want_jacrev2 = _oracle(params, static, x, v_params, v_x)
    # Every parameter's second derivatives: the router's weight (and its selection
    # bias, a constant for the derivatives) and both expert weights; and the input's.
    for name, a, b in (
        ("penalty", grads, want_grads),
        ("jacrev(jacrev)", jacrev2, want_jacrev2),
    ):
        paths = jax.tree_util.tree_flatten_with_path(a)[0]
        assert len(paths) == len(jax.tree.leaves(b))
        for (path, x_got), x_want in zip(paths, jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(
                x_got,
                x_want,
                atol=ATOL,
                rtol=RTOL,
                err_msg=f"{name} {jax.tree_util.keystr(path)}",
            )
