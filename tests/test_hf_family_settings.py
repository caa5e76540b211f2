"""Hugging Face family settings beyond `test_hf_config`'s defaults, each against
`transformers`' own block: ERNIE-4.5's `moe_norm_min` floor, settings that used to be
refused, aliases of supported families and multimodal wrappers' text models."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh
from test_hf_config import H, _state_dict, _torch_value_and_grad

import moe_eqx as me

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _module(model_type):
    return __import__(
        f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["x"]
    )


def _drawn(block, seed=0):
    """`block` in eval mode with every floating parameter and buffer drawn at random
    (transformers leaves expert weights uninitialised and biases at zero)."""
    torch.manual_seed(seed)
    block = block.eval()
    with torch.no_grad():
        for tensor in list(block.parameters()) + list(block.buffers()):
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.3)
    return block


@eqx.filter_jit
def _value_and_grad(layer, x, num_shards):
    """The layer's output and the gradient of `sum(y**2)` in `x`: one program per
    layer config and `num_shards`, shared by the families whose configs are equal."""
    m = None if num_shards == 1 else mesh(num_shards)

    def loss(x):
        y, _ = layer(x, mesh=m)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    (_, y), g = jax.value_and_grad(loss, has_aux=True)(x)
    return y, g


def _assert_matches_block(block, hf_config, x, num_shards=1, **import_kw):
    """`config_from_hf` + the importer against `block`: output and input gradient,
    and the dense oracle `reference_moe` against the block's output."""
    config = me.config_from_hf(hf_config, buffer_factor=None)
    layer = me.layer_from_hf_state_dict(config, _state_dict(block), **import_kw)
    y_hf, g_hf = _torch_value_and_grad(block, x)
    y, g = _value_and_grad(layer, x, num_shards)
    scale, gscale = np.max(np.abs(y_hf)), np.max(np.abs(g_hf))
    np.testing.assert_allclose(np.asarray(y), y_hf, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(g), g_hf, rtol=1e-5, atol=1e-5 * gscale)
    y_ref = me.reference_moe(layer, x)
    np.testing.assert_allclose(np.asarray(y_ref), y_hf, rtol=1e-5, atol=1e-5 * scale)
    return layer


# ---------------------------------------------------------------------------------
# 1. ERNIE-4.5's `moe_norm_min`.


def _ernie(norm_min):
    cfg = transformers.Ernie4_5_MoeConfig(
        hidden_size=H, intermediate_size=24, num_experts_per_tok=2, moe_k=2,
        moe_num_experts=8, moe_intermediate_size=12, moe_num_shared_experts=1,
        moe_norm_min=norm_min,
    )  # fmt: skip
    return cfg, _drawn(_module("ernie4_5_moe").Ernie4_5_MoeSparseMoeBlock(cfg))


@pytest.mark.parametrize("num_shards", [1, 4])
def test_ernie_moe_norm_min_floors_the_divisor(getkey, num_shards):
    """With `moe_norm_min=0.9` most tokens' two chosen probabilities sum below the
    floor, so the block divides by 0.9, not by their sum: the layer, its gradient
    and the oracle follow it."""
    cfg, block = _ernie(0.9)
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    layer = _assert_matches_block(block, cfg.to_dict(), x, num_shards)
    assert layer.config.weighting == me.Weighting(floor=0.9)
    assert layer.router.weighting.floor == 0.9
    # The floor is active for some tokens (else this test could not tell).
    routing = layer.router(x)
    chosen = jax.nn.softmax(x @ layer.router.weight, axis=-1)
    sums = jnp.take_along_axis(chosen, routing.experts, axis=-1).sum(-1)
    assert int(jnp.sum(sums < 0.9)) > len(x) // 4


def test_weighting_floor_is_validated():
    base = dict(d_model=8, d_ff=8, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="`Weighting.floor`"):
        me.Weighting(floor=-1.0)
    with pytest.raises(ValueError, match=r"`Weighting\(floor=...\)`.*`norm_topk=True`"):
        me.MoEConfig(**base, weighting=me.Weighting(floor=0.5), norm_topk=False)


# ---------------------------------------------------------------------------------
# 2. Settings transformers' blocks compute and `config_from_hf` used to refuse.


def test_minimax_m2_adds_its_bias_whatever_use_routing_bias_says(getkey):
    cfg = transformers.MiniMaxM2Config(
        hidden_size=H, intermediate_size=24, num_experts_per_tok=2,
        num_local_experts=8, use_routing_bias=False,
    )  # fmt: skip
    block = _drawn(_module("minimax_m2").MiniMaxM2SparseMoeBlock(cfg))
    assert block.e_score_correction_bias.abs().sum() > 0  # drawn, so it matters
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    _assert_matches_block(block, cfg.to_dict(), x)


@pytest.mark.parametrize(
    ("model_type", "act"), [("qwen3_moe", "gelu"), ("qwen2_moe", "gelu_pytorch_tanh")]
)
def test_gelu_experts_map_to_geglu(getkey, model_type, act):
    """Qwen2/3-MoE's experts (and Qwen2-MoE's shared expert) apply `hidden_act` to
    the gate projection: GELU (exact or tanh) maps to `geglu` / `geglu_tanh`."""
    config_class = {"qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig"}
    block_class = {"qwen3_moe": "Qwen3MoeSparseMoeBlock"}
    cfg = getattr(transformers, config_class[model_type])(
        hidden_size=H, moe_intermediate_size=12, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, hidden_act=act, shared_expert_intermediate_size=20,
    )  # fmt: skip
    name = block_class.get(model_type, "Qwen2MoeSparseMoeBlock")
    block = _drawn(getattr(_module(model_type), name)(cfg))
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    layer = _assert_matches_block(block, cfg.to_dict(), x)
    assert layer.config.activation == {"gelu": "geglu"}.get(act, "geglu_tanh")


@pytest.mark.parametrize("config_class", ["DeepseekV2Config", "AriaTextConfig"])
def test_mlp_bias_is_refused_by_name(config_class):
    """Their blocks always build shared experts, with biases under `mlp_bias`, which
    the layer's shared expert does not have: `config_from_hf` names the key (the
    importer would only have seen unknown `...bias` keys)."""
    cfg = getattr(transformers, config_class)(mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias=True is not supported"):
        me.config_from_hf(cfg.to_dict())


def _saved(model, directory):
    """`model` with its parameters drawn, written by `save_pretrained`."""
    _drawn(model)
    model.save_pretrained(directory)
    return model


def test_hunyuan_per_layer_moe_topk(getkey, tmp_path):
    """HunYuan-V1-MoE's `moe_topk` as a per-layer list: `config_from_hf` refuses the
    model's config (no one top-k), `layers_from_hf` gives each layer its own, each
    equal to that layer's block."""
    cfg = transformers.HunYuanMoEV1Config(
        hidden_size=H, intermediate_size=24, num_experts=8, moe_topk=[1, 3],
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, vocab_size=32,
    )  # fmt: skip
    with pytest.raises(ValueError, match="moe_topk=\\[1, 3\\] differs between layers"):
        me.config_from_hf(cfg.to_dict())
    model = _saved(transformers.HunYuanMoEV1ForCausalLM(cfg), tmp_path)
    layers = me.layers_from_hf(tmp_path)
    assert [layers[i].config.top_k for i in (0, 1)] == [1, 3]
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    for i, layer in layers.items():
        y_hf, _ = _torch_value_and_grad(model.model.layers[i].mlp, x)
        y = np.asarray(layer(x)[0])
        np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


# ---------------------------------------------------------------------------------
# 3. Model types transformers runs with a supported family's block.

_V3_KEYS = dict(
    hidden_size=H, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5,
    norm_topk_prob=True, num_attention_heads=2, num_key_value_heads=2,
)  # fmt: skip


@pytest.mark.parametrize(
    ("config_class", "model_type", "block_class"),
    [
        ("SarvamMoEConfig", "glm4_moe", "Glm4MoeMoE"),
        ("SarvamMLAConfig", "deepseek_v3", "DeepseekV3MoE"),
        ("DeepseekV32Config", "deepseek_v32", "DeepseekV32MoE"),
    ],
)
def test_aliases_match_the_block_transformers_runs(
    getkey, config_class, model_type, block_class
):
    """`sarvam_moe` runs GLM-4-MoE's block, `sarvam_mla` DeepSeek-V3's (transformers'
    auto mappings), `deepseek_v32` its own copy of DeepSeek-V3's."""
    cfg = getattr(transformers, config_class)(**_V3_KEYS)
    block = _drawn(getattr(_module(model_type), block_class)(cfg))
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    _assert_matches_block(block, cfg.to_dict(), x)


@pytest.mark.parametrize("model_type", ["sarvam_moe", "sarvam_mla"])
def test_sarvam_original_key_names(model_type):
    """The original Sarvam checkpoints' `num_experts` / `num_shared_experts`, which
    transformers' `attribute_map` reads as DeepSeek-V3's names."""
    config_class = {"sarvam_moe": "SarvamMoEConfig", "sarvam_mla": "SarvamMLAConfig"}
    hf = getattr(transformers, config_class[model_type])(**_V3_KEYS).to_dict()
    original = dict(hf)
    original["num_experts"] = original.pop("n_routed_experts")
    original["num_shared_experts"] = original.pop("n_shared_experts")
    assert me.config_from_hf(original) == me.config_from_hf(hf)


# ---------------------------------------------------------------------------------
# 4. Multimodal wrappers: a text MoE under `text_config`, weights under
# `model.language_model.`.

_TEXT = dict(
    hidden_size=H, intermediate_size=24, moe_intermediate_size=12, num_experts=8,
    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, vocab_size=64,
)  # fmt: skip
_WRAPPERS = {
    "qwen3_vl_moe": {},
    "qwen3_5_moe": dict(shared_expert_intermediate_size=20),
    "glm4v_moe": dict(
        n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.5,
    ),
}  # fmt: skip


def _wrapper(model_type, directory):
    """A tiny `model_type` model (vision tower included), its parameters drawn, saved
    with `save_pretrained` to `directory`."""
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    vision = dict(depth=1, hidden_size=H, intermediate_size=24, num_heads=2)
    cfg = CONFIG_MAPPING[model_type](
        text_config=_TEXT | _WRAPPERS[model_type],
        vision_config=vision | dict(out_hidden_size=H),
    )
    return _saved(AutoModelForImageTextToText.from_config(cfg), directory)


@pytest.mark.parametrize("model_type", sorted(_WRAPPERS))
def test_wrapper_layers_match_the_text_models_block(getkey, tmp_path, model_type):
    """`layers_from_hf` on the wrapper's directory finds the text model's MoE layer
    (layer 1; GLM-4.5V's layer 0 is dense), equal to that layer's block."""
    model = _wrapper(model_type, tmp_path)
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == ([1] if model_type == "glm4v_moe" else [0, 1])
    block = model.model.language_model.layers[1].mlp
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(block, x)
    y = np.asarray(layers[1](x)[0])
    np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


def test_qwen3_vl_moe_published_layout(getkey, tmp_path):
    """Qwen3-VL-MoE's published checkpoints store the fused experts `[E, H, 2F]` and
    `[E, F, H]` (transformers transposes them on load): read as such, on one device
    and with a mesh (each process reading its rows)."""
    from safetensors.numpy import load_file, save_file

    model = _wrapper("qwen3_vl_moe", tmp_path / "saved")
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = np.ascontiguousarray(np.swapaxes(tensors[name], 1, 2))
    (tmp_path / "hub").mkdir()
    save_file(tensors, tmp_path / "hub" / "model.safetensors")
    config = (tmp_path / "saved" / "config.json").read_text()
    (tmp_path / "hub" / "config.json").write_text(config)
    block = model.model.language_model.layers[0].mlp
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(block, x)
    for m in (None, mesh(4)):
        layer = me.layers_from_hf(tmp_path / "hub", 0, mesh=m)[0]
        y = np.asarray(layer(x, mesh=m)[0])
        np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


def test_ernie_vl_moe_is_refused_with_its_reason():
    cfg = transformers.CONFIG_MAPPING["ernie4_5_vl_moe"]()
    with pytest.raises(ValueError, match="ernie4_5_vl_moe_text.*split by modality"):
        me.config_from_hf(cfg.to_dict())


def test_qwen3_omni_moe_reads_the_thinkers_layers(getkey, tmp_path):
    """Qwen3-Omni-MoE holds two MoE models (thinker and talker, both with layers 0
    and 1): `layers_from_hf` reads the thinker's text model (`thinker_config`'s
    `text_config`, weights under `thinker.`), equal to its block."""
    from transformers import CONFIG_MAPPING, Qwen3OmniMoeForConditionalGeneration

    text = _TEXT | dict(norm_topk_prob=False)
    small = dict(
        hidden_size=H, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    thinker = dict(
        text_config=text,
        vision_config=dict(
            depth=1, hidden_size=H, intermediate_size=24, num_heads=2,
            out_hidden_size=H,
        ),
        audio_config=dict(
            encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=H,
            d_model=H, output_dim=H, num_mel_bins=8, n_window=4,
            downsample_hidden_size=8,
        ),
    )  # fmt: skip
    talker = dict(
        text_config=text | dict(shared_expert_intermediate_size=20),
        code_predictor_config=small | dict(vocab_size=64),
        thinker_hidden_size=H,
        spatial_merge_size=2,
    )
    code2wav = small | dict(
        codebook_size=16, decoder_dim=H, upsample_rates=[2], upsampling_ratios=[2],
        num_quantizers=2, codebook_dim=8, latent_dim=H,
    )  # fmt: skip
    cfg = CONFIG_MAPPING["qwen3_omni_moe"](
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav
    )
    model = _saved(Qwen3OmniMoeForConditionalGeneration(cfg), tmp_path)
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == [0, 1] and not layers[1].config.norm_topk
    block = model.thinker.model.language_model.layers[1].mlp
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(block, x)
    y = np.asarray(layers[1](x)[0])
    np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
