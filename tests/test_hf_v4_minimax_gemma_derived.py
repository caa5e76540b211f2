"""Hugging Face families of batch 3 (DeepSeek-V3/V4, MiniMax-M2 and Gemma derived
blocks, and the multimodal wrappers of their text models), each against
`transformers`' own block through `config_from_hf(config.to_dict())` and the importer
alone: outputs and input gradients on one device and EP4; a setting that changes the
block's computation honoured or refused by name; refused families say why."""

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

# DeepSeek-V3-style routing keys: two groups of four, one chosen, so that the group
# limit changes the choice.
_V3 = dict(
    hidden_size=H, moe_intermediate_size=12, num_experts_per_tok=2, n_group=2,
    topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
    num_attention_heads=2, num_key_value_heads=2,
)  # fmt: skip


def _beam(**kw):
    cfg = CONFIG["beam"](**(_V3 | dict(num_experts=8) | kw))
    return cfg, _module("beam").BeamMoE(cfg)


def _glm5_next(**kw):
    # A clamp that bites: pre-activations are about N(0, 1.2^2) here.
    cfg = CONFIG["glm5_next_text"](
        **(_V3 | dict(n_routed_experts=8, n_shared_experts=1, swiglu_limit=0.8) | kw)
    )
    return cfg, _module("glm5_next").Glm5NextTextMoE(cfg)


def _hy_v4_vl(**kw):
    cfg = CONFIG["hy_v4_vl_text"](
        **(_V3 | dict(n_routed_experts=8, n_shared_experts=1, swiglu_limit=0.8) | kw)
    )
    return cfg, _module("hy_v4_vl").HYV4VLMoE(cfg)


def _unlimited_ocr(**kw):
    cfg = CONFIG["unlimited_ocr_text"](
        **(
            _V3
            | dict(
                n_routed_experts=8, n_shared_experts=2, norm_topk_prob=None,
                topk_method="group_limited_greedy",
            )
            | kw
        )
    )  # fmt: skip
    return cfg, _module("unlimited_ocr").UnlimitedOcrTextMoe(cfg)


def _minimax_m3_vl(**kw):
    # A clamp that bites (see `_glm5_next`).
    cfg = CONFIG["minimax_m3_vl_text"](
        **(
            {k: v for k, v in _V3.items() if k not in _NO_GROUPS}
            | dict(
                num_local_experts=8, intermediate_size=12, shared_intermediate_size=20,
                swiglu_limit=0.8, swiglu_alpha=1.5, routed_scaling_factor=2.0,
            )
            | kw
        )
    )  # fmt: skip
    return cfg, _module("minimax_m3_vl").MiniMaxM3VLSparseMoeBlock(cfg)


# Keys of `_V3` that a block's config does not have (its router has no groups and
# always renormalises).
_NO_GROUPS = ("n_group", "topk_group", "norm_topk_prob")
_NOT_INKLING2 = (*_NO_GROUPS, "routed_scaling_factor")


def _inkling2(loop=False, **kw):
    # Softcaps that bite: pre-activations are about N(0, 1.2^2) here.
    name = "inkling2_loop" if loop else "inkling2"
    # Its config has no group or `norm_topk_prob` keys (its router has neither).
    v3 = {k: v for k, v in _V3.items() if k not in _NOT_INKLING2}
    cfg = CONFIG[f"{name}_text"](
        **(
            v3
            | dict(
                n_routed_experts=8, route_scale=1.7, mlp_gate_softcap=0.9,
                mlp_up_softcap=1.1,
            )
            | kw
        )
    )  # fmt: skip
    module = _module(name)
    block = "Inkling2LoopSparseMoeBlock" if loop else "Inkling2SparseMoeBlock"
    return cfg, getattr(module, block)(cfg)


def _step3p5(**kw):
    cfg = CONFIG["step3p5"](
        **(
            {k: v for k, v in _V3.items() if k not in _NOT_INKLING2}
            | dict(
                n_routed_experts=8, share_expert_dim=20, moe_router_scaling_factor=1.5,
                num_hidden_layers=1, mlp_layer_types=["sparse"],
                layer_types=["full_attention"], swiglu_limits=[0.5],
                swiglu_limits_shared=[0.7],
            )
            | kw
        )
    )  # fmt: skip
    return cfg, _module("step3p7").Step3p7SparseMoeBlock(cfg, 0)


# name -> tiny `(config, block)` builder.
FAMILIES = {
    "beam": _beam,
    "glm5_next_text": _glm5_next,
    "hy_v4_vl_text": _hy_v4_vl,
    "unlimited_ocr_text": _unlimited_ocr,
    "minimax_m3_vl_text": _minimax_m3_vl,
    "inkling2_text": _inkling2,
    "inkling2_loop_text": lambda **kw: _inkling2(loop=True, **kw),
    "step3p5": _step3p5,
}


def _block(name, **kw):
    cfg, block = FAMILIES[name](**kw)
    return cfg, _drawn(block)


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(3), (32, H), jnp.float32)


@pytest.mark.parametrize("num_shards", [1, 4])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_its_block(name, num_shards, x):
    cfg, block = _block(name)
    _assert_matches_block(block, cfg.to_dict(), x, num_shards)


# ---------------------------------------------------------------------------------
# Multimodal wrappers: the text model's config under `text_config`, its weights under
# `model.language_model.`.

_TEXT = dict(
    hidden_size=H, intermediate_size=24, moe_intermediate_size=12,
    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, vocab_size=64, pad_token_id=0, bos_token_id=0,
    eos_token_id=0,
)  # fmt: skip
_VISION = dict(
    depth=1, hidden_size=H, intermediate_size=24, num_heads=2, out_hidden_size=H,
    num_hidden_layers=1, num_attention_heads=2, projection_intermediate_size=24,
)  # fmt: skip
_STEP3P7_VISION = dict(
    hidden_size=H, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
    image_size=28, patch_size=14,
)  # fmt: skip
_DENSE_FIRST = dict(mlp_layer_types=["dense", "sparse"])
_INKLING2 = dict(
    n_routed_experts=8, unpadded_vocab_size=64, mlp_gate_softcap=0.9,
    mlp_up_softcap=1.1, n_layers_per_attn_res_block=1, d_rel=4, swa_head_dim=8,
    swa_num_attention_heads=2, swa_num_key_value_heads=2,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], num_hidden_layers=3,
)  # fmt: skip
_INKLING2_VISION = dict(
    hidden_size=H, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
    projection_hidden_dim=24, text_hidden_size=H, posemb_grid_size=4,
)  # fmt: skip
# model type -> (text config keys, vision config keys, its MoE layers).
_WRAPPERS = {
    "glm5_next": (
        _DENSE_FIRST | dict(n_routed_experts=8, n_shared_experts=1, swiglu_limit=0.8),
        _VISION,
        [1],
    ),
    "hy_v4_vl": (
        _DENSE_FIRST
        | dict(
            n_routed_experts=8, n_shared_experts=1, swiglu_limit=0.8, q_lora_rank=8,
            kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]
            ),
        ),
        _VISION,
        [1],
    ),
    "minimax_m3_vl": (
        _DENSE_FIRST
        | dict(
            num_local_experts=8, shared_intermediate_size=20,
            dense_intermediate_size=24, rotary_dim=4,
        ),
        _VISION,
        [1],
    ),
    "unlimited_ocr": (
        _DENSE_FIRST | dict(n_routed_experts=8, n_shared_experts=1),
        dict(
            sam_config=dict(
                hidden_size=H, output_channels=H, num_hidden_layers=1,
                num_attention_heads=2, image_size=64, patch_size=16, window_size=2,
                global_attn_indexes=[0], mlp_dim=24, downsample_channels=[H, H],
            ),
            encoder_config=dict(
                hidden_size=H, intermediate_size=24, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14,
            ),
        ),
        [1],
    ),
    # Its checkpoints' experts: `experts.w13_weight` (gate and up rows alternating)
    # and `w2_weight`, the selection bias at `gate.bias`, under `model.llm.`.
    "inkling2": (_INKLING2, _INKLING2_VISION, [0, 1, 2]),
    "inkling2_loop": (
        _INKLING2
        | dict(loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2),
        _INKLING2_VISION,
        [0, 1, 2],
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(_WRAPPERS))
def test_wrapper_reads_its_text_models_moe_layers(tmp_path, model_type, x):
    """`config_from_hf` of the wrapper's config is its text model's; `layers_from_hf`
    on a `save_pretrained` directory (the checkpoints' own layout) finds the MoE
    layers (dense ones skipped), equal to their blocks."""
    text, vision, moe_layers = _WRAPPERS[model_type]
    cfg = CONFIG[model_type](text_config=_TEXT | text, vision_config=vision)
    config = me.config_from_hf(cfg.to_dict())
    assert config == me.config_from_hf(cfg.text_config.to_dict())
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    _saved(model, tmp_path)
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == moe_layers and layers[1].config == config
    y_hf, _ = _torch_value_and_grad(model.model.language_model.layers[1].mlp, x)
    y = np.asarray(layers[1](x)[0])
    np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
    if model_type == "inkling2":  # its fused tensors read by rows, for EP4's experts
        m = mesh(4)
        y = np.asarray(me.layers_from_hf(tmp_path, 1, mesh=m)[1](x, mesh=m)[0])
        np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


# ---------------------------------------------------------------------------------
# Keys that change the block's computation: refused by name where the layer does not
# compute them (the values above are honoured: each test of a family uses its
# scaling factor, group limit and clamp with values that change the output).


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("beam", dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
        ("glm5_next_text", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("glm5_next_text", dict(swiglu_limit=None), "missing key 'swiglu_limit'"),
        ("hy_v4_vl_text", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("unlimited_ocr_text", dict(mlp_bias=True), "mlp_bias=True"),
        ("unlimited_ocr_text", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
        ("minimax_m3_vl_text", dict(swiglu_limit=None), "missing key 'swiglu_limit'"),
        ("inkling2_text", dict(scoring_func="relu"), "scoring_func='relu'"),
        ("step3p5", dict(mlp_bias=True), "mlp_bias=True"),
        ("step3p5", dict(swiglu_limits=[0.5, 7.0]), "differs between layers"),
        ("step3p5", dict(hidden_act="gelu"), "hidden_act='gelu' with swiglu_limits"),
        ("inkling2_loop_text", dict(mlp_up_softcap=None), "'mlp_up_softcap'"),
    ],
)
def test_settings_it_does_not_compute_are_refused_by_name(name, change, message):
    hf = FAMILIES[name]()[0].to_dict() | change
    with pytest.raises(ValueError, match=message):
        me.config_from_hf(hf)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: me.SoftcapSwiGLU(gate_cap=1.0, up_cap=-2.0), "`SoftcapSwiGLU.up_cap`"),
        (lambda: me.SoftcapSwiGLU(1.0, float("inf")), "`SoftcapSwiGLU.up_cap`"),
        (lambda: me.SwiGLU(limit_after=True), "`SwiGLU.limit_after` needs a `limit`"),
        (
            lambda: me.SharedCombination(activation="swiglu_softcap"),
            r"`SharedCombination.activation='swiglu_softcap'` needs its settings",
        ),
    ],
)
def test_new_activation_settings_are_validated(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_step3p7_per_layer_clamps(tmp_path, x):
    """Step-3.7 clamps some layers after the activation (`swiglu_limits` and its
    shared expert's `swiglu_limits_shared`, per layer): `config_from_hf` of the
    model refuses (no one value), `layers_from_hf` gives each layer its own, each
    equal to its block."""
    text = _TEXT | dict(
        n_routed_experts=8, share_expert_dim=20, moe_router_scaling_factor=1.5,
        mlp_layer_types=["sparse", "sparse"], swiglu_limits=[0.0, 0.5],
        swiglu_limits_shared=[0.6, None], layer_types=["full_attention"] * 2,
    )  # fmt: skip
    cfg = CONFIG["step3p7"](text_config=text, vision_config=_STEP3P7_VISION)
    with pytest.raises(ValueError, match="swiglu_limits=\\[0.0, 0.5\\] differs"):
        me.config_from_hf(cfg.to_dict())
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    _saved(model, tmp_path)
    layers = me.layers_from_hf(tmp_path)
    limits = [
        (getattr(l.experts.activation, "limit", None),
         getattr(l.shared_experts.activation, "limit", None))
        for l in (layers[i] for i in (0, 1))
    ]  # fmt: skip
    assert limits == [(None, 0.6), (0.5, None)]
    # Its checkpoints' layout: `layers.{i}.moe.{gate,up,down}_proj.weight` stacked,
    # `moe.gate.weight`, `moe.router_bias`, the shared expert beside the block at
    # `layers.{i}.share_expert.*`; read on one device and with EP4's rows.
    for i in (0, 1):
        y_hf, _ = _torch_value_and_grad(model.model.language_model.layers[i].mlp, x)
        tolerance = dict(rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
        np.testing.assert_allclose(np.asarray(layers[i](x)[0]), y_hf, **tolerance)
    m = mesh(4)
    y = np.asarray(me.layers_from_hf(tmp_path, 1, mesh=m)[1](x, mesh=m)[0])
    np.testing.assert_allclose(y, y_hf, **tolerance)


def test_muse_spark_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="muse_spark_text.*post_expert_norm"):
        me.config_from_hf(CONFIG["muse_spark"]().to_dict())


# ---------------------------------------------------------------------------------
# Gemma-4 (and DiffusionGemma): the MoE block is part of the decoder layer, whose
# router reads the residual `x` through an RMS norm times its `scale / sqrt(H)` and
# whose experts read another RMS norm of `x` times that norm's weight. The layer
# takes `rms(x)` (no weight) and carries the scales in its weights.

_GEMMA = dict(
    hidden_size=H, moe_intermediate_size=12, num_experts=8, top_k_experts=2,
    intermediate_size=24, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    num_hidden_layers=1, vocab_size=64, rms_norm_eps=1e-6,
)  # fmt: skip


def _gemma_block(model_type):
    """The decoder layer's MoE half (`router`, `experts`,
    `pre_feedforward_layernorm_2`), run as its `forward` runs them."""
    if model_type == "gemma4_text":
        cfg = CONFIG["gemma4_text"](**_GEMMA, enable_moe_block=True)
        module, name = _module("gemma4"), "Gemma4"
    else:
        cfg = CONFIG["diffusion_gemma_text"](**_GEMMA)
        module, name = _module("diffusion_gemma"), "DiffusionGemma"

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = getattr(module, f"{name}TextRouter")(cfg)
            self.experts = getattr(module, f"{name}TextExperts")(cfg)
            norm = getattr(module, f"{name}RMSNorm")
            self.pre_feedforward_layernorm_2 = norm(H, eps=cfg.rms_norm_eps)

        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            _, weights, index = self.router(flat)
            return self.experts(self.pre_feedforward_layernorm_2(flat), index, weights)

    return cfg, _drawn(Block())


def _rms(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("num_shards", [1, 4])
@pytest.mark.parametrize("model_type", ["gemma4_text", "diffusion_gemma_text"])
def test_gemma_moe_matches_its_decoder_layers_block(model_type, num_shards, x):
    """The layer on `rms(x)` against the block on `x`: outputs and the gradient in
    `x`, and the oracle."""
    cfg, block = _gemma_block(model_type)
    config = me.config_from_hf(cfg.to_dict(), buffer_factor=None)
    state = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    layer = me.layer_from_hf_state_dict(config, state)
    y_hf, g_hf = _torch_value_and_grad(block, x)
    m = None if num_shards == 1 else mesh(num_shards)

    def loss(x):
        y, _ = layer(_rms(x), mesh=m)
        return jnp.sum(y**2), y

    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    scale, gscale = np.abs(y_hf).max(), np.abs(g_hf).max()
    np.testing.assert_allclose(np.asarray(y), y_hf, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(g), g_hf, rtol=1e-5, atol=1e-5 * gscale)
    y_ref = me.reference_moe(layer, _rms(x))
    np.testing.assert_allclose(np.asarray(y_ref), y_hf, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("model_type", ["gemma4", "diffusion_gemma"])
def test_gemma_wrappers_read_their_decoder_layers_blocks(tmp_path, model_type, x):
    """`config_from_hf` of the wrapper's config is its text model's; `layers_from_hf`
    on a `save_pretrained` directory reads each decoder layer's MoE tensors only (its
    attention, dense MLP and norms stay unread), equal to that layer's block."""
    text = _GEMMA | dict(num_hidden_layers=2)
    if model_type == "gemma4":
        text |= dict(enable_moe_block=True, hidden_size_per_layer_input=0)
        cfg = CONFIG["gemma4"](text_config=text, vision_config=None, audio_config=None)
    else:  # its checkpoint holds the decoder's layers (the encoder's are tied)
        vision = dict(
            hidden_size=H, intermediate_size=24, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8,
        )  # fmt: skip
        cfg = CONFIG["diffusion_gemma"](text_config=text, vision_config=vision)
    config = me.config_from_hf(cfg.to_dict())
    assert config == me.config_from_hf(cfg.text_config.to_dict())
    model = transformers.AutoModelForImageTextToText.from_config(cfg)
    _saved(model, tmp_path)
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == [0, 1]
    stack = (
        model.model.language_model if model_type == "gemma4" else model.model.decoder
    )
    decoder_layer = stack.layers[1]
    with torch.no_grad():
        xt = torch.tensor(np.asarray(x))
        _, weights, index = decoder_layer.router(xt)
        inputs = decoder_layer.pre_feedforward_layernorm_2(xt)
        y_hf = decoder_layer.experts(inputs, index, weights).numpy()
    y = np.asarray(layers[1](_rms(x))[0])
    np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())
    if model_type == "gemma4":  # each expert block folded with its own scales
        m = mesh(4)
        y = np.asarray(me.layers_from_hf(tmp_path, 1, mesh=m)[1](_rms(x), mesh=m)[0])
        np.testing.assert_allclose(y, y_hf, rtol=1e-5, atol=1e-5 * np.abs(y_hf).max())


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("gemma4_text", dict(), "enable_moe_block=False is not supported"),
        (
            "diffusion_gemma_text",
            dict(hidden_activation="relu"),
            "hidden_activation='relu' is not supported",
        ),
    ],
)
def test_gemma_settings_it_does_not_compute_are_refused(model_type, change, message):
    hf = CONFIG[model_type](**_GEMMA).to_dict() | change
    with pytest.raises(ValueError, match=message):
        me.config_from_hf(hf)
