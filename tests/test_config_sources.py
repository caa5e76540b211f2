"""One value per setting: each stage holds the settings it computes with and the
layer holds no config (`layer.config` is read from the stages), a setting changed at
its home takes effect and shows in `layer.config`, `MoELayer.with_config` rebuilds
the stages a change describes (no frozen module mutated), and a router whose output
does not fit the layer is refused."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_nothing_lost, cpu_devices, make_layer, mesh, tokens

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


ROUND_TRIP = [
    dict(),
    dict(
        score_func="sigmoid",
        num_groups=4,
        top_groups=2,
        use_router_bias=True,
        routed_scaling_factor=2.5,
        shared_d_ff=8,
        shared_gate=True,
        activation="geglu",
        selection=me.Selection(group_top=1),
        weighting=me.Weighting(floor=1e-6),
        output=me.OutputTransform(bias=True, norm_eps=1e-5),
        buffer_factor=1.5,
        num_slots=1,
    ),
    dict(
        score_func="sigmoid",
        num_identity_experts=2,
        shared_d_ff=8,
        shared=me.SharedCombination(scale=0.5, activation="relu2", scored=2),
        expert_options=me.ExpertOptions(bias=True),
    ),
    dict(expert_options=me.ExpertOptions(weight_on_input=True), top_k=1),
]


@pytest.mark.parametrize(
    "changes", ROUND_TRIP, ids=["plain", "deepseek", "scored", "llama4"]
)
def test_the_config_is_read_from_the_stages(getkey, changes):
    """No `MoEConfig` anywhere in a layer's pytree (static fields included), no
    stage holds one, and the config the stages describe is the one the layer was
    built from."""
    cfg = me.MoEConfig(
        **{**dict(d_model=16, d_ff=8, num_experts=8, top_k=2), **changes}
    )
    layer = me.MoELayer(cfg, key=getkey())
    assert _configs(layer) == []
    for stage in (layer.router, layer.experts, layer.shared_experts, layer.output):
        assert not hasattr(stage, "config")
    assert layer.config == cfg
    # And the count can fail: a config beside the layer is found.
    assert len(_configs((layer, [cfg]))) == 1


def _differences(a: me.MoEConfig, b: me.MoEConfig) -> dict:
    return {
        f.name: getattr(b, f.name)
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    }


def test_every_setting_changes_at_its_home(getkey):
    """Each model setting changed where it lives (`dataclasses.replace` of its stage,
    swapped in with `eqx.tree_at`) changes the output, shows in `layer.config`, and
    gives what `with_config` gives for the config it describes (on one device and
    at EP4): the config is a complete view of the stages."""
    cfg = me.MoEConfig(
        d_model=16,
        d_ff=8,
        num_experts=8,
        top_k=2,
        shared_d_ff=8,
        use_router_bias=True,
        output=me.OutputTransform(norm_eps=1e-6),
    )
    layer = me.MoELayer(cfg, key=getkey())
    layer = eqx.tree_at(lambda l: l.router.bias, layer, jnp.linspace(-0.3, 0.3, 8))
    x = tokens(getkey(), 16)
    y = layer(x)[0]

    def at(where, **settings):
        return eqx.tree_at(where, layer, dataclasses.replace(where(layer), **settings))

    def router(l):
        return l.router

    def experts(l):
        return l.experts

    def shared(l):
        return l.shared_experts

    def output(l):
        return l.output

    homes = {
        "router.top_k": at(router, top_k=3),
        "router.norm_topk": at(router, norm_topk=False),
        "router.score": at(router, score=me.Sigmoid()),
        "router.groups": at(router, num_groups=2, top_groups=1),
        "router.selection": at(router, selection=me.Selection(bias_on_logits=True)),
        "router.weighting": at(router, weighting=me.Weighting(floor=0.4)),
        "router.bias": eqx.tree_at(lambda l: l.router.bias, layer, jnp.zeros(8)),
        "experts.activation": at(experts, activation=me.GeGLU()),
        "experts.weight_on_input": at(experts, weight_on_input=True),
        "shared_experts.scale": at(shared, scale=0.5),
        "shared_experts.activation": at(shared, activation=me.GeGLU()),
        "output.routed_scale": at(output, routed_scale=2.0),
        "output.norm_eps": at(output, norm_eps=0.5),
    }
    for name, changed in homes.items():
        changes = _differences(layer.config, changed.config)
        if name == "router.bias":  # the array's values, not a setting
            assert changes == {}
            changes = None
        else:
            assert changes, name
        for m in (None, mesh(4)):
            got, stats = changed(x, mesh=m)
            assert_nothing_lost(stats, x.shape[0], changed.config.top_k)
            assert not np.allclose(got, y, atol=1e-4), name
            if changes is not None:
                want = layer.with_config(**changes)(x, mesh=m)[0]
                np.testing.assert_allclose(
                    got, want, rtol=1e-6, atol=1e-6, err_msg=name
                )
        np.testing.assert_allclose(
            changed(x)[0], me.reference_moe(changed, x), rtol=2e-5, atol=2e-5
        )


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


def test_an_activation_that_does_not_fit_the_weights_is_refused(getkey):
    """An ungated activation swapped onto gated weights (or the reverse) is a clear
    error when the stage is built, not a shape error deep in a product."""
    layer = make_layer(getkey(), shared_d_ff=8)
    d_ff = layer.config.d_ff
    with pytest.raises(
        ValueError, match=rf"`Experts.w_gate_up` has {2 * d_ff} columns.*ReLU2"
    ):
        dataclasses.replace(layer.experts, activation=me.ReLU2())
    with pytest.raises(ValueError, match=r"`SharedExperts.w_gate_up` has 16 columns"):
        dataclasses.replace(layer.shared_experts, activation="relu2")
    ungated = me.MoELayer(
        dataclasses.replace(layer.config, activation="relu2"), key=getkey()
    )
    with pytest.raises(ValueError, match=rf"has {d_ff} columns.*needs {2 * d_ff}"):
        dataclasses.replace(ungated.experts, activation=me.SwiGLU())


def test_the_config_cannot_be_swapped_in(getkey):
    """`layer.config` is read, not held: swapping one in with `eqx.tree_at` is a
    clear error that says where settings are changed."""
    layer = make_layer(getkey())
    cfg = dataclasses.replace(layer.config, top_k=3)
    with pytest.raises(ValueError, match=r"with_config"):
        eqx.tree_at(lambda l: l.config, layer, cfg)


def test_with_config_keeps_a_router_of_ones_own(getkey):
    """A user's router is kept as it is by `with_config` (the built-in router's
    settings do not apply to it)."""
    from test_own_stages import HashRouter

    layer = make_layer(getkey())
    own = HashRouter.of(layer.router, vocab=11, key=getkey())
    mine = eqx.tree_at(lambda l: l.router, layer, own)
    # Its `top_k` and expert counts read from the `Routing` it returns (it
    # declares no `num_experts`), the built-in router's other settings defaulted.
    assert (mine.config.top_k, mine.config.num_experts) == (2, 8)
    wider = dataclasses.replace(own, top_k=3)
    assert eqx.tree_at(lambda l: l.router, layer, wider).config.top_k == 3
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


def test_sizes_are_the_whole_weights_and_checked(getkey):
    """The experts record the sizes of their whole weights, so a layer's config is
    the same for a tree of its structure with other leaves (an optimizer state with
    `None` for the integer arrays); an expert weight of other sizes swapped in with
    `eqx.tree_at` is refused when the layer is called, naming the stage."""
    layer = make_layer(getkey(), shared_d_ff=8)
    floats = eqx.filter(layer, eqx.is_inexact_array)
    assert floats.expert_ids is None and floats.config == layer.config
    assert layer.experts.sizes == (8, 16, 24) and layer.shared_experts.sizes == (16, 8)
    x = tokens(getkey(), 8)
    fewer = eqx.tree_at(lambda l: l.experts.w_down, layer, layer.experts.w_down[:, :20])
    with pytest.raises(
        ValueError, match=r"`experts`'s weights have sizes \(8, 16, 20\)"
    ):
        fewer(x)
    rebuilt = dataclasses.replace(
        layer.experts,
        w_gate_up=layer.experts.w_gate_up[..., :40],
        w_down=layer.experts.w_down[:, :20],
    )
    assert rebuilt.sizes == (8, 16, 20)


def test_stage_settings_are_checked_where_they_live():
    """Bad settings of the stages built from their own fields are clear errors
    naming the stage's field."""
    with pytest.raises(ValueError, match=r"`LayerOutput.routed_scale` must be a pos"):
        me.LayerOutput(routed_scale=0)
    with pytest.raises(ValueError, match=r"`LayerOutput.norm` .* go together"):
        me.LayerOutput(norm=jnp.ones(4))
    with pytest.raises(ValueError, match=r"`LayerOutput.norm_eps` must be a positive"):
        me.LayerOutput(norm=jnp.ones(4), norm_eps=-1.0)
    w = jnp.ones((4, 8, 6))
    with pytest.raises(ValueError, match=r"`SharedExperts.scale` must be a finite"):
        me.SharedExperts(jnp.ones((8, 6)), jnp.ones((3, 8)), scale=float("inf"))
    with pytest.raises(TypeError, match=r"needs `w_down`"):
        me.Experts(w)
    with pytest.raises(ValueError, match=r"`key` is for `Experts\(config"):
        me.Experts(w, jnp.ones((4, 3, 8)), key=jax.random.key(0))
