"""Hugging Face families whose blocks reuse OLMoE's, Qwen3-MoE's, GraniteMoE's or
GPT-OSS's with a change (`flex_olmo`, `mellum`, `flint`, `lara_mini`, `laguna`,
`kolibri1`, `qwen4_exp`, `granitemoe_swa`, `openai_privacy_filter`), each against
`transformers`' own block: a key honoured or refused by name, the variant each adds
(a soft-cap, a selection bias on the logits, gate and up in halves) shown to bite;
and the families refused with their reason (`zaya`, `doge`, `vitpose_backbone`)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh
from test_hf_config import H, _state_dict, _torch_value_and_grad
from test_hf_family_settings import _assert_matches_block, _drawn, _module

import moe_eqx as me

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Families, each against its block (one device and EP4) through
# `config_from_hf(config.to_dict())` and the importer.

_SMALL = dict(
    hidden_size=H, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2
)


def _flex_olmo():
    cfg = transformers.FlexOlmoConfig(
        **_SMALL, intermediate_size=12, num_experts=8, norm_topk_prob=False
    )
    return cfg, _module("flex_olmo").FlexOlmoSparseMoeBlock(cfg)


def _flint():
    cfg = transformers.FlintConfig(
        **_SMALL, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        num_experts=8, norm_topk_prob=True,
    )  # fmt: skip
    return cfg, _module("flint").FlintSparseMoeBlock(cfg)


def _laguna(softcap=0.0):
    cfg = transformers.LagunaConfig(
        **_SMALL, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        num_experts=8, moe_routed_scaling_factor=1.5,
        moe_router_logit_softcapping=softcap,
    )  # fmt: skip
    return cfg, _module("laguna").LagunaSparseMoeBlock(cfg)


def _laguna_softcap():
    return _laguna(softcap=1.0)


def _lara_mini():
    cfg = transformers.LaraMiniConfig(
        **_SMALL, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        num_experts=8, norm_topk_prob=False,
    )  # fmt: skip
    return cfg, _module("lara_mini").LaraMiniSparseMoeBlock(cfg)


def _mellum():
    cfg = transformers.MellumConfig(
        **_SMALL, moe_intermediate_size=12, num_experts=8, norm_topk_prob=True
    )
    return cfg, _module("mellum").MellumSparseMoeBlock(cfg)


def _granitemoe_swa():
    from test_hf_config import _with_shared_mlp

    cfg = transformers.GraniteMoeSWAConfig(
        **_SMALL, intermediate_size=24, num_local_experts=8, shared_intermediate_size=20
    )
    module = _module("granitemoe_swa")
    block = _with_shared_mlp(module.GraniteMoeSWAMoE, module.GraniteMoeSWAMLP)
    return cfg, block(cfg)


_QWEN4_TEXT = dict(
    _SMALL, moe_intermediate_size=12, shared_expert_intermediate_size=20,
    num_experts=8, norm_topk_prob=False, num_hidden_layers=2, head_dim=8,
    vocab_size=64, hc_count=2, hc_lowrank=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
)  # fmt: skip


def _qwen4_exp_text():
    cfg = transformers.CONFIG_MAPPING["qwen4_exp_text"](**_QWEN4_TEXT)
    return cfg, _module("qwen4_exp").Qwen4ExpTextSparseMoeBlock(cfg)


def _kolibri1():
    cfg = transformers.Kolibri1Config(
        **_SMALL, moe_intermediate_size=12, shared_expert_intermediate_size=20,
        num_experts=8, norm_topk_prob=True,
    )  # fmt: skip
    return cfg, _module("kolibri1").Kolibri1SparseMoeBlock(cfg)


_BLOCKS = {
    "kolibri1": _kolibri1,
    "granitemoe_swa": _granitemoe_swa,
    "qwen4_exp_text": _qwen4_exp_text,
    "flex_olmo": _flex_olmo,
    "flint": _flint,
    "laguna": _laguna,
    "laguna_softcap": _laguna_softcap,
    "lara_mini": _lara_mini,
    "mellum": _mellum,
}


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(7), (32, H), jnp.float32)


@pytest.mark.parametrize("name", sorted(_BLOCKS))
@pytest.mark.parametrize("num_shards", [1, 4])
def test_family_matches_its_block(x, name, num_shards):
    cfg, block = _BLOCKS[name]()
    _assert_matches_block(_drawn(block), cfg.to_dict(), x, num_shards)


@pytest.mark.parametrize(
    ("name", "key", "value", "field", "expected"),
    [
        ("flex_olmo", "norm_topk_prob", True, "norm_topk", True),
        ("flint", "norm_topk_prob", False, "norm_topk", False),
        ("flint", "shared_expert_intermediate_size", 0, "shared_d_ff", 0),
        ("laguna", "moe_routed_scaling_factor", 2.5, "routed_scaling_factor", 2.5),
        (
            "laguna",
            "moe_router_logit_softcapping",
            30.0,
            "score_func",
            me.Sigmoid(softcap=30.0),
        ),
        ("lara_mini", "norm_topk_prob", True, "norm_topk", True),
        ("mellum", "norm_topk_prob", False, "norm_topk", False),
        ("mellum", "hidden_act", "gelu", "activation", "geglu"),
    ],
)
def test_family_keys_are_honoured(name, key, value, field, expected):
    cfg, _ = _BLOCKS[name]()
    config = me.config_from_hf(cfg.to_dict() | {key: value})
    assert getattr(config, field) == expected


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("laguna", "moe_apply_router_weight_on_input", True),
        ("flint", "mlp_bias", True),
        ("mellum", "shared_expert_intermediate_size", 20),
    ],
)
def test_family_keys_it_cannot_honour_are_refused(name, key, value):
    """Laguna's router weights on the experts' inputs (which transformers does not
    implement) and a key these blocks do not read (Mellum's Qwen3-MoE block has no
    shared expert) are refused by name."""
    cfg, _ = _BLOCKS[name]()
    with pytest.raises(ValueError, match=re.escape(f"{name} config: {key}={value!r}")):
        me.config_from_hf(cfg.to_dict() | {key: value})


def test_qwen4_exp_wrapper_loads_its_text_moe_layers(x, tmp_path):
    """Qwen4-Exp (a multimodal wrapper): `config_from_hf` reads its `text_config`,
    `layers_from_hf` finds the text model's MoE layers under
    `model.language_model.` in a `save_pretrained` checkpoint, each equal to its
    block."""
    from transformers import AutoModelForImageTextToText

    vision = dict(depth=1, hidden_size=H, intermediate_size=24, num_heads=2)
    cfg = transformers.CONFIG_MAPPING["qwen4_exp"](
        text_config=_QWEN4_TEXT, vision_config=vision | dict(out_hidden_size=H)
    )
    assert me.config_from_hf(cfg.to_dict()) == me.config_from_hf(cfg.text_config)
    model = _drawn(AutoModelForImageTextToText.from_config(cfg))
    model.save_pretrained(tmp_path)
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == [0, 1]
    block = model.model.language_model.layers[1].mlp
    y_hf, _ = _torch_value_and_grad(block, x)
    y = np.asarray(layers[1](x)[0])
    np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("zaya", "its router is an MLP"),
        ("doge", "one token's two key scores come from different tokens"),
        ("vitpose_backbone", "not a text decoder.*chosen by the dataset index"),
    ],
)
def test_refused_families_name_their_reason(model_type, message):
    hf = transformers.CONFIG_MAPPING[model_type]().to_dict()
    with pytest.raises(ValueError, match=f"model_type='{model_type}'.*{message}"):
        me.config_from_hf(hf)


def test_kolibri1_selects_on_the_biased_logits(x):
    """Kolibri-1 adds its selection bias to the logits, not to their sigmoids: the
    same layer with the bias on the scores (`Selection(bias_on_logits=False)`)
    picks other experts for some tokens and differs from the block."""
    cfg, block = _kolibri1()
    block = _drawn(block)
    config = me.config_from_hf(cfg.to_dict())
    assert config.selection.bias_on_logits and config.use_router_bias
    wrong = dataclasses.replace(config, selection=me.Selection())
    layer = me.layer_from_hf_state_dict(wrong, _state_dict(block))
    y_hf, _ = _torch_value_and_grad(block, x)
    assert np.max(np.abs(np.asarray(layer(x)[0]) - y_hf)) > 1e-2 * np.abs(y_hf).max()


def test_bias_on_logits_is_validated():
    on_logits = me.Selection(bias_on_logits=True)
    base = dict(d_model=8, d_ff=8, num_experts=4, top_k=2, selection=on_logits)
    with pytest.raises(ValueError, match=r"`Selection\(bias_on_logits=True\)` needs"):
        me.MoEConfig(**base)
    with pytest.raises(ValueError, match="with group-limited routing"):
        me.MoEConfig(**base, use_router_bias=True, num_groups=2)


def _privacy_filter_config():
    return transformers.CONFIG_MAPPING["openai_privacy_filter"](
        **_SMALL, intermediate_size=12, num_local_experts=8, head_dim=8,
        num_hidden_layers=1, vocab_size=64, pad_token_id=0, eos_token_id=0,
    )  # fmt: skip


@pytest.mark.parametrize("num_shards", [1, 4])
def test_openai_privacy_filter_matches_its_block(x, num_shards):
    """OpenAI-Privacy-Filter (a token classifier, not a text decoder): GPT-OSS's
    routing (its `1/k` on the weights and `k` on the output cancel) and experts,
    gate and up columns stored in halves (`interleaved_gate_up=False`)."""
    cfg = _privacy_filter_config()
    module = _module("openai_privacy_filter")
    block = _drawn(module.OpenAIPrivacyFilterMLP(cfg))
    _assert_matches_block(
        block, cfg.to_dict(), x, num_shards, interleaved_gate_up=False
    )
    if num_shards == 1:  # read as GPT-OSS's interleaved columns, it differs
        config = me.config_from_hf(cfg.to_dict())
        layer = me.layer_from_hf_state_dict(config, _state_dict(block))
        y_hf, _ = _torch_value_and_grad(block, x)
        diff = np.max(np.abs(np.asarray(layer(x)[0]) - y_hf))
        assert diff > 1e-2 * np.abs(y_hf).max()


def test_openai_privacy_filter_model_directory(x, tmp_path):
    """`layers_from_hf` reads its checkpoint's halves, on one device and with a mesh
    (each process reading its experts' rows)."""
    model = transformers.AutoModelForTokenClassification.from_config(
        _privacy_filter_config()
    )
    _drawn(model).save_pretrained(tmp_path)
    block = model.model.layers[0].mlp
    y_hf, _ = _torch_value_and_grad(block, x)
    for m in (None, mesh(4)):
        layer = me.layers_from_hf(tmp_path, mesh=m)[0]
        y = np.asarray(layer(x, mesh=m)[0])
        np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


def test_laguna_softcap_changes_the_routing(x):
    """Laguna's soft-capped logits (`moe_router_logit_softcapping=1`): the layer
    without the cap differs from the block (the cap is active)."""
    cfg, block = _laguna_softcap()
    block = _drawn(block)
    config = me.config_from_hf(cfg.to_dict())
    assert config.score_func == me.Sigmoid(softcap=1.0)
    wrong = dataclasses.replace(config, score_func="sigmoid")
    layer = me.layer_from_hf_state_dict(wrong, _state_dict(block))
    y_hf, _ = _torch_value_and_grad(block, x)
    assert np.max(np.abs(np.asarray(layer(x)[0]) - y_hf)) > 1e-2 * np.abs(y_hf).max()


def test_router_softcap_is_validated():
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="`Sigmoid.softcap` must be"):
            me.Sigmoid(softcap=bad)


def test_granitemoe_swa_model_directory(x, tmp_path):
    """GraniteMoE-SWA's shared expert sits beside the block (`layers.{i}.shared_mlp`):
    `layers_from_hf` reads it with the block, equal to the decoder layer's sum."""
    cfg = transformers.GraniteMoeSWAConfig(
        **_SMALL, intermediate_size=24, num_local_experts=8,
        shared_intermediate_size=20, num_hidden_layers=1, vocab_size=64,
    )  # fmt: skip
    model = _drawn(transformers.GraniteMoeSWAForCausalLM(cfg))
    model.save_pretrained(tmp_path)
    layer = me.layers_from_hf(tmp_path)[0]
    decoder = model.model.layers[0]
    xt = torch.tensor(np.asarray(x))[None]
    with torch.no_grad():
        y_hf = (decoder.block_sparse_moe(xt) + decoder.shared_mlp(xt))[0].numpy()
    y = np.asarray(layer(x)[0])
    np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
