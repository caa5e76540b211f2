"""Re-placement of home experts: `expert_ids`, `plan_placement`, `rebalance_experts`,
`permute_experts`, `rebalance` (model and optimizer state), checkpoints."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import (
    assert_matches_oracle,
    assert_nothing_lost,
    layer_value_and_grad,
    make_layer,
    mesh,
    tokens,
)
from jax.sharding import PartitionSpec as P

import moe_eqx as me
import moe_eqx.internal as mi
import moe_eqx.workloads as wl
from moe_eqx.train import load_checkpoint, save_checkpoint

NUM_EXPERTS = 16


def _skewed_layer(key, num_shards, **overrides):
    # Zipf preference with the hottest experts contiguous (all on shard 0).
    layer = make_layer(
        key, num_experts=NUM_EXPERTS, top_k=2, use_router_bias=True, **overrides
    )
    probs = wl.zipf_probs(NUM_EXPERTS, 1.2, hot="contiguous")
    bias = wl.preference_bias(probs, scale=0.5)
    return eqx.tree_at(lambda l: l.router.bias, layer, jnp.asarray(bias))


def _home_max_over_mean(load, expert_ids, num_shards):
    home = np.asarray(load)[np.asarray(expert_ids)].reshape(num_shards, -1).sum(1)
    return home.max() / home.mean()


def _rebalanced(layer, x, num_shards):
    """The layer re-placed from the load its own routing puts on `x`."""
    _, stats = layer(x)
    new = me.rebalance_experts(layer, stats.expert_counts, num_shards=num_shards)
    moved = int(np.sum(np.asarray(new.expert_ids) != np.arange(NUM_EXPERTS)))
    assert moved > 0, "the skewed load must move some experts"
    return new


def test_identity_by_default(getkey):
    layer = make_layer(getkey(), num_experts=NUM_EXPERTS)
    np.testing.assert_array_equal(layer.expert_ids, np.arange(NUM_EXPERTS))
    assert layer.expert_ids.dtype == jnp.int32
    assert me.shard_specs(layer).expert_ids == P()
    m = mesh(4)
    placed = me.shard_model(layer, m)
    assert placed.expert_ids.sharding.spec == P()
    assert_matches_oracle(layer, tokens(getkey(), 32), m)


@pytest.mark.parametrize(
    "num_shards, num_slots, dedup",
    [(1, 0, True), (2, 0, True), (4, 2, True), (4, 0, False), (8, 1, True)],
)
def test_rebalanced_layer_matches_oracle(getkey, num_shards, num_slots, dedup):
    layer = _skewed_layer(getkey(), num_shards, num_slots=num_slots, dedup=dedup)
    x = tokens(getkey(), 64)
    # On one device: a placement made for 4 shards (the layer is the same).
    new = _rebalanced(layer, x, max(num_shards, 4))
    m = None if num_shards == 1 else mesh(num_shards)
    stats = assert_matches_oracle(new, x, m)
    if num_shards > 1:
        # The re-placement balanced this batch's home load.
        identity = _home_max_over_mean(stats.expert_counts, np.arange(16), num_shards)
        assert float(stats.max_over_mean_before) < identity


def test_same_function_and_logical_gradients(getkey):
    num_shards = 4
    layer = _skewed_layer(getkey(), num_shards, num_slots=1)
    x = tokens(getkey(), 64)
    new = _rebalanced(layer, x, num_shards)
    m = mesh(num_shards)
    y0, s0, g0, gx0 = layer_value_and_grad(layer, x, m)
    y1, s1, g1, gx1 = layer_value_and_grad(new, x, m)
    for s in (s0, s1):
        assert_nothing_lost(s, 64, 2)
    np.testing.assert_allclose(y1, y0, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(gx1, gx0, atol=2e-5, rtol=2e-5)
    # Stats stay in logical order; the home balance improved.
    np.testing.assert_array_equal(s1.expert_counts, s0.expert_counts)
    assert float(s1.max_over_mean_before) < float(s0.max_over_mean_before)
    # Expert gradients are the same per logical expert; router gradients unchanged.
    position = np.argsort(np.asarray(new.expert_ids))
    for name in ("w_gate_up", "w_down"):
        got = np.asarray(getattr(g1.experts, name))[position]
        np.testing.assert_allclose(got, getattr(g0.experts, name), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(g1.router.weight, g0.router.weight, atol=2e-5, rtol=2e-5)


def _adam_step(opt, model, state, x):
    def loss(model):
        y, stats = model(x)
        return jnp.mean(jnp.square(y)), stats

    (_, stats), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    assert_nothing_lost(stats, x.shape[0], model.config.top_k)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes dtypes
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state


def test_optimizer_state_permuted(getkey):
    layer = _skewed_layer(getkey(), 4)
    x = tokens(getkey(), 64)
    opt = optax.adam(1e-2)
    with jax.numpy_dtype_promotion("standard"):
        # Inexact arrays only: `expert_ids` is an integer leaf without a gradient.
        state = opt.init(eqx.filter(layer, eqx.is_inexact_array))
    for _ in range(2):  # non-zero moments
        layer, state = _adam_step(opt, layer, state, x)
    load = layer(x)[1].expert_counts
    # Re-place, then step ...
    a, state_a = me.rebalance(layer, state, load, num_shards=4)
    a, state_a = _adam_step(opt, a, state_a, x)
    # ... equals step, then re-place (the same placement: the load is the same).
    b, state_b = _adam_step(opt, layer, state, x)
    b, state_b = me.rebalance(b, state_b, load, num_shards=4)
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    assert np.any(np.asarray(a.expert_ids) != np.arange(NUM_EXPERTS))
    for got, want in zip(jax.tree.leaves((a, state_a)), jax.tree.leaves((b, state_b))):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    # The moments moved with the experts (not left in the old order).
    perm = np.argsort(np.asarray(layer.expert_ids))[np.asarray(a.expert_ids)]
    mu_before = state[0].mu.experts.w_gate_up
    mu_after = me.rebalance(layer, state, load, num_shards=4)[1][0].mu
    np.testing.assert_array_equal(mu_after.experts.w_gate_up, mu_before[perm])


def test_sharded_model_stays_sharded(getkey):
    m = mesh(4)
    layer = me.shard_model(_skewed_layer(getkey(), 4, num_slots=1), m)
    x = tokens(getkey(), 64)
    load = layer(x, mesh=m)[1].expert_counts
    new = me.rebalance_experts(layer, load, num_shards=4)
    for before, after in (
        (layer.experts.w_gate_up, new.experts.w_gate_up),
        (layer.experts.w_down, new.experts.w_down),
        (layer.expert_ids, new.expert_ids),
    ):
        assert after.sharding.is_equivalent_to(before.sharding, after.ndim)
    assert np.any(np.asarray(new.expert_ids) != np.arange(NUM_EXPERTS))
    y, stats = new(x, mesh=m)
    assert_nothing_lost(stats, 64, 2)
    # The oracle on host copies (its dense einsums do not take sharded experts).
    host = jax.tree.map(
        lambda a: jnp.asarray(np.asarray(a)) if eqx.is_array(a) else a, new
    )
    np.testing.assert_allclose(y, me.reference_moe(host, x), atol=2e-5, rtol=2e-5)
    assert_matches_oracle(host, x, m)


@pytest.mark.parametrize("num_shards", [2, 8])
def test_sharded_permutation_moves_only_what_changes_shard(getkey, num_shards):
    m = mesh(num_shards)
    layer = make_layer(getkey(), num_experts=NUM_EXPERTS)
    placed = me.shard_model(layer, m)
    perm = np.random.default_rng(num_shards).permutation(NUM_EXPERTS)
    got = mi.permute_experts(placed, perm)  # by cyclic shifts between shards
    for name in ("w_gate_up", "w_down"):
        before = getattr(layer.experts, name)
        after = getattr(got.experts, name)
        np.testing.assert_array_equal(after, np.asarray(before)[perm])
        assert after.sharding.is_equivalent_to(
            getattr(placed.experts, name).sharding, after.ndim
        )
    np.testing.assert_array_equal(got.expert_ids, perm)


def test_checkpoint_round_trip(getkey, tmp_path):
    layer = _skewed_layer(getkey(), 4)
    x = tokens(getkey(), 64)
    opt = optax.adam(1e-2)
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(eqx.filter(layer, eqx.is_inexact_array))
    layer, state = _adam_step(opt, layer, state, x)
    new, new_state = me.rebalance(layer, state, layer(x)[1].expert_counts, num_shards=4)
    save_checkpoint(tmp_path, 3, {"model": new, "opt_state": new_state})
    # The template is a fresh layer: identity placement.
    template = {"model": layer, "opt_state": state}
    step, restored = load_checkpoint(tmp_path, template)
    assert step == 3
    np.testing.assert_array_equal(restored["model"].expert_ids, new.expert_ids)
    assert np.any(np.asarray(restored["model"].expert_ids) != np.arange(NUM_EXPERTS))
    for got, want in zip(
        jax.tree.leaves(restored), jax.tree.leaves((new, new_state)), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    y, stats = restored["model"](x)
    assert_nothing_lost(stats, 64, 2)
    np.testing.assert_allclose(y, layer(x)[0], atol=2e-5, rtol=2e-5)


def test_stacked_layers(getkey):
    config = me.MoEConfig(d_model=16, d_ff=24, num_experts=NUM_EXPERTS, top_k=2)
    keys = jr.split(getkey(), 3)
    stacked = eqx.filter_vmap(lambda k: me.MoELayer(config, key=k))(keys)
    assert stacked.expert_ids.shape == (3, NUM_EXPERTS)
    load = np.stack(
        [wl.zipf_probs(NUM_EXPERTS, s, hot="contiguous") for s in (0.5, 1.0, 1.5)]
    )
    new = me.rebalance_experts(stacked, load * 1000, num_shards=4)
    x = tokens(getkey(), 32)
    for i in range(3):
        before = jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, stacked)
        after = jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, new)
        np.testing.assert_array_equal(
            after.expert_ids,
            mi.plan_placement(load[i] * 1000, num_shards=4),
        )
        y0, s0 = before(x)
        y1, s1 = after(x)
        assert_nothing_lost(s1, 32, 2)
        np.testing.assert_allclose(y1, y0, atol=2e-5, rtol=2e-5)


def test_permute_experts_under_jit(getkey):
    layer = make_layer(getkey(), num_experts=NUM_EXPERTS)
    perm = jnp.asarray(np.random.default_rng(0).permutation(NUM_EXPERTS), jnp.int32)
    got = jax.jit(mi.permute_experts)(layer, perm)
    np.testing.assert_array_equal(got.expert_ids, perm)
    np.testing.assert_array_equal(got.experts.w_down, layer.experts.w_down[perm])
    x = tokens(getkey(), 32)
    y, stats = got(x)
    assert_nothing_lost(stats, 32, 2)
    np.testing.assert_allclose(y, layer(x)[0], atol=2e-5, rtol=2e-5)


def test_placement_balances():
    # A skewed load: max/mean of the home load drops.
    rng = np.random.default_rng(0)
    load = rng.zipf(1.5, 64).astype(float)
    load = np.minimum(load, load.sum() / 8 / 2)
    before = _home_max_over_mean(load, np.arange(64), 8)
    ids = mi.plan_placement(load, num_shards=8)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(np.sort(ids), np.arange(64))
    after = _home_max_over_mean(load, ids, 8)
    assert after < before and after < 1.1, (before, after)
    # The hot-contiguous workload at EP8 (E=256, k=8) reaches near 1.
    choices = wl.sample_workload(
        "zipf", num_shards=8, tokens=512, num_experts=256, top_k=8, hot="contiguous"
    )
    counts = wl.counts_from_choices(choices, 256).sum(axis=0)
    ids = mi.plan_placement(jnp.asarray(counts), num_shards=8)  # a jax array works
    assert _home_max_over_mean(counts, np.arange(256), 8) > 3
    assert _home_max_over_mean(counts, ids, 8) < 1.06
    # Deterministic; re-planning from the new placement moves nothing.
    np.testing.assert_array_equal(ids, mi.plan_placement(counts, num_shards=8))
    again = mi.plan_placement(counts, num_shards=8, current=ids)
    np.testing.assert_array_equal(again, ids)
    # Noise well inside the tolerance (1% of a shard's mean load) moves nothing.
    noisy = counts * (1 + 0.001 * np.random.default_rng(1).standard_normal(256))
    np.testing.assert_array_equal(
        mi.plan_placement(noisy, num_shards=8, current=ids), ids
    )
    # A balanced load keeps the current placement.
    np.testing.assert_array_equal(
        mi.plan_placement(np.ones(256), num_shards=8), np.arange(256)
    )


@pytest.mark.parametrize("num_shards", [16, 32])
def test_placement_leaves_room_for_slots(num_shards):
    """Hot experts heavier than a shard's mean load need slot copies: a placement
    planned for S = 1 lets the per-step planner (S = 1) reach max/mean ~1 where the
    identity placement cannot, and the next step's routing (another draw) too."""
    draws = [
        wl.counts_from_choices(
            wl.sample_workload(
                "zipf",
                num_shards=num_shards,
                tokens=256,
                num_experts=256,
                top_k=8,
                hot="contiguous",
                seed=seed,
            ),
            256,
        )
        for seed in (0, 1)
    ]
    ids = mi.plan_placement(draws[0].sum(axis=0), num_shards=num_shards, num_slots=1)

    def planned(counts):
        load = np.asarray(
            me.plan_duplication(jnp.asarray(counts), num_slots=1).shard_load
        )
        return load.max() / load.mean()

    assert planned(draws[1]) > 1.09
    assert planned(draws[1][:, ids]) < 1.01


def test_layer_slots_are_planned_for(getkey):
    layer = make_layer(getkey(), num_experts=NUM_EXPERTS, num_slots=1)
    load = wl.zipf_probs(NUM_EXPERTS, 1.5, hot="contiguous") * 1000
    new = me.rebalance_experts(layer, load, num_shards=4)
    want = mi.plan_placement(load, num_shards=4, num_slots=1)
    np.testing.assert_array_equal(new.expert_ids, want)
    assert np.any(want != mi.plan_placement(load, num_shards=4))
    zero = me.rebalance_experts(layer, load, num_shards=4, num_slots=0)
    np.testing.assert_array_equal(
        zero.expert_ids, mi.plan_placement(load, num_shards=4)
    )


def test_bad_input(getkey):
    layer = make_layer(getkey(), num_experts=NUM_EXPERTS)
    good = np.ones(NUM_EXPERTS)
    with pytest.raises(ValueError, match="has 8 experts"):
        me.rebalance_experts(layer, np.ones(8), num_shards=4)
    with pytest.raises(ValueError, match=">= 0"):
        me.rebalance_experts(layer, -good, num_shards=4)
    with pytest.raises(ValueError, match="finite"):
        me.rebalance_experts(layer, good * np.nan, num_shards=4)
    with pytest.raises(ValueError, match="divisible"):
        me.rebalance_experts(layer, good, num_shards=3)
    with pytest.raises(ValueError, match="num_slots"):
        mi.plan_placement(good, num_shards=4, num_slots=-1)
    with pytest.raises(ValueError, match="tolerance"):
        mi.plan_placement(good, num_shards=4, tolerance=1.5)
    with pytest.raises(ValueError, match="one array per"):
        me.rebalance_experts(layer, [good, good], num_shards=4)
    with pytest.raises(ValueError, match="no `MoELayer`"):
        me.rebalance_experts({"w": jnp.ones(3)}, good, num_shards=4)
    with pytest.raises(ValueError, match="permutation"):
        mi.plan_placement(good, num_shards=4, current=np.zeros(16, int))
    with pytest.raises(ValueError, match="traced"):
        jax.jit(lambda l: mi.plan_placement(l, num_shards=4))(jnp.ones(16))
    with pytest.raises(ValueError, match="permutation"):
        mi.permute_experts(layer, np.zeros(16, int))
    with pytest.raises(ValueError, match="does not start with"):
        mi.permute_experts(layer, np.arange(8))
