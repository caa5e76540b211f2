"""One value per setting: the layer holds its config once, each stage holds the
settings it computes with, `MoELayer.with_config` rebuilds the stages a change
describes (no frozen module mutated), and a router whose output does not fit the
layer's config is refused."""

import copy
import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_devices, make_layer, mesh, tokens

import moe_eqx as me


def _geglu_experts(experts, rows, sizes):
    """`gelu(x Wg) * (x Wu) @ Wd` per group of rows, written out."""
    w_gu, w_d = np.asarray(experts.w_gate_up), np.asarray(experts.w_down)
    f = w_d.shape[1]
    out, start = [], 0
    for e, n in enumerate(np.asarray(sizes)):
        h = np.asarray(rows[start : start + n]) @ w_gu[e]
        g = np.asarray(jax.nn.gelu(jnp.asarray(h[:, :f]), approximate=False))
        out.append((g * h[:, f:]) @ w_d[e])
        start += n
    return np.concatenate(out)


def _configs(tree) -> list:
    """Every `MoEConfig` anywhere in `tree` (static fields included)."""
    found = []

    def walk(node):
        if isinstance(node, me.MoEConfig):
            found.append(node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))
        elif isinstance(node, (list, tuple)):
            for n in node:
                walk(n)

    walk(tree)
    return found


def test_a_changed_setting_changes_every_stage(getkey):
    """`with_config(activation="geglu")`: the layer, `Experts.__call__` and the
    oracle all compute GeGLU; the original layer is unchanged."""
    layer = make_layer(getkey())
    new = layer.with_config(activation="geglu")
    assert layer.config.activation == "swiglu"
    assert isinstance(layer.experts.activation, me.SwiGLU)
    assert isinstance(new.experts.activation, me.GeGLU)
    rows, sizes = tokens(getkey(), 16), jnp.full((8,), 2, jnp.int32)
    out = new.experts(rows, sizes)
    np.testing.assert_allclose(
        out, _geglu_experts(new.experts, rows, sizes), rtol=1e-5, atol=1e-5
    )
    assert not np.allclose(out, layer.experts(rows, sizes), atol=1e-3)
    x = tokens(getkey(), 16)
    y, _ = new(x)
    np.testing.assert_allclose(y, me.reference_moe(new, x), rtol=2e-5, atol=2e-5)
    assert not np.allclose(y, layer(x)[0], atol=1e-3)


def test_the_config_is_held_once(getkey):
    """The layer holds one `MoEConfig`; its stages hold their own settings, not a
    copy of it."""
    layer = make_layer(getkey(), top_k=3, shared_d_ff=8, num_slots=1)
    assert _configs(layer) == [layer.config]
    for stage in (layer.router, layer.experts, layer.shared_experts):
        assert not hasattr(stage, "config")
    assert layer.router.top_k == 3
    # And the count can fail: a second config beside the layer's is found.
    assert len(_configs((layer, [layer.config]))) == 2


def test_routing_settings_change_through_with_config(getkey):
    """`with_config` rebuilds the router it describes: `top_k`, the score and the
    selection bias take effect, against the oracle on one device and at EP4."""
    layer = make_layer(getkey())
    new = layer.with_config(top_k=3, score_func="sigmoid", norm_topk=False)
    assert (new.router.top_k, type(new.router.score)) == (3, me.Sigmoid)
    assert new.router.weight is layer.router.weight
    x = tokens(getkey(), 32)
    for m in (None, mesh(4)):
        y, stats = new(x, mesh=m)
        assert int(jnp.sum(stats.expert_counts)) == 32 * 3
        np.testing.assert_allclose(y, me.reference_moe(new, x), rtol=2e-5, atol=2e-5)


def test_a_config_changed_in_one_place_is_refused(getkey):
    """A config swapped in with `eqx.tree_at` alone, whose router still routes to 2
    experts per token: the layer refuses the router's output, naming it."""
    layer = make_layer(getkey())
    cfg = dataclasses.replace(layer.config, top_k=3)
    bad = eqx.tree_at(lambda l: l.config, layer, cfg)
    x = tokens(getkey(), 8)
    match = r"`router.top_k` is 2, the config describes 3"
    with pytest.raises(ValueError, match=match):
        bad(x)
    with pytest.raises(ValueError, match=match):
        bad(x, mesh=mesh(4))
    with pytest.raises(ValueError, match=match):
        me.reference_moe(bad, x)


def test_with_config_keeps_a_router_of_ones_own(getkey):
    """A user's router is kept as it is by `with_config` (the built-in router's
    settings do not apply to it)."""
    from test_own_stages import HashRouter

    layer = make_layer(getkey())
    own = HashRouter.of(layer.router, vocab=11, key=getkey())
    mine = eqx.tree_at(lambda l: l.router, layer, own)
    new = mine.with_config(num_slots=1, activation="geglu")
    assert eqx.tree_equal(new.router, own)
    assert isinstance(new.experts.activation, me.GeGLU)


def test_with_config_refuses_arrays_that_do_not_fit(getkey):
    layer = make_layer(getkey())
    with pytest.raises(ValueError, match=r"w_gate_up.*do not fit"):
        layer.with_config(d_ff=32)


def test_shard_model_with_fsdp_axes_leaves_the_layer(getkey):
    layer = make_layer(getkey())
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=cpu_devices())
    placed = me.shard_model(layer, m, fsdp_axes="data")
    assert layer.config.fsdp_axes == ()
    assert placed.config.fsdp_axes == ("data",)


def test_with_config_turns_parameters_on_and_off(getkey):
    """A change that adds a parameter gives it the constructor's value (a zero
    selection bias, a norm weight of ones), the others kept; one that removes a
    parameter drops it."""
    layer = make_layer(getkey())
    on = layer.with_config(
        use_router_bias=True, output=me.OutputTransform(bias=True, norm_eps=1e-6)
    )
    np.testing.assert_array_equal(on.router.bias, np.zeros(8))
    np.testing.assert_array_equal(on.output_bias, np.zeros(16))
    np.testing.assert_array_equal(on.output_norm, np.ones(16))
    assert on.experts.w_gate_up is layer.experts.w_gate_up
    off = on.with_config(use_router_bias=False, output=me.OutputTransform())
    assert off.router.bias is None and off.output_bias is None
    x = tokens(getkey(), 16)
    np.testing.assert_allclose(off(x)[0], layer(x)[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(on(x)[0], me.reference_moe(on, x), rtol=2e-5, atol=2e-5)


def _with_static(stage, **settings):
    """`stage` with static settings replaced in place of its constructor (which
    takes a config): a stage's setting changed alone."""
    new = copy.copy(stage)
    for name, value in settings.items():
        object.__setattr__(new, name, value)
    return new


def test_every_setting_changed_in_one_place_is_refused_or_used(getkey):
    """Each static model setting changed at one place only (the config swapped in
    with `eqx.tree_at`, or a stage's own setting) is a clear error naming it, never
    the same output computed from the other copy; a setting held only by the config
    (`routed_scaling_factor`, the output norm's epsilon) changes the output, and so
    does an optional array set on a layer whose config has none (the stage's own)."""
    cfg = me.MoEConfig(
        d_model=16,
        d_ff=8,
        num_experts=8,
        top_k=2,
        shared_d_ff=8,
        output=me.OutputTransform(norm_eps=1e-6),
    )
    layer = me.MoELayer(cfg, key=getkey())
    x = tokens(getkey(), 16)
    y = layer(x)[0]

    def config(**changes):
        return eqx.tree_at(
            lambda l: l.config, layer, dataclasses.replace(cfg, **changes)
        )

    refused = {
        "router.norm_topk": config(norm_topk=False),
        "router.score": config(score_func="sigmoid"),
        "router.num_groups": config(num_groups=2, top_groups=1),
        "router.selection": config(selection=me.Selection(group_top=1)),
        "router.weighting": config(weighting=me.Weighting(floor=1e-6)),
        "experts.activation": config(activation="geglu"),
        "shared_experts.scale": config(shared=me.SharedCombination(scale=0.5)),
        "experts.activation is GeGLU": eqx.tree_at(
            lambda l: l.experts,
            layer,
            _with_static(layer.experts, activation=me.GeGLU()),
        ),
        "router.norm_topk is False": eqx.tree_at(
            lambda l: l.router, layer, _with_static(layer.router, norm_topk=False)
        ),
        "shared_experts.scale is 0.5": eqx.tree_at(
            lambda l: l.shared_experts,
            layer,
            _with_static(layer.shared_experts, scale=0.5),
        ),
    }
    for name, bad in refused.items():
        with pytest.raises(ValueError, match=re.escape(f"`{name.split()[0]}")):
            bad(x)
    used = {
        "router.bias": eqx.tree_at(
            lambda l: l.router.bias,
            layer,
            jnp.arange(8.0),
            is_leaf=lambda a: a is None,
        ),
        "routed_scaling_factor": config(routed_scaling_factor=2.0),
        "output.norm_eps": config(output=me.OutputTransform(norm_eps=0.5)),
    }
    for name, changed in used.items():
        assert not np.allclose(changed(x)[0], y), name
