"""Routing replay: `layer(x, experts=ids)` forces the experts each token uses."""

import functools as ft

import equinox as eqx
import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_eqx as me

# Identity experts (ids 8, 9) are forced too; the selection bias must be bypassed.
CFG = me.MoEConfig(
    d_model=8, d_ff=16, num_experts=8, top_k=3, num_identity_experts=2,
    use_router_bias=True,
)  # fmt: skip
COLUMNS = CFG.num_experts + CFG.num_identity_experts


def _assert_counts_forced(stats, ids):
    """The stats count the forced pairs: routed experts (ids < 8) and identity
    experts (ids 8, 9)."""
    stats.check()
    flat = np.asarray(ids).ravel()
    np.testing.assert_array_equal(
        stats.expert_counts, np.bincount(flat[flat < 8], minlength=8)
    )
    np.testing.assert_array_equal(
        stats.identity_counts, np.bincount(flat[flat >= 8] - 8, minlength=2)
    )


def _random_ids(key, batch_shape, columns=COLUMNS, k=CFG.top_k):
    """Distinct ids per token, uniform over `columns`."""
    n = int(np.prod(batch_shape))
    keys = jr.split(key, n)
    ids = jax.vmap(lambda kk: jr.permutation(kk, columns)[:k])(keys)
    return ids.astype(jnp.int32).reshape(*batch_shape, k)


@pytest.fixture(scope="module")
def layer():
    layer = me.MoELayer(CFG, key=jr.key(0))
    # A strong selection bias: the top-k would pick experts 0..2 for every token.
    bias = jnp.zeros((COLUMNS,), jnp.float32).at[:3].set(100.0)
    return eqx.tree_at(lambda l: l.router.bias, layer, bias)


def _loss(y):
    c = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * c) + 0.05 * jnp.sum(jnp.square(y))


@eqx.filter_jit
def _value_and_grad(layer, x, ids):
    def f(args):
        layer, x = args
        y, stats = layer(x, experts=ids)
        return _loss(y), (y, stats)

    (_, (y, stats)), grads = eqx.filter_value_and_grad(f, has_aux=True)((layer, x))
    return y, stats, grads


@eqx.filter_jit
def _oracle_value_and_grad(layer, x, ids):
    def f(args):
        layer, x = args
        y = me.reference_moe(layer, x, experts=ids)
        return _loss(y), y

    (_, y), grads = eqx.filter_value_and_grad(f, has_aux=True)((layer, x))
    return y, grads


def _assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    a = jax.tree.leaves(eqx.filter(a, eqx.is_inexact_array))
    b = jax.tree.leaves(eqx.filter(b, eqx.is_inexact_array))
    assert len(a) == len(b) > 0
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=rtol)


def test_router_weights_are_the_scores_at_the_forced_ids(getkey):
    # Group-limited routing with a selection bias: neither may choose anything.
    cfg = me.MoEConfig(
        d_model=8, d_ff=16, num_experts=8, top_k=2, num_groups=4, top_groups=1,
        use_router_bias=True, weighting=me.Weighting(floor=0.0),
    )  # fmt: skip
    router = me.Router(cfg, key=getkey())
    router = eqx.tree_at(lambda r: r.bias, router, jnp.arange(8.0) * 10)
    x = jr.normal(getkey(), (32, 8))
    ids = _random_ids(getkey(), (32,), columns=8, k=2)
    r = router(x, experts=ids)
    np.testing.assert_array_equal(r.experts, ids)
    # Written out independently: softmax over all experts, taken at ids, renormalised.
    logits = np.asarray(x, np.float64) @ np.asarray(router.weight, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.take_along_axis(p, np.asarray(ids), axis=-1)
    np.testing.assert_allclose(r.weights, chosen / chosen.sum(-1, keepdims=True), 1e-5)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=8)
    np.testing.assert_array_equal(r.counts, counts)
    # The balance loss counts the forced pairs.
    expected_lb = 8 * np.sum(counts / counts.sum() * p.mean(0))
    np.testing.assert_allclose(r.load_balance_loss, expected_lb, rtol=1e-5)
    assert int(r.bad_ids) == 0
    # Without forced ids the bias and the group mask choose: experts 6 and 7 only.
    assert set(np.asarray(router(x).experts).ravel().tolist()) == {6, 7}


def test_replaying_the_recorded_routing_is_the_routing(layer, getkey):
    x = jr.normal(getkey(), (4, 16, 8))
    recorded = layer.router(x.reshape(-1, 8)).experts.reshape(4, 16, 3)
    y, stats = layer(x)
    y_replay, stats_replay = layer(x, experts=recorded)
    np.testing.assert_allclose(y_replay, y, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(stats_replay.expert_counts, stats.expert_counts)
    np.testing.assert_array_equal(stats_replay.identity_counts, stats.identity_counts)
    np.testing.assert_allclose(stats_replay.load_balance_loss, stats.load_balance_loss)


def test_replay_matches_the_oracle_one_device(layer, getkey):
    x = jr.normal(getkey(), (4, 16, 8))
    ids = _random_ids(getkey(), (4, 16))
    y, stats, grads = _value_and_grad(layer, x, ids)
    y_ref, grads_ref = _oracle_value_and_grad(layer, x, ids)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    _assert_trees_close(grads, grads_ref)
    _assert_counts_forced(stats, ids)
    assert int(stats.identity_counts.sum()) > 0
    # The router gets its gradient from the forced pairs' weights: not zero, and not
    # the gradient of the router's own (bias-chosen) routing.
    g_router = grads[0].router.weight
    assert float(jnp.max(jnp.abs(g_router))) > 1e-3
    _, grads_own = _oracle_value_and_grad(
        layer, x, layer.router(x.reshape(-1, 8)).experts.reshape(4, 16, 3)
    )
    assert not np.allclose(g_router, grads_own[0].router.weight, atol=1e-4)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda ids: ids.at[3, 1].set(COLUMNS), "in \\[0, 10\\)"),
        (lambda ids: ids.at[0, 2].set(-1), "in \\[0, 10\\)"),
        (lambda ids: ids.at[5, 1].set(ids[5, 0]), "distinct per token"),
        (lambda ids: ids[:, :2], "shape \\(16, 3\\)"),
    ],
)
def test_bad_concrete_ids_are_a_value_error(layer, getkey, edit, message):
    x = jr.normal(getkey(), (16, 8))
    ids = edit(_random_ids(getkey(), (16,)))
    with pytest.raises(ValueError, match=message):
        layer(x, experts=ids)
    with pytest.raises(ValueError, match=message):
        me.reference_moe(layer, x, experts=ids)
    with pytest.raises(ValueError, match=message):
        layer.router(x, experts=ids)


def test_float_ids_are_a_type_error(layer, getkey):
    x = jr.normal(getkey(), (16, 8))
    ids = _random_ids(getkey(), (16,)).astype(jnp.float32)
    with pytest.raises(TypeError):
        layer(x, experts=ids)


# Expert parallelism over 8 devices: one expert per shard. B = ceil(factor * T * k)
# rows per shard with T = 8 tokens per shard: 24 with factor 1 (the fallback's), 48
# with factor 2 (the drop config's): uniform ids fit both, every token on expert 0
# (64 pairs on shard 0) fits neither.
SKEWED = jnp.broadcast_to(jnp.array([0, 8, 5], jnp.int32), (64, 3))


@pytest.fixture(scope="module")
def mesh8():
    return helpers.mesh(8)


@eqx.filter_jit
def _ep_value_and_grad(layer, x, ids, mesh):
    def f(args):
        layer, x = args
        y, stats = layer(x, mesh=mesh, experts=ids)
        return _loss(y), (y, stats)

    (_, (y, stats)), grads = eqx.filter_value_and_grad(f, has_aux=True)((layer, x))
    return y, stats, grads


@eqx.filter_jit
def _ep_forward(layer, x, ids, mesh):
    return layer(x, mesh=mesh, experts=ids)


@pytest.mark.parametrize("skewed", [False, True])
def test_replay_matches_the_oracle_ep8_fallback(layer, mesh8, getkey, skewed):
    layer = layer.with_config(buffer_factor=1.0, on_overflow="fallback")
    x = jr.normal(getkey(), (64, 8))
    ids = SKEWED if skewed else _random_ids(getkey(), (64,))
    y, stats, grads = _ep_value_and_grad(layer, x, ids, mesh8)
    y_ref, grads_ref = _oracle_value_and_grad(layer, x, ids)
    assert bool(stats.fallback_used) == skewed
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    _assert_trees_close(grads, grads_ref)
    _assert_counts_forced(stats, ids)


def test_replay_ep8_drop(layer, mesh8, getkey):
    layer = layer.with_config(buffer_factor=2.0, on_overflow="drop")
    x = jr.normal(getkey(), (64, 8))
    ids = _random_ids(getkey(), (64,))
    y, stats = _ep_forward(layer, x, ids, mesh8)
    assert int(stats.dropped_pairs) == 0
    np.testing.assert_allclose(
        y, me.reference_moe(layer, x, experts=ids), atol=1e-5, rtol=1e-5
    )
    # Forced onto one shard, the pairs beyond its buffer are dropped and counted.
    y, stats = _ep_forward(layer, x, SKEWED, mesh8)
    assert int(stats.dropped_pairs) > 0
    assert int(stats.lost_pairs) == 0
    assert not np.allclose(y, me.reference_moe(layer, x, experts=SKEWED), atol=1e-3)


def _bad_ids(getkey, tokens):
    """Random ids with two tokens' ids made bad (one out of range, one repeated), and
    the same ids with those tokens' ids made good again."""
    good = _random_ids(getkey(), (tokens,))
    bad = good.at[3, 1].set(COLUMNS + 5).at[tokens - 2, 2].set(good[tokens - 2, 0])
    return good, bad


def _assert_bad_ids_counted(layer, x, y, stats, good):
    assert int(stats.bad_expert_ids) == 2
    assert int(stats.lost_pairs) == 0
    with pytest.raises(ValueError, match="bad_expert_ids=2"):
        stats.check()
    # Those two tokens were routed nowhere; every other token is exact.
    tokens = x.shape[0]
    bad_tokens = np.array([3, tokens - 2])
    np.testing.assert_array_equal(np.asarray(y)[bad_tokens], 0.0)
    rest = np.setdiff1d(np.arange(tokens), bad_tokens)
    y_ref = me.reference_moe(layer, x, experts=good)
    np.testing.assert_allclose(
        np.asarray(y)[rest], np.asarray(y_ref)[rest], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("where", ["one_device", "ep8_drop", "ep8_fallback"])
def test_traced_bad_ids_are_counted_and_raised_by_check(layer, mesh8, getkey, where):
    x = jr.normal(getkey(), (64, 8))
    good, bad = _bad_ids(getkey, 64)
    if where == "one_device":
        y, stats, _ = _value_and_grad(layer, x.reshape(4, 16, 8), bad.reshape(4, 16, 3))
        y = y.reshape(64, 8)
    elif where == "ep8_drop":
        layer = layer.with_config(buffer_factor=2.0, on_overflow="drop")
        y, stats = _ep_forward(layer, x, bad, mesh8)
    else:
        layer = layer.with_config(buffer_factor=1.0, on_overflow="fallback")
        y, stats, _ = _ep_value_and_grad(layer, x, bad, mesh8)
    _assert_bad_ids_counted(layer, x, y, stats, good)


def test_expert_parallel_shard_takes_forced_ids(layer, mesh8, getkey):
    layer = layer.with_config(buffer_factor=2.0, on_overflow="drop")
    x = jr.normal(getkey(), (64, 8))
    good, bad = _bad_ids(getkey, 64)
    m = helpers.auto_mesh(8)

    @jax.jit
    @ft.partial(
        jax.shard_map,
        mesh=m,
        in_specs=(me.shard_specs(layer), P("expert"), P("expert")),
        out_specs=(P("expert"), P()),
        check_vma=False,
    )
    def block(layer, x, ids):
        return me.expert_parallel_shard(layer, x, experts=ids)

    y, stats = block(layer, x, good)
    np.testing.assert_allclose(
        y, me.reference_moe(layer, x, experts=good), atol=1e-5, rtol=1e-5
    )
    assert int(stats.bad_expert_ids) == 0
    y, stats = block(layer, x, bad)
    _assert_bad_ids_counted(layer, x, y, stats, good)


def test_replay_ep8_padded_tokens(layer, mesh8, getkey):
    # 60 tokens: padded to 64 inside, the padding's ids neither bad nor counted.
    layer = layer.with_config(buffer_factor=2.0, on_overflow="drop")
    x = jr.normal(getkey(), (60, 8))
    ids = _random_ids(getkey(), (60,))
    y, stats = _ep_forward(layer, x, ids, mesh8)
    stats.check()
    assert int(jnp.sum(stats.expert_counts) + jnp.sum(stats.identity_counts)) == 180
    np.testing.assert_allclose(
        y, me.reference_moe(layer, x, experts=ids), atol=1e-5, rtol=1e-5
    )


# ---------------------------------------------------------------------------------
# Routers of a user's own: the layer validates forced ids and checks they were used.

PLAIN = me.MoEConfig(d_model=8, d_ff=16, num_experts=8, top_k=3)


class _TakingRouter(me.AbstractRouter):
    """docs/own-stages.md's pattern: forced ids taken with `take_along_axis`, never
    checked (an out-of-range id would read a clamped or NaN score)."""

    weight: jax.Array

    def __call__(self, x, valid=None, *, experts=None):
        logits = jnp.dot(x.astype(jnp.float32), self.weight)
        if experts is None:
            experts = jax.lax.top_k(logits, PLAIN.top_k)[1]
        chosen = jnp.take_along_axis(logits, experts, axis=1)
        return me.routing_of(
            experts, jax.nn.softmax(chosen, axis=1), logits,
            jax.nn.softmax(logits, axis=1), valid, num_experts=PLAIN.num_experts,
        )  # fmt: skip


class _IgnoringRouter(me.AbstractRouter):
    """Takes `experts=` and ignores it: routes by its own top-k."""

    inner: _TakingRouter

    def __call__(self, x, valid=None, *, experts=None):
        return self.inner(x, valid)


def _own_router_layer(cls, key):
    layer = me.MoELayer(PLAIN, key=key)
    router = _TakingRouter(layer.router.weight)
    if cls is _IgnoringRouter:
        router = _IgnoringRouter(router)
    return eqx.tree_at(lambda l: l.router, layer, router)


@pytest.mark.parametrize("where", ["one_device", "ep8_drop"])
def test_traced_bad_ids_are_caught_before_any_router(mesh8, getkey, where):
    """The docs' router never checks forced ids: the layer does, before calling it
    (counted, the tokens routed nowhere, no NaN), whatever the router."""
    layer = _own_router_layer(_TakingRouter, getkey())
    x = jr.normal(getkey(), (64, 8))
    good = _random_ids(getkey(), (64,), columns=8)
    bad = good.at[3, 1].set(50).at[62, 2].set(good[62, 0])
    mesh = mesh8 if where == "ep8_drop" else None
    if mesh is not None:
        layer = layer.with_config(buffer_factor=2.0, on_overflow="drop")
    y, stats = _ep_forward(layer, x, bad, mesh)
    assert int(stats.bad_expert_ids) == 2
    with pytest.raises(ValueError, match="bad_expert_ids=2"):
        stats.check()
    assert np.all(np.isfinite(np.asarray(y)))
    np.testing.assert_array_equal(np.asarray(y)[[3, 62]], 0.0)
    y_ok, stats_ok = _ep_forward(layer, x, good, mesh)
    stats_ok.check()
    np.testing.assert_allclose(
        y_ok, me.reference_moe(layer, x, experts=good), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("num_shards", [None, 8])
def test_a_router_that_ignores_forced_ids_is_an_error_when_eager(getkey, num_shards):
    layer = _own_router_layer(_IgnoringRouter, getkey())
    x = jr.normal(getkey(), (16, 8))
    ids = jnp.broadcast_to(jnp.array([5, 6, 7], jnp.int32), (16, 3))
    mesh = None if num_shards is None else helpers.mesh(num_shards)
    with pytest.raises(ValueError, match="_IgnoringRouter did not route tokens"):
        layer(x, mesh=mesh, experts=ids)


@pytest.mark.parametrize("where", ["one_device", "ep8_drop", "ep8_fallback"])
def test_a_router_that_ignores_forced_ids_fails_check_under_jit(mesh8, getkey, where):
    layer = _own_router_layer(_IgnoringRouter, getkey())
    if where != "one_device":
        factor, mode = (2.0, "drop") if where == "ep8_drop" else (0.5, "fallback")
        layer = layer.with_config(buffer_factor=factor, on_overflow=mode)
    x = jr.normal(getkey(), (64, 8))
    # Experts the router's own top-k cannot all pick: 5, 6, 7 for every token.
    ids = jnp.broadcast_to(jnp.array([5, 6, 7], jnp.int32), (64, 3))
    own = np.sort(np.asarray(layer.router.inner(x).experts), axis=1)
    expected = 3 * int(np.sum(np.any(own != [5, 6, 7], axis=1)))
    assert expected > 0
    _, stats = _ep_forward(layer, x, ids, None if where == "one_device" else mesh8)
    assert int(stats.bad_expert_ids) == expected
    with pytest.raises(ValueError, match="ignores `experts=`"):
        stats.check()
