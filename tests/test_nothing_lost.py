"""No pair is ever lost silently: the layer at the planner's edge shapes against the
oracle, stats counted from what really moved, and `lost_pairs` catching a broken plan
or a broken exchange."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    assert_nothing_lost,
    make_layer,
    mesh,
    received_token_by_token,
    tokens,
    with_bias,
)
from hypothesis import given, settings, strategies as st

import moe_eqx as me
import moe_eqx._layer as layer_module
import moe_eqx._shard as shard_module

# (R, E, k, S, buffer_factor): one expert per shard and more slots than home experts.
EDGE_CONFIGS = [
    (8, 8, 1, 2, None),
    (8, 8, 2, 3, 1.0),
    (4, 4, 2, 3, None),
    (4, 8, 2, 3, 0.75),
]


@functools.cache
def _edge_layer(index):
    num_shards, num_experts, top_k, num_slots, factor = EDGE_CONFIGS[index]
    return make_layer(
        jr.PRNGKey(index),
        mesh_size=num_shards,
        bias_kind="uniform",
        num_experts=num_experts,
        top_k=top_k,
        num_slots=num_slots,
        buffer_factor=factor,
    )


@settings(max_examples=24, deadline=None, database=None)
@given(
    index=st.integers(0, len(EDGE_CONFIGS) - 1),
    hot=st.lists(st.integers(0, 7), min_size=0, max_size=4),
    strength=st.floats(0.0, 6.0),
    seed=st.integers(0, 2**16),
)
def test_layer_at_planner_edges_matches_oracle(index, hot, strength, seed):
    num_shards, num_experts, _, _, _ = EDGE_CONFIGS[index]
    layer = _edge_layer(index)
    bias = np.zeros(num_experts, np.float32)
    for e in hot:
        bias[e % num_experts] += strength
    layer = with_bias(layer, bias)
    x = tokens(jr.PRNGKey(seed), 64)
    stats = assert_matches_oracle(layer, x, mesh(num_shards), atol=5e-5, rtol=5e-5)
    # The plan never makes the busiest shard busier.
    assert float(stats.max_over_mean) <= float(stats.max_over_mean_before) + 1e-6


# Per-shard routing (8 shards x 16 tokens, k = 1, E = R = 8) for which the planner,
# before the S > L fix, lost a pair of its quotas: the layer then computed a token with
# the wrong expert while its stats said nothing was dropped.
REGRESSION_CHOICES = [
    [7, 0, 3, 7, 0, 5, 7, 0, 5, 3, 4, 5, 5, 0, 7, 7],
    [7, 2, 3, 3, 7, 2, 2, 7, 3, 5, 4, 7, 2, 7, 7, 2],
    [0, 7, 4, 0, 2, 4, 0, 7, 0, 7, 7, 4, 4, 3, 3, 3],
    [5, 2, 2, 4, 0, 4, 7, 3, 2, 4, 5, 7, 4, 0, 7, 7],
    [0, 7, 5, 5, 4, 4, 7, 7, 5, 7, 5, 2, 0, 7, 3, 7],
    [2, 4, 4, 5, 7, 4, 7, 7, 2, 4, 5, 3, 5, 0, 7, 4],
    [5, 5, 4, 2, 7, 7, 0, 7, 2, 7, 5, 7, 0, 7, 7, 3],
    [2, 7, 7, 4, 5, 2, 4, 4, 0, 3, 3, 4, 0, 2, 5, 7],
]


def test_one_expert_per_shard_two_slots_regression(getkey):
    layer = make_layer(
        getkey(), mesh_size=8, num_experts=8, top_k=1, num_slots=2, buffer_factor=None
    )
    experts = np.asarray(REGRESSION_CHOICES).ravel()
    # A one-hot router: token t has a large component along its expert's direction.
    x = jnp.asarray(np.eye(16, dtype=np.float32)[experts] * 20.0)
    x = x + 0.1 * tokens(getkey(), len(experts))
    w = jnp.zeros((16, 8), jnp.float32).at[jnp.arange(8), jnp.arange(8)].set(1.0)
    layer = eqx.tree_at(lambda l: l.router.weight, layer, w)
    np.testing.assert_array_equal(layer.router(x).experts[:, 0], experts)
    stats = assert_matches_oracle(layer, x, mesh(8), atol=1e-4, rtol=1e-4)
    assert float(stats.max_over_mean) < float(stats.max_over_mean_before)


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "nodedup"])
def test_fallback_sums_what_its_chunks_did(getkey, dedup):
    """Under the forced fallback the stats are the chunks' real counts summed: rows and
    pairs per receiver equal a count made token by token from the routing."""
    layer = make_layer(
        getkey(), mesh_size=4, bias_kind="zipf", buffer_factor=0.6, dedup=dedup, top_k=3
    )
    x = tokens(getkey(), 128)
    stats = assert_matches_oracle(layer, x, mesh(4))
    assert bool(stats.fallback_used) and int(stats.num_chunks) > 1
    experts = np.asarray(layer.router(x).experts)
    rows, pairs = received_token_by_token(experts, 4, 2, dedup)
    np.testing.assert_array_equal(stats.recv_pairs, pairs)
    np.testing.assert_array_equal(stats.wire_rows, rows)


def _broken_plan(plan_duplication):
    """The real planner, then one pair of the hottest expert taken from its quota."""

    def plan(counts, *, num_slots, **kwargs):
        p = plan_duplication(counts, num_slots=num_slots, **kwargs)
        q = p.expert_shard_pairs
        hot = jnp.argmax(jnp.sum(q, axis=1))
        home = jnp.argmax(q[hot])
        return eqx.tree_at(lambda p: p.expert_shard_pairs, p, q.at[hot, home].add(-1))

    return plan


def test_broken_plan_shows_as_lost_pairs(getkey, monkeypatch, lost_pairs_seen):
    monkeypatch.setattr(
        shard_module, "plan_duplication", _broken_plan(shard_module.plan_duplication)
    )
    # d_ff unique to this test: the layer's jitted call must not reuse a compilation
    # made with the real planner.
    layer = make_layer(
        getkey(), mesh_size=4, bias_kind="zipf", num_slots=1, d_ff=20, top_k=2
    )
    x = tokens(getkey(), 64)
    _, stats = jax.jit(lambda l, x: l(x, mesh=mesh(4)))(layer, x)
    assert int(stats.lost_pairs) == 1
    assert int(stats.dropped_pairs) == 0
    assert int(jnp.sum(stats.recv_pairs)) == 64 * 2 - 1
    with pytest.raises(AssertionError, match="1 pairs lost"):
        assert_nothing_lost(stats, 64, 2)
    # The offered check raises on the host, and the suite's enforcement saw it.
    with pytest.raises(me.LostPairsError, match="lost_pairs=1"):
        stats.check()
    assert set(lost_pairs_seen) == {1}
    lost_pairs_seen.clear()


def test_broken_exchange_shows_as_lost_pairs(getkey, monkeypatch, lost_pairs_seen):
    """A row that never arrives is not computed and not counted as dropped: the
    stats count what arrived, so the loss shows (a plan-derived count would not)."""
    dense = me.DenseExchange
    real = dense.dispatch_unpacked  # the receive layout the trip uses

    def lossy(self, send, plan, capacity):
        out = real(self, send, plan, capacity)
        return out.at[0].set(jnp.zeros((), out.dtype))  # row 0 of each receiver

    monkeypatch.setattr(dense, "dispatch_unpacked", lossy)
    layer = make_layer(getkey(), mesh_size=4, d_ff=28, top_k=2, buffer_factor=None)
    x = tokens(getkey(), 64)
    _, stats = jax.jit(lambda l, x: l(x, mesh=mesh(4)))(layer, x)
    assert int(stats.dropped_pairs) == 0
    # Each of the 4 receivers lost its first row, which carries 1 or 2 pairs.
    assert 4 <= int(stats.lost_pairs) <= 8
    with pytest.raises(me.LostPairsError):
        stats.check()
    assert lost_pairs_seen and set(lost_pairs_seen) == {int(stats.lost_pairs)}
    lost_pairs_seen.clear()


def test_check_passes_concrete_stats_and_refuses_tracers(getkey):
    layer = make_layer(getkey(), mesh_size=4)
    x = tokens(getkey(), 64)
    stats = jax.jit(lambda l, x: l(x, mesh=mesh(4))[1])(layer, x)
    assert stats.check() is stats
    assert stats.to_dict()["lost_pairs"] == 0
    assert stats.to_dict()["recv_pairs"] == np.asarray(stats.recv_pairs).tolist()
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda l, x: l(x, mesh=mesh(4))[1].check())(layer, x)


@pytest.mark.parametrize("num_shards", [None, 4])
def test_zero_tokens(getkey, num_shards):
    layer = make_layer(getkey(), num_slots=1)
    m = None if num_shards is None else mesh(num_shards)
    x = jnp.zeros((0, 16), jnp.float32)
    y, stats = layer(x, mesh=m)
    assert y.shape == (0, 16) and y.dtype == x.dtype
    assert stats.recv_pairs.shape == (num_shards or 1,)
    assert int(jnp.sum(stats.recv_pairs)) == 0 and int(stats.lost_pairs) == 0
    assert int(jnp.sum(stats.expert_counts)) == 0
    y, _ = layer(jnp.zeros((2, 0, 16), jnp.bfloat16), mesh=m)
    assert y.shape == (2, 0, 16) and y.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8])
def test_non_float_tokens_are_rejected(getkey, dtype):
    layer = make_layer(getkey())
    with pytest.raises(TypeError, match="dtype"):
        layer_module._check_input(jnp.ones((8, 16), dtype), layer.config)
    with pytest.raises(TypeError):  # through the call: the type check or ours
        layer(jnp.ones((8, 16), dtype))


def test_non_float_weights_are_rejected(getkey):
    config = me.MoEConfig(d_model=16, d_ff=24, num_experts=8, top_k=2)
    with pytest.raises(TypeError, match="int32"):
        me.MoELayer(config, key=getkey(), dtype=jnp.int32)


def test_bad_dtypes_rejected_without_runtime_type_checks():
    """Outside the test suite's jaxtyping instrumentation the layer still refuses
    integer tokens and integer weights with its own message."""
    from helpers import run_python

    out = run_python(
        """
import jax.numpy as jnp, jax.random as jr, moe_eqx as me
config = me.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2)
layer = me.MoELayer(config, key=jr.PRNGKey(0))
for bad in (jnp.ones((4, 8), jnp.int32), jnp.ones((4, 8), bool)):
    try:
        layer(bad)
    except TypeError as e:
        print("x:", e)
try:
    me.MoELayer(config, key=jr.PRNGKey(0), dtype=jnp.int32)
except TypeError as e:
    print("weights:", e)
"""
    )
    assert out.count("x: `x` must be a floating-point array") == 2, out
    assert "weights: Expert weights must have a floating-point `dtype`" in out, out


def test_shard_layer_checks_divisibility(getkey):
    layer = make_layer(getkey(), num_experts=6)
    with pytest.raises(ValueError, match="num_experts"):
        me.shard_model(layer, mesh(4))
