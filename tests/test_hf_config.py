"""`config_from_hf` + `layer_from_hf_state_dict` against `transformers`' own MoE blocks
(built from tiny configs, every parameter and buffer drawn at random): outputs and
input gradients on one device and under EP4; refused configs; dtypes kept."""

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, recording_read

import moe_eqx as me
from moe_eqx._hf.safetensors_file import TensorFile

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

H = 16


def _family(name):
    """`(config, block class)` of a tiny model of family `name`."""
    t = transformers
    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = t.MixtralConfig(
            hidden_size=H,
            intermediate_size=24,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
        return cfg, MixtralSparseMoeBlock
    if name == "olmoe":
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

        cfg = t.OlmoeConfig(
            hidden_size=H, intermediate_size=24, num_experts=8, num_experts_per_tok=3,
            norm_topk_prob=False,
        )  # fmt: skip
        return cfg, OlmoeSparseMoeBlock
    if name == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock,
        )

        cfg = t.Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=12, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True,
        )  # fmt: skip
        return cfg, Qwen3MoeSparseMoeBlock
    if name == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeSparseMoeBlock,
        )

        cfg = t.Qwen2MoeConfig(
            hidden_size=H, moe_intermediate_size=12, num_experts=8,
            num_experts_per_tok=2, shared_expert_intermediate_size=20,
            norm_topk_prob=False,
        )  # fmt: skip
        return cfg, Qwen2MoeSparseMoeBlock
    if name == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        cfg = t.DeepseekV3Config(
            hidden_size=H, moe_intermediate_size=12, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=2,
            routed_scaling_factor=2.5, norm_topk_prob=True,
        )  # fmt: skip
        return cfg, DeepseekV3MoE
    if name in ("glm4_moe", "dots1"):
        module = __import__(
            f"transformers.models.{name}.modeling_{name}", fromlist=["x"]
        )
        config_class = {"glm4_moe": t.Glm4MoeConfig, "dots1": t.Dots1Config}[name]
        cfg = config_class(
            hidden_size=H, moe_intermediate_size=12, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=1.5, norm_topk_prob=True,
        )  # fmt: skip
        return cfg, getattr(
            module, {"glm4_moe": "Glm4MoeMoE", "dots1": "Dots1MoE"}[name]
        )
    if name == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            Qwen3NextSparseMoeBlock,
        )

        cfg = t.Qwen3NextConfig(
            hidden_size=H, moe_intermediate_size=12, num_experts=8,
            num_experts_per_tok=2, shared_expert_intermediate_size=20,
            norm_topk_prob=True,
        )  # fmt: skip
        return cfg, Qwen3NextSparseMoeBlock
    if name.startswith("deepseek_v2"):
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

        grouped = name == "deepseek_v2_grouped"
        cfg = t.DeepseekV2Config(
            hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
            moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=2, routed_scaling_factor=1.5,
            topk_method="group_limited_greedy" if grouped else "greedy",
            n_group=4 if grouped else None, topk_group=2 if grouped else None,
        )  # fmt: skip
        return cfg, DeepseekV2Moe
    if name == "hunyuan_v1_moe":
        from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import (
            HunYuanMoEV1Moe,
        )

        cfg = t.HunYuanMoEV1Config(
            hidden_size=H, intermediate_size=24, num_experts=8, moe_topk=2,
            num_attention_heads=2, num_key_value_heads=2,
        )  # fmt: skip
        return cfg, HunYuanMoEV1Moe
    if name.startswith("cohere2_moe"):
        from transformers.models.cohere2_moe.modeling_cohere2_moe import (
            Cohere2MoeSparseMoeBlock,
        )

        sigmoid = name == "cohere2_moe_sigmoid"
        cfg = t.Cohere2MoeConfig(
            hidden_size=H, intermediate_size=24, num_experts=8, num_experts_per_tok=2,
            num_attention_heads=2, num_key_value_heads=2, num_shared_experts=1,
            shared_expert_combination_strategy="sum" if sigmoid else "average",
            expert_selection_fn="sigmoid" if sigmoid else "softmax",
            norm_topk_prob=sigmoid,
        )  # fmt: skip
        return cfg, Cohere2MoeSparseMoeBlock
    if name == "dbrx":
        from transformers.models.dbrx.modeling_dbrx import DbrxFFN

        cfg = t.DbrxConfig(
            d_model=H, n_heads=2,
            ffn_config=dict(ffn_hidden_size=24, moe_num_experts=8, moe_top_k=2),
        )  # fmt: skip
        return cfg, DbrxFFN
    if name == "aria_text":
        from transformers.models.aria.modeling_aria import AriaTextMoELayer

        cfg = t.AriaTextConfig(
            hidden_size=H, intermediate_size=12, moe_num_experts=8, moe_topk=2,
            moe_num_shared_experts=2, num_attention_heads=2, num_key_value_heads=2,
        )  # fmt: skip
        return cfg, AriaTextMoELayer
    if name == "afmoe":
        from transformers.models.afmoe.modeling_afmoe import AfmoeSparseMoeBlock

        cfg = t.AfmoeConfig(
            hidden_size=H, moe_intermediate_size=12, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2,
            num_shared_experts=2, route_scale=1.3,
        )  # fmt: skip
        return cfg, AfmoeSparseMoeBlock
    if name in ("granitemoeshared", "granitemoehybrid"):
        kind = {"granitemoeshared": "Shared", "granitemoehybrid": "Hybrid"}[name]
        module = __import__(
            f"transformers.models.{name}.modeling_{name}", fromlist=["x"]
        )
        cfg = getattr(t, f"GraniteMoe{kind}Config")(
            hidden_size=H, intermediate_size=24, num_local_experts=8,
            num_experts_per_tok=2, shared_intermediate_size=20, num_hidden_layers=1,
            num_attention_heads=2, **({"mamba_n_heads": 4} if kind == "Hybrid" else {}),
        )  # fmt: skip
        moe = getattr(module, f"GraniteMoe{kind}MoE")
        return cfg, _with_shared_mlp(moe, getattr(module, f"GraniteMoe{kind}MLP"))
    if name == "nemotron_h":
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

        cfg = t.NemotronHConfig(
            hidden_size=H, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=24, moe_shared_expert_intermediate_size=20,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            layers_block_type=["moe"], mamba_num_heads=4, mamba_head_dim=8,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        )  # fmt: skip
        return cfg, NemotronHMoE
    if name == "deepseek_v4":
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4SparseMoeBlock,
        )

        # A clamp that bites: pre-activations are about N(0, 1.2^2) here.
        cfg = t.DeepseekV4Config(
            hidden_size=H, moe_intermediate_size=12, n_routed_experts=8,
            num_experts_per_tok=2, vocab_size=100, num_hidden_layers=2,
            mlp_layer_types=["hash_moe", "moe"], num_attention_heads=2, head_dim=16,
            q_lora_rank=8, o_groups=1, o_lora_rank=8, index_n_heads=2,
            index_head_dim=8, swiglu_limit=0.8, routed_scaling_factor=1.5,
        )  # fmt: skip
        return cfg, lambda c: DeepseekV4SparseMoeBlock(c, 1)
    if name == "hy_v4":
        from transformers.models.hy_v4.modeling_hy_v4 import HYV4MoE

        cfg = t.HYV4Config(
            hidden_size=H, intermediate_size=48, moe_intermediate_size=12,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
            num_hidden_layers=2, num_attention_heads=2, n_group=2, topk_group=1,
            swiglu_limit=0.8,
        )  # fmt: skip
        return cfg, HYV4MoE
    if name == "hy_v3":
        from transformers.models.hy_v3.modeling_hy_v3 import HYV3MoE

        cfg = t.HYV3Config(
            hidden_size=H, moe_intermediate_size=12, num_experts=8,
            num_experts_per_tok=2, num_shared_experts=1, num_hidden_layers=1,
            num_attention_heads=2,
        )  # fmt: skip
        return cfg, HYV3MoE
    if name == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        # A clamp that bites (pre-activations are about N(0, 1.2^2) here).
        cfg = t.GptOssConfig(
            hidden_size=H, intermediate_size=12, num_local_experts=8,
            num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, swiglu_limit=0.9,
        )  # fmt: skip
        return cfg, GptOssMLP
    if name == "jetmoe":
        from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE

        cfg = t.JetMoeConfig(
            hidden_size=H, intermediate_size=12, num_local_experts=8,
            num_experts_per_tok=2, num_hidden_layers=1, num_key_value_heads=2,
            kv_channels=8,
        )  # fmt: skip
        return cfg, JetMoeMoE
    if name == "longcat_flash":
        from transformers.models.longcat_flash.modeling_longcat_flash import (
            LongcatFlashMoE,
        )

        cfg = t.LongcatFlashConfig(
            hidden_size=H, ffn_hidden_size=48, expert_ffn_hidden_size=12,
            n_routed_experts=8, zero_expert_num=3, moe_topk=3,
            routed_scaling_factor=6.0, num_layers=1, num_attention_heads=2,
        )  # fmt: skip
        return cfg, LongcatFlashMoE
    if name == "llama4_text":
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

        cfg = t.Llama4TextConfig(
            hidden_size=H, intermediate_size=24, intermediate_size_mlp=48,
            num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        )  # fmt: skip
        return cfg, Llama4TextMoe
    simple = {
        # name: (config class, block class, config kwargs)
        "minimax": ("MiniMaxConfig", "MiniMaxSparseMoeBlock", dict(num_local_experts=8)),
        "jamba": ("JambaConfig", "JambaSparseMoeBlock", dict(num_experts=8)),
        "granitemoe": ("GraniteMoeConfig", "GraniteMoeMoE", dict(num_local_experts=8)),
        "minimax_m2": (
            "MiniMaxM2Config", "MiniMaxM2SparseMoeBlock", dict(num_local_experts=8)
        ),
        "lfm2_moe": (
            "Lfm2MoeConfig", "Lfm2MoeSparseMoeBlock",
            dict(num_experts=8, moe_intermediate_size=12, routed_scaling_factor=1.7),
        ),
        "ernie4_5_moe": (
            "Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock",
            dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=12,
                 moe_num_shared_experts=2),
        ),
    }  # fmt: skip
    config_name, block_name, kwargs = simple[name]
    module = __import__(f"transformers.models.{name}.modeling_{name}", fromlist=["x"])
    cfg = getattr(t, config_name)(
        hidden_size=H, intermediate_size=24, num_experts_per_tok=2, **kwargs
    )
    return cfg, getattr(module, block_name)


def _with_shared_mlp(moe_class, mlp_class):
    """GraniteMoE-Shared's decoder layer sums its block and its `shared_mlp`: the two
    as one module whose state dict is the block's keys plus `shared_mlp.*`."""

    class Block(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()
            moe = moe_class(cfg)
            assert not list(moe.named_parameters(recurse=False))
            for child_name, child in moe.named_children():
                self.add_module(child_name, child)
            self.moe = (moe,)  # not a submodule: its children are registered above
            self.shared_mlp = mlp_class(cfg)

        def forward(self, x):
            return self.moe[0](x) + self.shared_mlp(x)

    return Block


FAMILIES = [
    "mixtral", "olmoe", "qwen3_moe", "qwen2_moe", "qwen3_next", "deepseek_v3",
    "glm4_moe", "dots1", "minimax", "jamba", "granitemoe", "minimax_m2", "lfm2_moe",
    "ernie4_5_moe", "deepseek_v2", "deepseek_v2_grouped", "hunyuan_v1_moe",
    "cohere2_moe", "cohere2_moe_sigmoid", "afmoe", "dbrx", "aria_text",
    "granitemoeshared", "granitemoehybrid", "nemotron_h", "deepseek_v4", "hy_v4",
    "hy_v3", "llama4_text", "gpt_oss", "jetmoe", "longcat_flash",
]  # fmt: skip
TRANSPOSED = ("aria_text", "llama4_text")


def _block(name, seed=0):
    cfg, cls = _family(name)
    torch.manual_seed(seed)
    block = cls(cfg).eval()
    with torch.no_grad():
        # transformers leaves expert weights uninitialised and correction biases at
        # zero, which would hide bugs: draw every parameter and buffer.
        for tensor in list(block.parameters()) + list(block.buffers()):
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.3)
    return cfg, block


def _state_dict(block):
    return {k: v.detach().float().numpy() for k, v in block.state_dict().items()}


def _torch_value_and_grad(block, x):
    xt = torch.tensor(np.asarray(x), requires_grad=True)
    y = block(xt[None])
    # Some blocks return `(out, router logits or weights)`, some flatten the batch.
    y = (y[0] if isinstance(y, tuple) else y).reshape(xt.shape)
    (y.double() ** 2).sum().backward()
    return y.detach().numpy(), xt.grad.numpy()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("num_shards", [1, 4])
def test_family_matches_its_transformers_block(getkey, name, num_shards):
    """Through `config_from_hf(config.to_dict())` and the importer, no hand-written
    config: outputs and input gradients within 1e-5 relative of the block's."""
    cfg, block = _block(name)
    config = me.config_from_hf(cfg.to_dict(), buffer_factor=None)
    layer = me.layer_from_hf_state_dict(
        config, _state_dict(block), transposed_experts=name in TRANSPOSED
    )
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, g_hf = _torch_value_and_grad(block, x)
    m = None if num_shards == 1 else mesh(num_shards)

    def loss(x):
        y, _ = layer(x, mesh=m)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    scale = np.max(np.abs(y_hf))
    np.testing.assert_allclose(np.asarray(y), y_hf, rtol=1e-5, atol=1e-5 * scale)
    gscale = np.max(np.abs(g_hf))
    np.testing.assert_allclose(np.asarray(g), g_hf, rtol=1e-5, atol=1e-5 * gscale)


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("deepseek_v3", dict(num_groups=1, top_groups=1)),
        ("deepseek_v2_grouped", dict(selection=me.Selection(group_top=2))),
        ("deepseek_v4", dict(activation="swiglu")),
        ("deepseek_v4", dict(score_func="sigmoid")),
        ("deepseek_v4", dict(shared=me.SharedCombination(activation="swiglu"))),
        ("hy_v4", dict(shared=me.SharedCombination())),
        ("llama4_text", dict(expert_options=me.ExpertOptions())),
        ("nemotron_h", dict(activation="relu")),
        ("gpt_oss", dict(activation=me.ClampedSwiGLU(limit=7.0, alpha=1.0))),
        ("longcat_flash", dict(norm_topk=True)),
        ("gpt_oss", dict(activation="swiglu")),
    ],
)
def test_a_wrong_config_would_be_caught(getkey, name, change):
    """The comparison above fails when a setting is wrong: DeepSeek-V3's block with
    its groups ignored, DeepSeek-V2's groups scored as V3's, a clamp dropped or added,
    Llama-4's weights on the output, ReLU for ReLU^2: each differs from the block by
    far more than the tolerance."""
    cfg, block = _block(name)
    config = me.config_from_hf(cfg.to_dict())
    wrong = dataclasses.replace(config, **change)
    assert wrong != config
    layer = me.layer_from_hf_state_dict(
        wrong, _state_dict(block), transposed_experts=name in TRANSPOSED
    )
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(block, x)
    assert np.max(np.abs(np.asarray(layer(x)[0]) - y_hf)) > 1e-2 * np.max(np.abs(y_hf))


def _hash_block(seed=0):
    """DeepSeek-V4's hash layer (its layer 0): every parameter drawn, and a table of
    distinct experts per token id drawn too."""
    cfg, _ = _block("deepseek_v4")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4SparseMoeBlock,
    )

    torch.manual_seed(seed)
    block = DeepseekV4SparseMoeBlock(cfg, 0).eval()
    rng = np.random.default_rng(seed)
    table = np.stack([rng.permutation(8)[:2] for _ in range(cfg.vocab_size)])
    with torch.no_grad():
        for tensor in block.parameters():
            tensor.normal_(0.0, 0.3)
        block.gate.tid2eid.copy_(torch.tensor(table))
    return cfg, block


@pytest.mark.parametrize("num_shards", [1, 4])
def test_deepseek_v4_hash_layers(getkey, num_shards):
    """DeepSeek-V4's first layers choose experts by token id (`gate.tid2eid`): the
    importer gives the layer a `HashRouter`, which the caller hands the token ids;
    outputs and input gradients equal the block's, on one device and at EP4."""
    cfg, block = _hash_block()
    layer = me.layer_from_hf_state_dict(
        me.config_from_hf(cfg.to_dict(), buffer_factor=None), _state_dict(block)
    )
    assert isinstance(layer.router, me.HashRouter)
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    ids = jax.random.randint(getkey(), (32,), 0, cfg.vocab_size)
    xt = torch.tensor(np.asarray(x), requires_grad=True)
    y_hf = block(xt[None], torch.tensor(np.asarray(ids))[None])[0]
    (y_hf.double() ** 2).sum().backward()
    m = None if num_shards == 1 else mesh(num_shards)
    forced = layer.router.experts_for(ids)

    def loss(x):
        y, stats = layer(x, mesh=m, experts=forced)
        return jnp.sum(y**2), (y, stats)

    (_, (y, stats)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    stats.check()
    scale = float(jnp.max(jnp.abs(y)))
    np.testing.assert_allclose(y, y_hf.detach().numpy(), rtol=1e-5, atol=1e-5 * scale)
    g_hf = xt.grad.numpy()
    np.testing.assert_allclose(g, g_hf, rtol=1e-5, atol=1e-5 * np.max(np.abs(g_hf)))
    # The table decides: other ids, another output; no ids, a clear error.
    other = layer(x, mesh=m, experts=layer.router.experts_for((ids + 1) % 100))[0]
    assert np.max(np.abs(np.asarray(other) - np.asarray(y))) > 1e-2 * scale
    with pytest.raises(ValueError, match="experts=layer.router.experts_for"):
        layer(x, mesh=m)
    with pytest.raises(ValueError, match=r"`token_ids` must be in \[0, 100\)"):
        layer.router.experts_for(jnp.asarray([100]))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("nemotron_h", {"moe_latent_size": 8}, "moe_latent_size=8"),
        ("nemotron_h", {"mlp_hidden_act": "tanh"}, "mlp_hidden_act='tanh'"),
        ("nemotron_h", {"mlp_bias": True}, "mlp_bias=True"),
        ("deepseek_v4", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ("hy_v3", {"mlp_bias": True}, "mlp_bias=True"),
        ("llama4_text", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("jetmoe", {"activation_function": "gelu"}, "activation_function='gelu'"),
    ],
)
def test_variant_settings_it_cannot_map_are_refused(name, change, message):
    cfg, _ = _block(name)
    with pytest.raises(ValueError, match=message):
        me.config_from_hf(cfg.to_dict() | change)


def test_config_object_and_mapping_agree():
    cfg, _ = _block("qwen2_moe")
    assert me.config_from_hf(cfg) == me.config_from_hf(cfg.to_dict())
    config = me.config_from_hf(cfg, num_slots=1, on_overflow="drop", axis_name="ep")
    assert (config.num_slots, config.on_overflow, config.axis_name) == (1, "drop", "ep")
    assert (config.shared_d_ff, config.shared_gate, config.norm_topk) == (
        20,
        True,
        False,
    )


def test_hub_config_json_keys():
    """The keys as the hub's config.json files spell them (Qwen3-MoE's `num_experts`,
    DeepSeek-V3's `scoring_func` / `topk_method`)."""
    qwen3 = {
        "model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "hidden_act": "silu",
    }  # fmt: skip
    c = me.config_from_hf(qwen3)
    assert (c.d_model, c.d_ff, c.num_experts, c.top_k, c.norm_topk) == (
        2048, 768, 128, 8, True,
    )  # fmt: skip
    v3 = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "hidden_act": "silu",
    }  # fmt: skip
    c = me.config_from_hf(v3)
    assert (c.score_func, c.num_groups, c.top_groups, c.use_router_bias) == (
        "sigmoid", 8, 4, True,
    )  # fmt: skip
    assert (c.routed_scaling_factor, c.shared_d_ff) == (2.5, 2048)
    # A multimodal config's text part.
    assert me.config_from_hf({"model_type": "some_vlm", "text_config": qwen3}) == (
        me.config_from_hf(qwen3)
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "switch_transformers"}, "model_type='switch_transformers'"),
        ({"model_type": "phimoe"}, "model_type='phimoe' is not supported"),
        ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
        (
            {"topk_method": "noaux_tc", "model_type": "deepseek_v2"},
            "topk_method='noaux_tc'",
        ),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"n_routed_experts": None}, "missing key 'n_routed_experts'"),
    ],
)
def test_configs_it_cannot_map_are_refused(change, message):
    """A config maps exactly or is refused, naming the key and value (on a DeepSeek-V3
    config, group_limited_greedy, DeepSeek-V2's method, is refused: V3's block does
    not compute it)."""
    cfg, _ = _block("deepseek_v3")
    hf = cfg.to_dict() | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        me.config_from_hf(hf)


@pytest.mark.parametrize(
    ("config_class", "message"),
    [
        ("PhimoeConfig", "sparsemixer"),
        ("SwitchTransformersConfig", "capacity"),
        ("NllbMoeConfig", "capacity"),
    ],
)
def test_refused_families_say_why(config_class, message):
    """The families this layer does not compute are refused, from their real
    transformers configs, with the reason."""
    hf = getattr(transformers, config_class)().to_dict()
    with pytest.raises(ValueError, match=f"model_type='{hf['model_type']}'.*{message}"):
        me.config_from_hf(hf)


def test_mixtral_jitter_and_overrides_refused():
    cfg, _ = _block("mixtral")
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        me.config_from_hf(cfg.to_dict() | {"router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match=r"overrides \['num_experts'\]"):
        me.config_from_hf(cfg, num_experts=4)


def test_bfloat16_state_dict_gives_a_bfloat16_layer():
    """A bfloat16 state dict (NumPy's `issubdtype` does not call bfloat16 floating)
    gives bfloat16 expert weights, equal to the dict's values; the router stays
    float32."""
    cfg, block = _block("qwen3_moe")
    sd = {
        k: v.detach().to(torch.bfloat16).float().numpy().astype(jnp.bfloat16)
        for k, v in block.state_dict().items()
    }
    layer = me.layer_from_hf_state_dict(me.config_from_hf(cfg), sd)
    assert layer.experts.w_gate_up.dtype == jnp.bfloat16
    assert layer.experts.w_down.dtype == jnp.bfloat16
    assert layer.router.weight.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(layer.experts.w_down, np.float32),
        np.swapaxes(sd["experts.down_proj"].astype(np.float32), 1, 2),
    )


def test_import_draws_no_random_weights(monkeypatch):
    """The layer is built from an abstract skeleton: no random expert weight is drawn
    (the random draws of `MoELayer.__init__` would cost seconds and a full layer of
    memory at real sizes)."""
    import moe_eqx._experts as experts_module

    drawn = []
    real_normal = jax.random.normal

    def counting_normal(key, shape, dtype=jnp.float32):
        out = real_normal(key, shape, dtype)
        if not isinstance(out, jax.core.Tracer):
            drawn.append(shape)
        return out

    monkeypatch.setattr(experts_module.jr, "normal", counting_normal)
    cfg, block = _block("deepseek_v3")
    me.layer_from_hf_state_dict(me.config_from_hf(cfg), _state_dict(block))
    assert drawn == []


def _save_model(tmp_path, dtype=torch.float32):
    """A two-layer Qwen2-MoE causal LM written with `save_pretrained` in small shards
    (every parameter drawn at random)."""
    cfg = transformers.Qwen2MoeConfig(
        hidden_size=H, intermediate_size=24, moe_intermediate_size=12, num_experts=8,
        num_experts_per_tok=2, shared_expert_intermediate_size=20, norm_topk_prob=True,
        num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=2,
        num_key_value_heads=2, vocab_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.normal_(0.0, 0.3)
    model = model.to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    return model


def test_layers_from_a_model_directory(tmp_path, getkey, monkeypatch):
    """A sharded model directory (config.json, index, safetensors shards): every MoE
    layer (the dense layer 1 skipped) equals the model's own block; asking for one
    layer reads only that layer's tensors."""

    model = _save_model(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    layers = me.layers_from_hf(tmp_path)
    assert list(layers) == [0, 2]
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    for i, layer in layers.items():
        y_hf, _ = _torch_value_and_grad(model.model.layers[i].mlp, x)
        np.testing.assert_allclose(np.asarray(layer(x)[0]), y_hf, rtol=1e-5, atol=1e-5)

    read = []
    monkeypatch.setattr(TensorFile, "read", recording_read(read))
    (only,) = me.layers_from_hf(tmp_path, 2).values()
    assert read and all(n.startswith("model.layers.2.mlp.") for n, _, _ in read)
    assert jnp.array_equal(only.experts.w_down, layers[2].experts.w_down)
    with pytest.raises(ValueError, match=r"layers \[1\] are not MoE layers"):
        me.layers_from_hf(tmp_path, 1)


def _hub_model(name):
    """`(causal LM, its MoE layers, block output of layer i for x)` of a tiny model of
    `name`, every parameter drawn at random."""
    t = transformers
    common = dict(hidden_size=H, vocab_size=32, num_attention_heads=2)
    if name in ("granitemoe", "granitemoeshared"):
        kind = {"granitemoe": "", "granitemoeshared": "Shared"}[name]
        extra = {"shared_intermediate_size": 20} if kind else {}
        cfg = getattr(t, f"GraniteMoe{kind}Config")(
            intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
            num_hidden_layers=2, num_key_value_heads=2, **common, **extra,
        )  # fmt: skip
        model = getattr(t, f"GraniteMoe{kind}ForCausalLM")(cfg)

        def block(i, x):
            layer = model.model.layers[i]
            y = layer.block_sparse_moe(x)
            return y + layer.shared_mlp(x) if kind else y

        layers = [0, 1]
    elif name == "nemotron_h":
        cfg = t.NemotronHConfig(
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
            moe_shared_expert_intermediate_size=20, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, layers_block_type=["moe", "moe"],
            mamba_num_heads=4, mamba_head_dim=8, num_key_value_heads=1, head_dim=8,
            **common,
        )  # fmt: skip
        model = t.NemotronHForCausalLM(cfg)

        def block(i, x):
            return model.model.layers[i].mixer(x)

        layers = [0, 1]
    elif name == "deepseek_v4":
        cfg = t.DeepseekV4Config(
            moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
            num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"], head_dim=16,
            q_lora_rank=8, o_groups=1, o_lora_rank=8, index_n_heads=2,
            index_head_dim=8, swiglu_limit=0.8, **common,
        )  # fmt: skip
        model = t.DeepseekV4ForCausalLM(cfg)

        def block(i, x):
            return model.model.layers[i].mlp(x)

        layers = [1]  # layer 0 routes by token id
    else:
        assert name == "llama4_text"
        cfg = t.Llama4TextConfig(
            intermediate_size=24, intermediate_size_mlp=48, num_local_experts=8,
            num_experts_per_tok=1, num_hidden_layers=2, num_key_value_heads=1,
            head_dim=8, **common,
        )  # fmt: skip
        model = t.Llama4ForCausalLM(cfg)

        def block(i, x):
            return model.model.layers[i].feed_forward(x)[0].reshape(x.shape)

        layers = [0, 1]
    torch.manual_seed(0)
    model.eval()
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.3)
    return model, layers, block


@pytest.mark.parametrize(
    "name",
    ["granitemoe", "granitemoeshared", "nemotron_h", "deepseek_v4", "llama4_text"],
)
def test_layers_from_hub_layouts(tmp_path, getkey, name):
    """`save_pretrained` writes each family's hub layout (GraniteMoE's fused
    `input_linear`, Nemotron-H's and DeepSeek-V4's per-expert tensors, DeepSeek-V4's
    `gate.bias`, GraniteMoE-Shared's `shared_mlp` beside the block): every MoE layer
    read from the directory equals the model's own block (for GraniteMoE-Shared, the
    block plus the decoder layer's shared MLP, which it sums)."""
    model, moe_layers, block = _hub_model(name)
    model.save_pretrained(tmp_path)
    layers = me.layers_from_hf(tmp_path, moe_layers)
    assert list(layers) == moe_layers
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    for i, layer in layers.items():
        with torch.no_grad():
            want = block(i, torch.tensor(np.asarray(x))[None])[0].numpy()
        scale = np.max(np.abs(want))
        np.testing.assert_allclose(
            np.asarray(layer(x)[0]), want, rtol=1e-5, atol=1e-5 * scale
        )
    if name == "deepseek_v4":  # layer 0 routes by token id
        assert isinstance(me.layers_from_hf(tmp_path, 0)[0].router, me.HashRouter)
    # Placed on a data x expert mesh: the same arrays, the experts split.
    m = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices("cpu"))
    placed = me.layers_from_hf(tmp_path, moe_layers, mesh=m)
    for i, layer in placed.items():
        assert layer.experts.w_down.sharding.spec == jax.P("expert")
        for got, want in zip(jax.tree.leaves(layer), jax.tree.leaves(layers[i])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_layers_from_a_directory_split_over_a_tensor_axis(tmp_path, getkey):
    """`layers_from_hf(..., mesh=, tensor_axis=)`: routed and shared experts come
    back with their `d_ff` split over the tensor axis, and the layer equals the
    model's own block."""
    model = _save_model(tmp_path)
    mesh = jax.make_mesh((2, 4), ("expert", "tensor"), devices=jax.devices("cpu"))
    (layer,) = me.layers_from_hf(
        tmp_path, [0], mesh=mesh, tensor_axis="tensor"
    ).values()
    assert layer.experts.w_down.sharding.spec == jax.P("expert", "tensor")
    assert layer.experts.w_gate_up.sharding.spec == jax.P("expert", None, "tensor")
    assert layer.shared_experts.w_down.sharding.spec == jax.P("tensor")
    x = jax.random.normal(getkey(), (32, H), jnp.float32)
    y_hf, _ = _torch_value_and_grad(model.model.layers[0].mlp, x)
    y = jax.jit(lambda l, x: l(x, mesh=mesh))(layer, x)[0]
    np.testing.assert_allclose(np.asarray(y), y_hf, rtol=1e-5, atol=1e-5)


def test_bfloat16_model_directory(tmp_path):
    _save_model(tmp_path, torch.bfloat16)
    layers = me.layers_from_hf(tmp_path, [0])
    assert layers[0].experts.w_gate_up.dtype == jnp.bfloat16


_TWO_PROCESS_READ = r"""
import json, os, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_compilation_cache", False)
jax.distributed.initialize(
    coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]),
    initialization_timeout=60,
)
import numpy as np
import moe_eqx as me
from moe_eqx._hf.safetensors_file import TensorFile

sys.path.insert(0, sys.argv[4])  # the tests' helpers
from helpers import recording_read

read = []
real_read = TensorFile.read
TensorFile.read = recording_read(read)
mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
placed = me.layers_from_hf(sys.argv[3], mesh=mesh)
TensorFile.read = real_read
full = me.layers_from_hf(sys.argv[3])  # everything, to check against
x = np.asarray(jax.random.normal(jax.random.key(0), (32, 16)))
for i, layer in placed.items():
    for got, want in zip(jax.tree.leaves(layer), jax.tree.leaves(full[i])):
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(shard.data, np.asarray(want)[shard.index])
    y, _ = jax.jit(lambda l, x: l(x, mesh=mesh))(layer, x)
    y_full, _ = full[i](x)
    for shard in y.addressable_shards:
        np.testing.assert_allclose(
            shard.data, np.asarray(y_full)[shard.index], rtol=1e-5, atol=1e-5
        )
print("READ " + json.dumps(read))
"""


@pytest.mark.parametrize("family", ["qwen2_moe", "granitemoe"])
def test_each_process_reads_only_its_experts(tmp_path, family):
    """2 processes x 4 devices (`jax.distributed`, gloo): `layers_from_hf(...,
    mesh=)` gives each process the expert arrays its devices hold (equal to the
    whole import's, and the layer's output too) and each opens only those experts'
    tensors: Qwen2-MoE's per-expert tensors 0-3 or 4-7, GraniteMoE's fused tensors'
    rows 0:4 or 4:8; the router and shared expert, which every device holds, whole."""
    import socket
    import subprocess
    import sys

    from helpers import demo_env

    if family == "qwen2_moe":
        _save_model(tmp_path)
    else:
        model, _, _ = _hub_model("granitemoe")
        model.save_pretrained(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = demo_env()
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _TWO_PROCESS_READ,
                f"127.0.0.1:{port}",
                str(p),
                str(tmp_path),
                str(pathlib.Path(__file__).parent),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for p in range(2)
    ]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        outs.append(out)
    for p, out in enumerate(outs):
        line = next(x for x in out.splitlines() if x.startswith("READ "))
        read = json.loads(line[len("READ ") :])
        mine = range(4 * p, 4 * p + 4)
        experts = [
            int(m.group(1))
            for name, _, _ in read
            if (m := re.search(r"\.experts\.(\d+)\.", name))
        ]
        slices = [(a, b) for name, a, b in read if a is not None]
        if family == "qwen2_moe":
            assert experts and set(experts) == set(mine), (p, sorted(set(experts)))
            assert not slices
        else:
            assert not experts
            fused = [
                n for n, a, _ in read if "input_linear" in n or "output_linear" in n
            ]
            assert fused and all(a is not None for n, a, _ in read if n in fused)
            assert set(slices) == {(4 * p, 4 * p + 4)}, (p, slices)
        assert any("router" in n or "gate.weight" in n for n, _, _ in read)
