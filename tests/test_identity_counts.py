"""Identity experts' picks (LongCat-Flash) are counted in the stats, apart from the
routed experts' counts, and the selection-bias update balances all `E + I` columns."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import cpu_devices, tokens

import moe_eqx as me

E, I, K = 8, 2, 3


@pytest.fixture(scope="module")
def layer():
    config = me.MoEConfig(
        d_model=16,
        d_ff=24,
        num_experts=E,
        top_k=K,
        num_identity_experts=I,
        use_router_bias=True,
        norm_topk=False,
    )
    return me.MoELayer(config, key=jr.key(0))


def _picks(layer, x, valid):
    """Per-column pick counts of the valid tokens, from the router's own choice."""
    experts = np.asarray(layer.router(x).experts)[valid]
    return np.bincount(experts.ravel(), minlength=E + I)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_identity_picks_are_counted(layer, getkey, mesh_shape):
    """`stats.identity_counts` holds each identity expert's picks and
    `stats.expert_counts` still only the routed experts' (a NaN token counted in
    neither), on one device and expert parallel with a data axis."""
    x = tokens(getkey(), 32).at[5].set(jnp.nan)
    valid = np.arange(32) != 5
    want = _picks(layer, x, valid)
    assert want[E:].sum() > 0  # the case under test: some identity picks
    mesh = None
    if mesh_shape is not None:
        mesh = jax.make_mesh(mesh_shape, ("data", "expert"), devices=cpu_devices())
    _, stats = layer(x, mesh=mesh)
    np.testing.assert_array_equal(stats.expert_counts, want[:E])
    np.testing.assert_array_equal(stats.identity_counts, want[E:])
    assert int(stats.nan_tokens) == 1


def test_bias_update_covers_identity_columns(layer, getkey):
    """The update of an `[E + I]` bias moves every column toward the mean load over
    all of them, identity columns included."""
    x = tokens(getkey(), 32)
    _, stats = layer(x)
    bias = jnp.linspace(-0.5, 0.5, E + I, dtype=jnp.float32)
    new = me.update_router_bias(
        bias, stats.expert_counts, identity_counts=stats.identity_counts, rate=0.1
    )
    load = _picks(layer, x, np.ones(32, bool)).astype(np.float64)
    want = np.asarray(bias) + 0.1 * np.sign(load.mean() - load)
    np.testing.assert_allclose(new, want, rtol=1e-6)
    with pytest.raises(ValueError, match="identity_counts=stats.identity_counts"):
        me.update_router_bias(bias, stats.expert_counts)


def test_stats_of_a_layer_without_identity_experts(getkey):
    """Without identity experts `identity_counts` is empty."""
    layer = me.MoELayer(
        me.MoEConfig(d_model=16, d_ff=24, num_experts=E, top_k=2), key=getkey()
    )
    _, stats = layer(tokens(getkey(), 8))
    assert stats.identity_counts.shape == (0,)
