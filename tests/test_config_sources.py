"""One value per setting: the layer's stages read their settings from the layer's
config, `MoELayer.with_config` changes it everywhere (no frozen module mutated), and a
layer whose stages hold another config is refused."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_devices, make_layer, tokens

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


def test_a_changed_setting_changes_every_stage(getkey):
    """`with_config(activation="geglu")`: the layer, `Experts.__call__` and the
    oracle all compute GeGLU; the original layer is unchanged."""
    layer = make_layer(getkey())
    new = layer.with_config(activation="geglu")
    assert layer.config.activation == layer.experts.activation.name == "swiglu"
    assert new.experts.activation.name == "geglu"
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


def test_stages_hold_no_copies_of_settings(getkey):
    layer = make_layer(getkey(), top_k=3)
    for stage in (layer.router, layer.experts):
        assert stage.config is layer.config
        static = [f.name for f in dataclasses.fields(stage) if f.metadata.get("static")]
        assert static == []
    assert layer.router.top_k == 3


def test_a_config_changed_in_one_place_is_refused(getkey):
    layer = make_layer(getkey())
    cfg = dataclasses.replace(layer.config, activation="geglu")
    bad = eqx.tree_at(lambda l: l.config, layer, cfg)
    x = tokens(getkey(), 8)
    match = r"`layer\.router\.config` differs .* \['activation'\]"
    with pytest.raises(ValueError, match=match):
        bad(x)
    with pytest.raises(ValueError, match=match):
        me.reference_moe(bad, x)


def test_with_config_refuses_arrays_that_do_not_fit(getkey):
    layer = make_layer(getkey())
    with pytest.raises(ValueError, match=r"w_gate_up.*do not fit"):
        layer.with_config(d_ff=32)


def test_shard_model_with_fsdp_axes_leaves_the_layer(getkey):
    layer = make_layer(getkey())
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=cpu_devices())
    placed = me.shard_model(layer, m, fsdp_axes="data")
    assert layer.config.fsdp_axes == ()
    assert placed.config.fsdp_axes == placed.experts.config.fsdp_axes == ("data",)
