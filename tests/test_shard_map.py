"""Expert-parallel layer (shard_map over 1-8 simulated devices) against the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    assert_nothing_lost,
    make_layer,
    mesh,
    received_token_by_token,
    tokens,
)
from jax.sharding import PartitionSpec as P

import moe_eqx as me

ROUTINGS = ["uniform", "zipf", "one_expert", "one_shard"]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "nodedup"])
@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
def test_expert_parallel_matches_oracle(getkey, num_shards, dedup, routing):
    layer = make_layer(
        getkey(), mesh_size=num_shards, bias_kind=routing, dedup=dedup, top_k=3
    )
    x = tokens(getkey(), 64)
    stats = assert_matches_oracle(layer, x, mesh(num_shards))
    # Rows and pairs each shard receives, counted token by token from the routing
    # (not from the stats the predicate itself uses).
    local = 8 // num_shards
    tokens_per_shard = 64 // num_shards
    experts = np.asarray(layer.router(x).experts)
    rows, pairs = received_token_by_token(experts, num_shards, local, dedup)
    np.testing.assert_array_equal(stats.recv_pairs, pairs)
    np.testing.assert_array_equal(stats.wire_rows, rows)
    if routing in ("one_expert", "one_shard"):
        # Every token sends its pairs on shard 0 there.
        assert pairs[0] == 64 * min(3, local)
    # The exact predicate against the buffer (B = 2 * T_local * k), and the fallback.
    buffer = 2 * tokens_per_shard * 3
    expect = bool(pairs.max() > buffer or rows.max() > buffer)
    assert bool(stats.overflow) == expect
    assert bool(stats.fallback_used) == expect
    if routing == "one_shard" and num_shards >= 4:
        assert expect


def test_dedup_sends_one_row_per_token_and_shard(getkey):
    layer = make_layer(getkey(), mesh_size=4, top_k=4, buffer_factor=None)
    x = tokens(getkey(), 64)
    _, stats = jax.jit(lambda l, x: l(x, mesh=mesh(4)))(layer, x)
    assert_nothing_lost(stats, 64, 4)
    r = layer.router(x)
    distinct = sum(len(set((np.asarray(row) // 2).tolist())) for row in r.experts)
    assert int(jnp.sum(stats.wire_rows)) == distinct
    np.testing.assert_allclose(stats.dedup_ratio, distinct / (64 * 4), rtol=1e-6)


def test_stats_identical_on_all_shards(getkey):
    layer = make_layer(getkey(), mesh_size=4, bias_kind="zipf")
    x = tokens(getkey(), 64)
    _, stats = jax.jit(lambda l, x: l(x, mesh=mesh(4)))(layer, x)
    assert_nothing_lost(stats, 64, 2)
    for leaf in jax.tree.leaves(stats):
        # Replicated outputs: every device holds the same value.
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


def test_bad_mesh_inputs(getkey):
    layer = make_layer(getkey(), num_experts=6)
    with pytest.raises(ValueError, match="num_experts"):
        layer(tokens(getkey(), 16), mesh=mesh(4))
    layer = make_layer(getkey())
    # A token count the devices do not divide is padded, not refused.
    assert layer(tokens(getkey(), 18), mesh=mesh(4))[0].shape == (18, 16)
    bad_axis = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2])
    with pytest.raises(ValueError, match="axis_name"):
        layer(tokens(getkey(), 16), mesh=bad_axis)


def _in_shard_map(num_devices, fn, *args, axes=("expert",), shape=None, split=False):
    """`fn(*args)` inside a `shard_map` over `num_devices` CPU devices: the last
    argument split over every axis, the others replicated (`split`: the first is a
    layer whose experts are split over its axis)."""
    devices = jax.devices("cpu")[:num_devices]
    m = jax.make_mesh(
        shape or (num_devices,),
        axes,
        devices=devices,
        axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
    )
    *rest, x = args
    specs = [jax.tree.map(lambda _: P(), a) for a in rest]
    if split:
        specs[0] = me.shard_specs(rest[0])
    specs = (*specs, P(axes))
    # Jitted: one compilation, not one per operation of an eager shard_map.
    return jax.jit(
        jax.shard_map(
            fn, mesh=m, in_specs=specs, out_specs=(P(axes), P()), check_vma=False
        )
    )(*rest, x)


def test_shard_body_checks_divisibility(getkey):
    """Called directly (inside a user's own `shard_map`), the shard body names what is
    wrong when the experts do not split evenly over the axis."""
    layer = make_layer(getkey())  # 8 experts
    with pytest.raises(
        ValueError, match=r"`num_experts` \(8\).*mesh axis 'expert' \(3\)"
    ):
        _in_shard_map(3, me.expert_parallel_shard, layer, tokens(getkey(), 6))


def test_shard_body_checks_its_arguments(getkey):
    """The per-shard entry point checks what `MoELayer.__call__` checks: the axis it
    runs over and its size, the tokens' dtype and shape."""
    layer = make_layer(getkey())
    x = tokens(getkey(), 16)
    with pytest.raises(ValueError, match=r"`num_shards` \(4\).*'expert' \(8\)"):
        _in_shard_map(
            8, lambda l, x: me.expert_parallel_shard(l, x, num_shards=4), layer, x
        )
    # The runtime type check (on in this suite) or, without it, the body's own.
    with pytest.raises(TypeError, match="floating-point|Float"):
        _in_shard_map(8, me.expert_parallel_shard, layer, x.astype(jnp.int32))
    with pytest.raises((ValueError, TypeError), match="tokens"):
        _in_shard_map(8, me.expert_parallel_shard, layer, x.reshape(16, 4, 4))
    with pytest.raises(ValueError, match="not bound here"):
        me.expert_parallel_shard(layer, x)
    with pytest.raises(ValueError, match="not a manual axis"):
        _in_shard_map(8, me.expert_parallel_shard, layer, x, axes=("data",))


def test_shard_body_combines_stats_over_the_other_axes(getkey):
    """Inside a `shard_map` over `("data", "expert")`, the stats cover every data
    group by default (the manual axes besides the expert axis), as the layer's do,
    not just the group of the device that returns them."""
    layer = make_layer(getkey(), mesh_size=4)
    x = tokens(getkey(), 64)
    _, stats = _in_shard_map(
        8,
        me.expert_parallel_shard,
        layer,
        x,
        axes=("data", "expert"),
        shape=(2, 4),
        split=True,
    )
    _, ref = jax.jit(lambda l, x: l(x, mesh=jax.make_mesh((2, 4), ("data", "expert"))))(
        layer, x
    )
    assert int(jnp.sum(stats.recv_pairs)) == 64 * 2
    np.testing.assert_array_equal(stats.recv_pairs, ref.recv_pairs)
    np.testing.assert_array_equal(stats.expert_counts, ref.expert_counts)
