"""The all-gather exchange (`exchange="allgather"`): tokens all-gathered over the expert
axis, each shard computing its own experts' pairs, outputs reduce-scattered. Output
and every gradient equal the dense oracle `me.reference_moe` and the dense exchange
(EP8 and a 2x4 mesh); stats equal the dense exchange's where they count the same
things. Small shapes; each layer/mesh pair compiles once per module."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    layer_value_and_grad,
    make_layer,
    mesh,
    routing_bias,
    tokens,
    with_bias,
)

import moe_eqx as me

T = 64  # tokens over all shards


def _layers(**overrides):
    """The same layer with the all-gather and the dense exchange."""
    key = jr.key(0)
    return tuple(
        make_layer(key, mesh_size=8, bias_kind="zipf", exchange=e, **overrides)
        for e in ("allgather", "dense")
    )


@pytest.fixture(scope="module")
def worst_case():
    return _layers(buffer_factor=None)


def _biased(layers, kind):
    bias = routing_bias(kind, 8, 2, 8)
    return tuple(with_bias(layer, bias) for layer in layers)


@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_shard"])
def test_ep8_matches_oracle_and_dense_stats(worst_case, kind):
    ag, dense = _biased(worst_case, kind)
    x = tokens(jr.key(1), T)
    stats = assert_matches_oracle(ag, x, mesh(8))
    _, ref, _, _ = layer_value_and_grad(dense, x, mesh(8))
    assert not bool(stats.overflow) and int(stats.dropped_pairs) == 0
    for name in ("recv_pairs", "wire_rows", "expert_counts", "max_over_mean"):
        np.testing.assert_array_equal(
            getattr(stats, name), getattr(ref, name), err_msg=name
        )
    # A shard counts only the gathered tokens with a pair of its own.
    assert int(jnp.sum(stats.wire_rows)) < 8 * T


def test_block_rows_is_zero_and_exchange_resolves():
    assert isinstance(
        me.internal.make_exchange("allgather", axis_name="expert", block_rows=0),
        me.AllGatherExchange,
    )
    for platform in ("cpu", "gpu", "tpu"):
        assert me.internal.exchange_name("allgather", platform) == "allgather"
    with pytest.raises(ValueError, match="exchange"):
        me.MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=2, exchange="gather")


def test_mesh_2x4_matches_oracle():
    layer = make_layer(jr.key(0), mesh_size=4, exchange="allgather", buffer_factor=None)
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices("cpu")[:8])
    assert_matches_oracle(layer, tokens(jr.key(3), T), m)


def test_instance_exchange_matches_oracle(worst_case):
    """An `AllGatherExchange` instance in the config runs the same path."""
    ag, _ = worst_case
    layer = ag.with_config(exchange=me.AllGatherExchange(axis_name="expert"))
    assert_matches_oracle(layer, tokens(jr.key(4), T), mesh(8))
