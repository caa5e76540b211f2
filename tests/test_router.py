import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import moe_eqx as me


def _router(key, **kw):
    cfg = me.MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=3, **kw)
    return me.Router(cfg, key=key)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_topk_distinct_and_normalised(getkey, score_func):
    router = _router(getkey(), score_func=score_func)
    x = jr.normal(getkey(), (32, 8))
    r = router(x)
    assert r.weights.dtype == jnp.float32 and r.experts.dtype == jnp.int32
    np.testing.assert_allclose(jnp.sum(r.weights, -1), 1.0, rtol=1e-6)
    assert all(len(set(row)) == 3 for row in np.asarray(r.experts).tolist())
    counts = np.bincount(np.asarray(r.experts).ravel(), minlength=8)
    np.testing.assert_array_equal(r.counts, counts)
    # The chosen experts are the top-3 scores.
    logits = np.asarray(x) @ np.asarray(router.weight)
    top = np.argsort(-logits, axis=-1)[:, :3]
    np.testing.assert_array_equal(np.sort(r.experts, -1), np.sort(top, -1))


def test_softmax_weights_are_renormalised_probs(getkey):
    router = _router(getkey())
    x = jr.normal(getkey(), (16, 8))
    r = router(x)
    probs = jax.nn.softmax(x @ router.weight, -1)
    chosen = jnp.take_along_axis(probs, r.experts, -1)
    np.testing.assert_allclose(
        r.weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-5
    )


@pytest.mark.parametrize("norm_topk", [True, False])
def test_sigmoid_weights_follow_norm_topk(getkey, norm_topk):
    """DeepSeek-V3: raw sigmoid scores of the chosen experts with norm_topk=False."""
    router = _router(getkey(), score_func="sigmoid", norm_topk=norm_topk)
    x = jr.normal(getkey(), (16, 8))
    r = router(x)
    chosen = jnp.take_along_axis(jax.nn.sigmoid(x @ router.weight), r.experts, -1)
    want = chosen / chosen.sum(-1, keepdims=True) if norm_topk else chosen
    np.testing.assert_allclose(r.weights, want, rtol=1e-5)


def test_bias_changes_selection_not_weights(getkey):
    router = _router(getkey(), use_router_bias=True)
    x = jr.normal(getkey(), (16, 8))
    biased = eqx.tree_at(lambda r: r.bias, router, jnp.zeros(8).at[5].set(100.0))
    r = biased(x)
    assert np.all(np.any(np.asarray(r.experts) == 5, axis=1))
    probs = jax.nn.softmax(x @ router.weight, -1)
    chosen = jnp.take_along_axis(probs, r.experts, -1)
    np.testing.assert_allclose(
        r.weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-5
    )
    g = jax.grad(lambda rt: jnp.sum(rt(x).weights ** 2))(biased)
    np.testing.assert_array_equal(g.bias, 0.0)


def test_group_limited_routing(getkey):
    router = _router(getkey(), num_groups=4, top_groups=2)
    x = jr.normal(getkey(), (64, 8))
    r = router(x)
    groups = np.asarray(r.experts) // 2
    assert all(len(set(g)) <= 2 for g in groups.tolist())
    # The chosen groups are the two with the largest sum of their (two) scores.
    scores = np.asarray(jax.nn.softmax(x @ router.weight, -1)).reshape(64, 4, 2).sum(-1)
    best = np.sort(np.argsort(-scores, -1)[:, :2], -1)
    for row, b in zip(groups.tolist(), best.tolist()):
        assert set(row) <= set(b)


def test_aux_losses(getkey):
    router = _router(getkey())
    x = jr.normal(getkey(), (64, 8))
    r = router(x)
    frac = np.asarray(r.counts) / (64 * 3)
    probs = np.asarray(jax.nn.softmax(x @ router.weight, -1)).mean(0)
    np.testing.assert_allclose(r.load_balance_loss, 8 * np.sum(frac * probs), rtol=1e-5)
    lse = np.log(np.exp(np.asarray(x @ router.weight)).sum(-1))
    np.testing.assert_allclose(r.router_z_loss, np.mean(lse**2), rtol=1e-5)


def test_update_router_bias():
    bias = jnp.zeros(4)
    new = me.update_router_bias(bias, jnp.array([10, 0, 5, 5], jnp.int32), rate=0.1)
    np.testing.assert_allclose(new, [-0.1, 0.1, 0.0, 0.0])


@pytest.mark.parametrize("num_shards", [1, 4])
def test_aux_loss_gradients_expert_parallel(getkey, num_shards):
    """`stats.load_balance_loss` and `stats.router_z_loss` are differentiable with
    respect to the router under expert parallelism (combined over the shards), with
    the gradients of the same losses computed from the router on all the tokens."""
    import equinox as eqx
    from helpers import make_layer, mesh, tokens

    layer = make_layer(getkey(), mesh_size=num_shards)
    x = tokens(getkey(), 64)
    m = None if num_shards == 1 else mesh(num_shards)

    def losses(router):
        stats = eqx.tree_at(lambda l: l.router, layer, router)(x, mesh=m)[1]
        return stats.load_balance_loss + 0.1 * stats.router_z_loss

    def direct(router):
        r = router(x)
        return r.load_balance_loss + 0.1 * r.router_z_loss

    got = jax.jit(jax.grad(losses))(layer.router)
    want = jax.grad(direct)(layer.router)
    assert float(jnp.max(jnp.abs(want.weight))) > 0
    np.testing.assert_allclose(got.weight, want.weight, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(
        jax.jit(losses)(layer.router), direct(layer.router), rtol=1e-5
    )


def test_router_from_its_own_fields(getkey):
    """A router built from its fields is the one a config builds; each field changed
    with `dataclasses.replace` changes the routing; bad fields are clear errors."""
    import dataclasses

    cfg = me.MoEConfig(
        d_model=8, d_ff=8, num_experts=8, top_k=3, use_router_bias=True, num_groups=2
    )
    from_cfg = me.Router(cfg, key=getkey())
    bias = jr.normal(getkey(), (8,))
    r = me.Router(
        from_cfg.weight, bias, top_k=3, num_experts=8, num_groups=2, top_groups=1
    )
    x = jr.normal(getkey(), (32, 8))
    want = eqx.tree_at(lambda m: m.bias, from_cfg, bias)(x)
    got = r(x)
    np.testing.assert_array_equal(got.experts, want.experts)
    np.testing.assert_array_equal(got.weights, want.weights)
    # One group of 4 experts of the two: every choice inside one half.
    assert np.all(np.ptp(np.asarray(got.experts) // 4, axis=-1) == 0)
    two = dataclasses.replace(r, top_k=2)(x)
    assert two.experts.shape == (32, 2)
    free = dataclasses.replace(r, top_groups=2)(x)
    assert np.any(np.ptp(np.asarray(free.experts) // 4, axis=-1) > 0)
    raw = dataclasses.replace(r, norm_topk=False)(x)
    assert not np.allclose(np.sum(raw.weights, -1), 1.0)
    sig = dataclasses.replace(r, score="sigmoid")(x)
    assert not np.allclose(sig.weights, got.weights)
    with pytest.raises(ValueError, match=r"Router: `top_k` \(9\) must not exceed"):
        dataclasses.replace(r, top_k=9)
    with pytest.raises(ValueError, match=r"Router: `top_groups` \(1\) groups of 4"):
        dataclasses.replace(r, top_k=5)
    with pytest.raises(ValueError, match=r"`weight` must be \[d_model, 9\]"):
        dataclasses.replace(r, num_shared=1)
    with pytest.raises(ValueError, match="divisible by `num_groups`"):
        dataclasses.replace(r, num_groups=3, top_groups=1)
    with pytest.raises(ValueError, match=r"`bias` must be \[8\]"):
        dataclasses.replace(r, bias=jnp.zeros(7))
    with pytest.raises(TypeError, match="needs `top_k=` and `num_experts=`"):
        me.Router(from_cfg.weight)
    with pytest.raises(ValueError, match="needs a `key`"):
        me.Router(cfg)


def test_picked_columns_on_the_tpu_equal_the_gather(getkey):
    """A pick of columns (the router's chosen scores; a placement's physical
    position of each pair's expert, one table for every row): on a TPU a masked sum
    over the columns, with no gather in the TPU program; elsewhere a gather; both
    equal, values and first and second derivatives, an infinite score among them."""
    from moe_eqx._rules import _gathered_pick, _masked_pick, pick_columns

    scores = jr.normal(getkey(), (40, 12)).at[3, 4].set(-jnp.inf)
    experts = jnp.argsort(-scores, axis=-1)[:, :3].astype(jnp.int32)
    experts = experts.at[3, 0].set(4)
    one = jnp.arange(12, dtype=jnp.int32)[::-1][None] * 5
    for fn in (_masked_pick, _gathered_pick):
        np.testing.assert_array_equal(
            fn(scores, experts), scores[jnp.arange(40)[:, None], experts]
        )
        np.testing.assert_array_equal(fn(one, experts), (11 - experts) * 5)
    finite = jnp.where(jnp.isfinite(scores), scores, 0.0)
    dy = jr.normal(getkey(), (40, 3))

    def loss(fn):
        return lambda s: jnp.sum(jnp.sin(fn(s, experts)) * dy)

    def second(f):
        return jax.grad(lambda s: jnp.sum(jax.grad(f)(s) ** 3))

    for grad in (jax.grad, second):
        np.testing.assert_allclose(
            grad(loss(_masked_pick))(finite),
            grad(loss(_gathered_pick))(finite),
            rtol=1e-6,
            atol=1e-7,
        )
    for table in (scores, one):
        lowered = {
            p: jax.jit(pick_columns)
            .trace(table, experts)
            .lower(lowering_platforms=(p,))
            .as_text()
            for p in ("tpu", "cpu")
        }
        assert "gather" not in lowered["tpu"]
        assert "gather" in lowered["cpu"]
