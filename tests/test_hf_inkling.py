"""Inkling (`inkling_text`, and `inkling_mm_model` wrapping it): its shared experts
are scored by the router and normalised with the chosen routed experts
(`SharedCombination.scored`); the layer against `transformers`' own block through
`config_from_hf(config.to_dict())` and the importer, on one device and EP4, and
`layers_from_hf` on a `save_pretrained` model directory; the config feature against
the dense oracle, and its settings validated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh
from test_hf_config import H, _torch_value_and_grad
from test_hf_family_settings import _assert_matches_block, _drawn, _module, _saved

import moe_eqx as me

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
CONFIG = transformers.CONFIG_MAPPING

# Two shared experts, top-2 of 8 routed ones; `route_scale` and the drawn
# `global_scale` change the output.
_TEXT = dict(
    hidden_size=H, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=2, route_scale=1.7, num_attention_heads=2, num_key_value_heads=2,
)  # fmt: skip


def _block(**kw):
    cfg = CONFIG["inkling_text"](**(_TEXT | kw))
    return cfg, _drawn(_module("inkling").InklingMoE(cfg))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(3), (32, H), jnp.float32)


@pytest.mark.parametrize("num_shards", [1, 4])
def test_inkling_matches_its_block(num_shards, x):
    """Output, input gradient and the dense oracle equal the block's."""
    cfg, block = _block()
    layer = _assert_matches_block(block, cfg.to_dict(), x, num_shards)
    assert layer.config.shared.scored == 2 and layer.config.shared_d_ff == 24
    assert layer.config.shared.scored == layer.router.num_shared == 2


# The wrapper: the text model's config under `text_config`, its weights under
# `model.language_model.`; a dense first layer, skipped.
_MM_TEXT = _TEXT | dict(
    intermediate_size=24, num_hidden_layers=2, head_dim=8, vocab_size=64,
    pad_token_id=0, bos_token_id=0, eos_token_id=0, mlp_layer_types=["dense", "sparse"],
    swa_head_dim=8, swa_num_attention_heads=2, swa_num_key_value_heads=2, d_rel=4,
)  # fmt: skip


def test_wrapper_reads_its_text_models_moe_layers(tmp_path, x):
    """`config_from_hf` of `inkling_mm_model` is its text model's; `layers_from_hf`
    on a `save_pretrained` directory finds the MoE layer, equal to its block on one
    device and with EP4's experts."""
    cfg = CONFIG["inkling_mm_model"](
        text_config=_MM_TEXT,
        vision_config=dict(
            hidden_size=H, num_hidden_layers=1, num_attention_heads=2, patch_size=2
        ),
        audio_config=dict(n_mel_bins=4, mel_vocab_size=8),
    )
    config = me.config_from_hf(cfg.to_dict())
    assert config == me.config_from_hf(cfg.text_config.to_dict())
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    _saved(model, tmp_path)
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == [1] and layers[1].config == config
    y_hf, _ = _torch_value_and_grad(model.model.language_model.layers[1].mlp, x)
    tolerance = dict(rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
    np.testing.assert_allclose(np.asarray(layers[1](x)[0]), y_hf, **tolerance)
    m = mesh(4)
    y = np.asarray(me.layers_from_hf(tmp_path, 1, mesh=m)[1](x, mesh=m)[0])
    np.testing.assert_allclose(y, y_hf, **tolerance)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
        (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
        (dict(route_scale=None), "missing key 'route_scale'"),
    ],
)
def test_settings_it_does_not_compute_are_refused_by_name(change, message):
    hf = CONFIG["inkling_text"](**_TEXT).to_dict() | change
    with pytest.raises(ValueError, match=message):
        me.config_from_hf(hf)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(shared_d_ff=10), "positive multiple"),
        (dict(shared_d_ff=0), "positive multiple"),
        (dict(shared_gate=True), "no `shared_gate`"),
        (dict(score_func="softmax"), "per-expert scores"),
    ],
)
def test_shared_in_norm_is_validated(fields, message):
    shared = me.SharedCombination(scored=4)
    base = dict(score_func="sigmoid", shared_d_ff=12, shared=shared)
    with pytest.raises(ValueError, match=message):
        me.MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, **(base | fields))


@pytest.mark.parametrize("num_shards", [1, 4])
def test_shared_in_norm_layer_matches_the_oracle(num_shards, x):
    """A drawn layer whose router scores its shared experts (no Hugging Face block)
    equals the dense
    oracle on one device and under EP4, with forced expert ids (routing replay)
    too; each token's routed and shared weights sum to 1."""
    config = me.MoEConfig(
        d_model=H, d_ff=8, num_experts=8, top_k=2, score_func="sigmoid",
        shared_d_ff=16, use_router_bias=True,
        shared=me.SharedCombination(scored=2, scale=1.5),
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
