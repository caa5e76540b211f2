"""`MoEConfig.shared_in_norm`: shared experts scored by the router and normalised
with the chosen routed experts (Inkling), checked against the dense oracle on one
device and EP4, and its settings validated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh
from test_hf_config import H

import moe_eqx as me


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(3), (32, H), jnp.float32)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(shared_d_ff=10), "positive multiple"),
        (dict(shared_d_ff=0), "positive multiple"),
        (dict(shared_gate=True), "no `shared_gate`"),
        (dict(score_func="softmax"), "per-expert scores"),
        (dict(shared_in_norm=-1), "`shared_in_norm` must be an integer >= 0"),
    ],
)
def test_shared_in_norm_is_validated(fields, message):
    base = dict(score_func="sigmoid", shared_d_ff=12, shared_in_norm=4)
    with pytest.raises(ValueError, match=message):
        me.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, **(base | fields))


@pytest.mark.parametrize("num_shards", [1, 4])
def test_shared_in_norm_layer_matches_the_oracle(num_shards, x):
    """A drawn layer with `shared_in_norm` (no Hugging Face block) equals the dense
    oracle on one device and under EP4, with forced expert ids (routing replay)
    too; each token's routed and shared weights sum to 1."""
    config = me.MoEConfig(
        d_model=H, d_ff=8, num_experts=8, top_k=2, score_func="sigmoid",
        shared_d_ff=16, shared_in_norm=2, use_router_bias=True, shared_scale=1.5,
        buffer_factor=None,
    )  # fmt: skip
    layer = me.MoELayer(config, key=jax.random.key(0))
    routing = layer.router(x)
    total = routing.weights.sum(-1) + routing.shared_weights.sum(-1)
    np.testing.assert_allclose(np.asarray(total), 1.0, rtol=1e-6)
    m = None if num_shards == 1 else mesh(num_shards)
    forced = jnp.roll(routing.experts, 1, axis=0)
    for kw in ({}, dict(experts=forced)):
        y, _ = layer(x, mesh=m, **kw)
        y_ref = me.reference_moe(layer, x, **kw)
        scale = np.abs(np.asarray(y_ref)).max()
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * scale)
