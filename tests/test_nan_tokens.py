"""Tokens with a non-finite value are routed nowhere: their output is NaN, and
nothing else changes (the other tokens' outputs, the experts' and shared expert's
gradients, the counts, the losses, which pairs fit the buffers); `stats.nan_tokens`
counts them. (The router's weight meets them in its matmul: its gradient is NaN in
such a batch; see `Router.__call__`.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_layer, mesh, tokens

import moe_eqx as me


def _poison(x, rows, value=jnp.nan):
    return x.at[rows, 3].set(value)


@pytest.mark.parametrize(
    ("shards", "overrides"),
    [
        (1, dict(shared_d_ff=8)),
        (4, dict(num_slots=1, buffer_factor=0.5, shared_d_ff=8)),
        (4, dict(on_overflow="drop", buffer_factor=None, num_identity_experts=2)),
        (4, dict(buffer_factor=0.5, gmm_backend="dense", exchange="dense")),
    ],
    ids=["one-device", "ep4-fallback-slots", "ep4-drop-identity", "ep4-dense"],
)
def test_nan_tokens_change_nothing_else(getkey, shards, overrides):
    layer = make_layer(getkey(), mesh_size=shards, **overrides)
    x = tokens(getkey(), 64)
    bad = np.array([1, 5, 6, 40, 63])
    good = np.setdiff1d(np.arange(64), bad)
    x_bad = _poison(x, bad).at[6, 0].set(jnp.inf)
    m = mesh(shards) if shards > 1 else None
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(params, x):
        y, stats = eqx.combine(params, static)(x, mesh=m)
        # Only the finite tokens' outputs enter the loss.
        return jnp.sum(jnp.sin(y[good])), (y, stats)

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params, x_bad
    )

    def ref_loss(params):
        y = me.reference_moe(eqx.combine(params, static), x[good])
        return jnp.sum(jnp.sin(y)), y

    (_, y_ref), grads_ref = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(params)
    assert bool(jnp.all(jnp.isnan(y[bad])))
    np.testing.assert_allclose(y[good], y_ref, rtol=2e-5, atol=2e-5)
    paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    checked = 0
    for (path, got), want in zip(paths, jax.tree.leaves(grads_ref), strict=True):
        if jax.tree_util.keystr(path) == ".router.weight":
            continue  # the NaN tokens meet it in its matmul (see `Router.__call__`)
        assert bool(jnp.all(jnp.isfinite(got))), jax.tree_util.keystr(path)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        checked += 1
    assert checked >= 2
    assert int(stats.nan_tokens) == len(bad)
    assert int(stats.lost_pairs) == 0 and int(stats.dropped_pairs) == 0
    routing = layer.router(x[good])
    np.testing.assert_array_equal(stats.expert_counts, routing.counts)
    # The losses are the finite tokens' (one shard: the router's own over them).
    if shards == 1:
        np.testing.assert_allclose(
            stats.load_balance_loss, routing.load_balance_loss, rtol=1e-5
        )
        np.testing.assert_allclose(
            stats.router_z_loss, routing.router_z_loss, rtol=1e-5
        )
    assert bool(jnp.isfinite(stats.load_balance_loss))
    assert bool(jnp.isfinite(stats.router_z_loss))


def test_nan_tokens_take_no_buffer_room(getkey):
    """With `"drop"` and half the tokens NaN, the healthy tokens' pairs all fit the
    buffers sized for all tokens: NaN tokens no longer pile onto experts 0 and 1
    (which dropped healthy pairs there)."""
    layer = make_layer(getkey(), mesh_size=4, on_overflow="drop", buffer_factor=1.0)
    x = tokens(getkey(), 128)
    bad = np.arange(0, 128, 2)
    y, stats = jax.jit(lambda l, x: l(x, mesh=mesh(4)))(layer, _poison(x, bad))
    assert int(stats.dropped_pairs) == 0 and int(stats.nan_tokens) == 64
    assert int(jnp.sum(stats.recv_pairs)) == 64 * 2
    good = np.setdiff1d(np.arange(128), bad)
    np.testing.assert_allclose(
        y[good], me.reference_moe(layer, x[good]), rtol=2e-5, atol=2e-5
    )
