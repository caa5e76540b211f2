"""The config readers of every supported `model_type`, grouped by lineage, and the
families refused with the reason."""

from . import deepseek, mixtral, sigmoid

# `model_type` -> its reader: `Reader` -> `MoEConfig` keyword arguments.
FAMILIES = {**deepseek.FAMILIES, **mixtral.FAMILIES, **sigmoid.FAMILIES}
assert len(FAMILIES) == sum(len(m.FAMILIES) for m in (deepseek, mixtral, sigmoid)), (
    "a model_type is read by two lineages"
)

# MoE families whose routing this layer does not compute, and why.
_CAPACITY_DROPS = (
    "router drops the pairs past each expert's capacity in token order; the layer "
    "never drops a token it can compute"
)
REFUSED = {
    "phimoe": "its sparsemixer router picks two experts through a jitter "
    "threshold, in evaluation too; the layer's top-k routing is not that",
    "switch_transformers": f"its {_CAPACITY_DROPS}",
    "nllb-moe": f"its top-2 {_CAPACITY_DROPS}",
    "ernie4_5_vl_moe_text": "its experts are split by modality (text tokens through "
    "the text experts, image tokens through the vision experts), which one layer's "
    "routing does not compute",
    # Batch 2.
    "zaya": "its router is an MLP (a down-projection plus the previous layer's router "
    "state, an RMSNorm and two GELU layers) over the experts and a skip expert, not "
    "a linear score of the token",
    "doge": "its product-key router reshapes the batch's router logits so that one "
    "token's two key scores come from different tokens: a token's experts depend on "
    "the other tokens, not on its own score alone",
    "vitpose_backbone": "a vision backbone (ViTPose, not a text decoder) whose experts "
    "are linear heads computing part of the MLP's output features, chosen by the "
    "dataset index given with each image, not by a router",
    # Batch 3.
    "muse_spark_text": "each expert's output goes through its own RMSNorm "
    "(`post_expert_norm`) before it is weighted, and the experts read a projected, "
    "normalised input (`pre_expert_proj`, `pre_expert_norm`, `moe_hidden_size` wide) "
    "that the router does not: experts that are not an FFN the layer has",
}

# Each lineage's families, for the documentation's tables (`moe_eqx._hf.catalog`).
LINEAGES = {
    "DeepSeek and the blocks built from it": deepseek.FAMILIES,
    "Mixtral, Qwen, OLMoE and other softmax routers; GPT-OSS": mixtral.FAMILIES,
    "MiniMax-M2 and other per-expert (sigmoid) routers": sigmoid.FAMILIES,
}
# Wrappers (multimodal models, a thinker) whose text model's MoE blocks are read: the
# wrapper's `model_type` -> its text model's (`config_from_hf` reads the
# `text_config`, Qwen3-Omni-MoE's under its `thinker_config`).
WRAPPERS = {
    "aria": "aria_text",
    "llama4": "llama4_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_omni_moe": "qwen3_omni_moe_text",
    "qwen4_exp": "qwen4_exp_text",
    "glm4v_moe": "glm4v_moe_text",
    "glm5_next": "glm5_next_text",
    "dots3_note": "dots3_note_text",
    "deepseek_ocr2": "deepseek_ocr2_text",
    "unlimited_ocr": "unlimited_ocr_text",
    "mistral3": "mistral4",  # Mistral-Small-4
    "mistral_large4": "mistral_large4_text",
    "hy_v4_vl": "hy_v4_vl_text",
    "minimax_m3_vl": "minimax_m3_vl_text",
    "inkling2": "inkling2_text",
    "inkling2_loop": "inkling2_loop_text",
    "inkling_mm_model": "inkling_text",
    "step3p7": "step3p5",
    "gemma4": "gemma4_text",
    "diffusion_gemma": "diffusion_gemma_text",
    "muse_spark": "muse_spark_text",
    "ernie4_5_vl_moe": "ernie4_5_vl_moe_text",
}
