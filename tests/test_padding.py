"""Any number of tokens under a mesh: padded inside to a multiple of the devices,
the padding routed nowhere, sent nowhere, counted in no statistic, given no
gradient; outputs and gradients equal the oracle's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_matches_oracle, make_layer, mesh, tokens

import moe_eqx as me


@pytest.mark.parametrize(
    ("num_tokens", "overrides"),
    [
        (1, {}),
        (3, dict(num_slots=1, buffer_factor=0.3, bias_kind="one_shard")),
        (7, dict(on_overflow="drop", buffer_factor=None, shared_d_ff=8)),
    ],
)
def test_fewer_tokens_than_devices(getkey, num_tokens, overrides):
    """EP8 with 1, 3 or 7 tokens (decoding a small batch): every pair of the real
    tokens is computed once (`recv_pairs` sums to `T * k`), the counts are theirs,
    and outputs and every gradient equal the oracle's."""
    layer = make_layer(getkey(), mesh_size=8, **overrides)
    x = tokens(getkey(), num_tokens)
    stats = assert_matches_oracle(layer, x, mesh(8))
    np.testing.assert_array_equal(stats.expert_counts, layer.router(x).counts)
    assert int(stats.nan_tokens) == 0


def test_tokens_not_divisible_by_the_data_axes(getkey):
    """A 2 x 4 data x expert mesh (explicit axes, `jax.make_mesh`'s default) and a
    `[2, 3, d_model]` batch: 6 tokens over 8 devices; `y` has `x`'s shape and
    sharding (so a residual works), and matches the oracle."""
    layer = make_layer(getkey(), mesh_size=4, shared_d_ff=8)
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices("cpu"))
    x = jax.random.normal(getkey(), (2, 3, 16), jnp.float32)
    x = jax.device_put(x, jax.NamedSharding(m, jax.P("data")))
    y, stats = layer(x, mesh=m)
    assert y.shape == x.shape
    assert y.sharding.is_equivalent_to(x.sharding, x.ndim)
    _ = x + y
    ref = me.reference_moe(layer, jnp.asarray(np.asarray(x)))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)
    assert int(jnp.sum(stats.recv_pairs)) == 6 * 2 and int(stats.lost_pairs) == 0
    stats = assert_matches_oracle(layer, jnp.asarray(np.asarray(x)).reshape(6, 16), m)
    assert int(stats.dropped_pairs) == 0
