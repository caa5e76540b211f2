"""Hugging Face families transformers builds from DeepSeek-V3's block (`glm4_moe_lite`,
`glm_moe_dsa`, `solar_open`, `exaone_moe`, `mimo_v2_flash`, `kimi_linear`,
`bailing_hybrid`, `dots3_note`, `deepseek_ocr2`, `mistral4`, `mistral_large4`, `axk1`,
`axk2`), each against its own block through `config_from_hf(config.to_dict())` and the
importer, on one device and under EP4; the keys each family's block reads, honoured or
refused by name; multimodal wrappers and saved models through `layers_from_hf`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh
from test_hf_config import H, _state_dict, _torch_value_and_grad
from test_hf_family_settings import _assert_matches_block, _drawn, _module, _saved

import moe_eqx as me

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# DeepSeek-V3's keys at settings that each change the result: two groups of which one
# is kept, a scaling factor, one shared expert.
_V3 = dict(
    hidden_size=H, moe_intermediate_size=12, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=1.5, norm_topk_prob=True,
)  # fmt: skip
# The same settings under the names of Kimi-Linear's and Bailing-Hybrid's configs
# and of EXAONE-MoE's (the same layer config: one compiled program for all).
_KIMI = dict(
    hidden_size=H, moe_intermediate_size=12, num_experts=8, num_experts_per_token=2,
    num_expert_group=2, topk_group=1, num_shared_experts=1,
    routed_scaling_factor=1.5, moe_renormalize=True,
)  # fmt: skip
_EXAONE = dict(
    hidden_size=H, moe_intermediate_size=12, num_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, num_shared_experts=1, routed_scaling_factor=1.5,
    norm_topk_prob=True,
)  # fmt: skip

# name -> (module, config class, block class, config kwargs)
_FAMILIES = {
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteMoE", _V3),
    "solar_open": ("solar_open", "SolarOpenConfig", "SolarOpenMoE", _V3),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaMoE", _V3),
    "mimo_v2_flash": (
        "mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashMoE",
        _V3,
    ),
    "exaone_moe": ("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeSparseMoEBlock", _EXAONE),
    "kimi_linear": ("kimi_linear", "KimiLinearConfig", "KimiLinearMoE", _KIMI),
    "bailing_hybrid": (
        "bailing_hybrid", "BailingHybridConfig", "BailingHybridMoE", _KIMI
    ),
    "dots3_note_text": (
        "dots3_note", "Dots3NoteTextConfig", "Dots3NoteTextMoE",
        # Two shared experts of 6: the shared width of the others' (one of 12).
        _V3 | dict(n_shared_experts=2, shared_experts_intermediate_size=6),
    ),
    "deepseek_ocr2_text": (
        "deepseek_ocr2", "DeepseekOcr2TextConfig", "DeepseekOcr2TextMoe",
        _V3 | dict(
            topk_method="group_limited_greedy", num_attention_heads=2,
            num_key_value_heads=2,
        ),
    ),
    "mistral4": (
        "mistral4", "Mistral4Config", "Mistral4MoE",
        _V3 | dict(num_attention_heads=2, num_key_value_heads=2),
    ),
    "mistral_large4_text": (
        "mistral_large4", "MistralLarge4TextConfig", "MistralLarge4TextMoE",
        _V3 | dict(num_attention_heads=2, num_key_value_heads=2),
    ),
    # Its block's output through an RMSNorm (`post_mlp_layernorm`).
    "axk1": (
        "axk1", "AXK1Config", "AXK1MoE",
        _V3 | dict(rms_norm_eps=1e-3, num_attention_heads=2),
    ),
    # Three of a kept group's four experts: one of them often scores below 0.
    "axk2": (
        "axk2", "AXK2Config", "AXK2MoE",
        _V3 | dict(num_experts_per_tok=3, num_attention_heads=2),
    ),
    # Its light checkpoints: no group step.
    "axk2:light": (
        "axk2", "AXK2Config", "AXK2MoE",
        _V3 | dict(n_group=None, topk_group=None, num_attention_heads=2),
    ),
}  # fmt: skip


def _axk2_zero_fill_matters(block):
    """A.X-K2's router fills the other group's experts with 0: with group 0's biases
    `[-0.9, -0.9, 0.3, 0.3]`, a kept group 0 often has one expert of its best three
    below 0, and an expert of group 1 (0) is chosen instead. Group 1's four experts
    are made equal (router row, bias, weights), so which of the tied ones is chosen
    (torch breaks ties its own way) does not change the output."""
    with torch.no_grad():
        block.gate.weight[4:] = block.gate.weight[4]
        bias = torch.tensor([-0.9, -0.9, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0])
        block.gate.e_score_correction_bias.copy_(bias)
        block.experts.gate_up_proj[4:] = block.experts.gate_up_proj[4]
        block.experts.down_proj[4:] = block.experts.down_proj[4]
    return block


def _family(name):
    """`(config, block)`: a tiny config of family `name` and its block, drawn."""
    module, config_class, block_class, kwargs = _FAMILIES[name]
    cfg = getattr(transformers, config_class)(**kwargs)
    block = _drawn(getattr(_module(module), block_class)(cfg))
    if name == "axk2":
        block = _axk2_zero_fill_matters(block)
    return cfg, block


@pytest.mark.parametrize("num_shards", [1, 4])
@pytest.mark.parametrize("name", sorted(_FAMILIES))
def test_family_matches_its_block(getkey, name, num_shards):
    """Output and input gradient within 1e-5 relative of the block's, and the dense
    oracle's output too."""
    cfg, block = _family(name)
    assert cfg.to_dict()["model_type"] == name.partition(":")[0]
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    _assert_matches_block(block, cfg.to_dict(), x, num_shards)


# (family, key, value, the config's field, its value): each key the family's block
# reads, at a value other than the tiny config's, lands in the field it sets.
_HONOURED = [
    ("glm4_moe_lite", "n_group", 4, "num_groups", 4),
    ("glm4_moe_lite", "routed_scaling_factor", 1.8, "routed_scaling_factor", 1.8),
    ("solar_open", "norm_topk_prob", False, "norm_topk", False),
    ("exaone_moe", "norm_topk_prob", False, "norm_topk", False),
    ("glm_moe_dsa", "n_shared_experts", 2, "shared_d_ff", 24),
    ("exaone_moe", "num_shared_experts", 2, "shared_d_ff", 24),
    ("exaone_moe", "num_experts", 16, "num_experts", 16),
    ("kimi_linear", "moe_renormalize", False, "norm_topk", False),
    ("kimi_linear", "num_expert_group", 4, "num_groups", 4),
    ("kimi_linear", "num_experts_per_token", 3, "top_k", 3),
    ("bailing_hybrid", "num_shared_experts", 0, "shared_d_ff", 0),
    ("dots3_note_text", "shared_experts_intermediate_size", 8, "shared_d_ff", 16),
    ("deepseek_ocr2_text", "topk_method", "greedy", "num_groups", 1),
    ("mistral4", "norm_topk_prob", False, "norm_topk", False),
    ("mistral4", "topk_group", 2, "top_groups", 2),
    ("mistral_large4_text", "n_shared_experts", 0, "shared_d_ff", 0),
    ("axk2", "n_group", None, "selection", me.Selection()),
    ("axk1", "rms_norm_eps", 0.5, "output", me.OutputTransform(norm_eps=0.5)),
]


@pytest.mark.parametrize(("name", "key", "value", "field", "expected"), _HONOURED)
def test_keys_are_honoured(name, key, value, field, expected):
    cfg, _ = _family(name)
    assert getattr(me.config_from_hf(cfg.to_dict()), field) != expected
    assert getattr(me.config_from_hf(cfg.to_dict() | {key: value}), field) == expected


def test_axk2_zero_fill_is_computed(getkey):
    """The layer with the other group's experts at -inf (the default) differs from
    A.X-K2's block on these tokens: the 0 fill is what the layer matches."""
    cfg, block = _family("axk2")
    config = me.config_from_hf(cfg.to_dict())
    assert config.selection.group_fill == 0.0
    wrong = dataclasses.replace(config, selection=me.Selection())
    layer = me.layer_from_hf_state_dict(wrong, _state_dict(block))
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(block, x)
    assert np.max(np.abs(np.asarray(layer(x)[0]) - y_hf)) > 1e-2 * np.max(np.abs(y_hf))


def test_group_fill_is_validated():
    for bad in (float("nan"), float("inf"), True, "0"):
        with pytest.raises(ValueError, match="`Selection.group_fill`"):
            me.Selection(group_fill=bad)


def test_mistral_large4_always_renormalises():
    """Mistral-Large-4's router renormalises whatever `norm_topk_prob` says."""
    cfg, _ = _family("mistral_large4_text")
    assert me.config_from_hf(cfg.to_dict() | {"norm_topk_prob": False}).norm_topk


def test_mimo_v2_flash_builds_no_shared_experts():
    """MiMo-V2-Flash's block has no shared experts whatever `n_shared_experts` says,
    and nor does its layer."""
    cfg, _ = _family("mimo_v2_flash")
    cfg.n_shared_experts = 2
    block = _module("mimo_v2_flash").MiMoV2FlashMoE(cfg)
    assert not hasattr(block, "shared_experts")
    assert me.config_from_hf(cfg.to_dict()).shared_d_ff == 0


_REFUSED_KEYS = [
    (name, "hidden_act", "relu", "hidden_act='relu' is not supported")
    for name in sorted(_FAMILIES)
] + [
    ("deepseek_ocr2_text", "mlp_bias", True, "mlp_bias=True is not supported"),
    ("deepseek_ocr2_text", "topk_method", "noaux_tc", "topk_method='noaux_tc'"),
]


@pytest.mark.parametrize(("name", "key", "value", "message"), _REFUSED_KEYS)
def test_keys_it_cannot_map_are_refused(name, key, value, message):
    """A value the layer does not compute is refused, naming the key: ReLU experts
    (the blocks apply `hidden_act` to the gate projection), DeepSeek-OCR-2's biased
    shared expert and a `topk_method` its router does not have."""
    cfg, _ = _family(name)
    with pytest.raises(ValueError, match=message):
        me.config_from_hf(cfg.to_dict() | {key: value})


# ---------------------------------------------------------------------------------
# Multimodal wrappers (and A.X-K1's saved model): the text model's MoE layers from the
# `config.json` and checkpoint that `save_pretrained` writes.

_TEXT = dict(
    hidden_size=H, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, vocab_size=64, mlp_layer_types=["dense", "sparse"],
)  # fmt: skip


def _wrapper(model_type, directory):
    """A tiny `model_type` model (towers included; layer 0 dense, layer 1 MoE), its
    parameters drawn, saved with `save_pretrained` to `directory`."""
    from transformers import CONFIG_MAPPING

    if model_type == "dots3_note":
        text = _FAMILIES["dots3_note_text"][3] | _TEXT | dict(
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
            layer_types=["sliding_attention"] * 2, kv_lora_rank=8, q_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=8,
        )  # fmt: skip
        # Its vision tower has an MoE layer too (block 1), not a text layer.
        vision = dict(
            hidden_size=H, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, moe_intermediate_size=12, num_local_experts=8,
            num_experts_per_tok=2, mlp_layer_types=["dense", "sparse"],
            adapter_in_dim=H, adapter_out_dim=H,
        )  # fmt: skip
        audio = dict(
            hidden_size=H, intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8,
            adapter_input_size=H, adapter_out_dim=H, downsample_hidden_size=8,
            conv_output_size=16,
        )  # fmt: skip
        cfg = CONFIG_MAPPING[model_type](
            text_config=text, vision_config=vision, audio_config=audio
        )
        model = transformers.Dots3NoteForConditionalGeneration(cfg)
    elif model_type == "axk1":
        # Saved as its checkpoints are: the block's norm beside it in the decoder
        # layer (`model.layers.1.post_mlp_layernorm.weight`).
        text = _FAMILIES["axk1"][3] | _TEXT | dict(
            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8, head_dim=4,
        )  # fmt: skip
        cfg = transformers.AXK1Config(**text)
        model = transformers.AXK1ForCausalLM(cfg)
        return cfg, _saved(model, directory)
    elif model_type == "mistral_large4":
        # Saved as Mistral's checkpoints are: the block's tensors under the decoder
        # layer's prefix, beside its attention and norms (`layers.1.gate.weight`).
        text = _FAMILIES["mistral_large4_text"][3] | _TEXT | dict(
            first_k_dense_replace=1, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, head_dim=4, index_head_dim=8,
            index_n_heads=2, index_topk=4, layer_types=["indexed_attention"] * 2,
            indexer_types=["full"] * 2,
        )  # fmt: skip
        vision = dict(
            hidden_size=H, intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=2, head_dim=8, image_size=32, patch_size=16,
        )  # fmt: skip
        cfg = CONFIG_MAPPING[model_type](text_config=text, vision_config=vision)
        model = transformers.MistralLarge4ForConditionalGeneration(cfg)
    else:
        text = _FAMILIES["deepseek_ocr2_text"][3] | _TEXT
        sam = dict(
            hidden_size=8, output_channels=8, num_hidden_layers=1,
            num_attention_heads=2, image_size=32, patch_size=16,
            global_attn_indexes=[0], window_size=2, downsample_channels=[8, H],
        )  # fmt: skip
        encoder = dict(
            hidden_size=H, intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
        )  # fmt: skip
        cfg = CONFIG_MAPPING[model_type](
            text_config=text, vision_config=dict(sam_config=sam, encoder_config=encoder)
        )
        model = transformers.DeepseekOcr2ForConditionalGeneration(cfg)
    return cfg, _saved(model, directory)


@pytest.mark.parametrize(
    "model_type", ["dots3_note", "deepseek_ocr2", "mistral_large4", "axk1"]
)
def test_wrapper_layers_match_the_text_models_block(getkey, tmp_path, model_type):
    """`config_from_hf` on the wrapper's config reads its `text_config`;
    `layers_from_hf` on its directory (a wrapper's, or A.X-K1's saved model with its
    norm beside the block) finds the text model's one MoE layer (not dots.3-note's
    vision MoE), equal to that layer's block."""
    cfg, model = _wrapper(model_type, tmp_path)
    text = getattr(cfg, "text_config", cfg).to_dict()
    assert me.config_from_hf(cfg.to_dict()) == me.config_from_hf(text)
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == [1]
    assert layers[1].config == me.config_from_hf(text)
    decoder = getattr(model.model, "language_model", model.model)
    block = decoder.layers[1].mlp
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(block, x)
    y = np.asarray(layers[1](x)[0])
    np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


def test_axk1_output_norm_in_the_callers_shard_map(getkey):
    """A.X-K1's output norm also on the path a caller's own `shard_map` runs
    (`expert_parallel_shard`, the experts placed by `shard_model`): equal to the
    block; without the norm it is not."""
    import functools as ft

    from jax.sharding import NamedSharding, PartitionSpec as P

    cfg, block = _family("axk1")
    layer = me.layer_from_hf_state_dict(
        me.config_from_hf(cfg.to_dict(), buffer_factor=None), _state_dict(block)
    )
    m = mesh(4)

    @ft.partial(
        jax.shard_map, mesh=m, in_specs=(me.shard_specs(layer), P("expert")),
        out_specs=P("expert"), check_vma=False,
    )  # fmt: skip
    def run(layer, x):
        return me.expert_parallel_shard(layer, x)[0]

    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(block, x)
    y = jax.jit(run)(
        me.shard_model(layer, m), jax.device_put(x, NamedSharding(m, P("expert")))
    )
    scale = np.max(np.abs(y_hf))
    np.testing.assert_allclose(np.asarray(y), y_hf, rtol=1e-5, atol=1e-5 * scale)
    plain = layer.with_config(output=me.OutputTransform())  # drops `output_norm`
    assert plain.output_norm is None
    plain = me.reference_moe(plain, x)
    assert np.max(np.abs(np.asarray(plain) - y_hf)) > 1e-2 * scale
