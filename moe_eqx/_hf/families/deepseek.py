"""DeepSeek's lineage: DeepSeek-V2, V3 and V4, and the families transformers builds
from their blocks (GLM-4-MoE, Kimi-Linear, Mistral-4, A.X, HY-V4, Nemotron-H, ...)."""

from ..._combine import OutputTransform
from ..._experts import SharedCombination
from ..._scoring import Selection
from ..reader import (
    UNGATED_ACTIVATIONS,
    Reader,
    clamped_swiglu,
    gated_activation,
    shared_width,
    swiglu,
    unset,
    v3_block,
    v3_routing,
)


def deepseek_v2(r: Reader) -> dict:
    # Softmax scores, never renormalised (its router ignores `norm_topk_prob`), the
    # scaling factor on the weights; groups scored by their best expert.
    swiglu(r)
    no_shared_bias(r)
    method = r.require(
        "topk_method", ("greedy", "group_limited_greedy"), default="greedy"
    )
    groups = int(r.get("n_group", default=1) or 1) if method != "greedy" else 1
    kept = int(r.get("topk_group", default=groups) or groups) if groups > 1 else 1
    f = int(r.get("moe_intermediate_size"))
    shared = shared_width(r, "n_shared_experts", f)
    scale = float(r.get("routed_scaling_factor", default=1.0))
    return dict(
        d_ff=f, num_experts=r.get("n_routed_experts"), score_func="softmax",
        num_groups=groups, top_groups=kept, selection=Selection(group_top=1),
        norm_topk=False, routed_scaling_factor=scale, shared_d_ff=shared,
    )  # fmt: skip


def no_shared_bias(r: Reader) -> None:
    # The block always builds its shared experts, with biases when `mlp_bias`.
    unset(r, "mlp_bias", why=" (biases on the shared experts' projections)")


def deepseek_v3(r: Reader) -> dict:
    swiglu(r)
    r.require("scoring_func", ("sigmoid",), default="sigmoid")
    r.require(
        "topk_method",
        ("noaux_tc",),
        default="noaux_tc",
        why=" (DeepSeek-V3 scores a group by the sum of its best two experts)",
    )
    return dict(
        v3_routing(r),
        shared_d_ff=shared_width(
            r, "n_shared_experts", int(r.get("moe_intermediate_size"))
        ),
    )


def sarvam(r: Reader) -> dict:
    # transformers runs `sarvam_moe` as GLM-4-MoE and `sarvam_mla` as DeepSeek-V3, and
    # reads the original checkpoints' names for the expert counts (`attribute_map`).
    hf = dict(r.hf)
    for old, new in (
        ("num_experts", "n_routed_experts"),
        ("num_shared_experts", "n_shared_experts"),
    ):
        if hf.get(new) is None and hf.get(old) is not None:
            hf[new] = hf[old]
        r.get(old, default=None)  # read as `new`
    inner = Reader(hf)
    out = deepseek_v3(inner)
    r.read |= inner.read
    return out


# DeepSeek-V3's block under a family's own key names (`v3_block`'s arguments), and
# what the family reads besides (`mlp_bias`: the block's shared experts have no biases
# whatever it says; read so that no key goes unread).
V3_BLOCKS = {
    "glm4_moe_lite": {},
    "solar_open": {},
    "glm_moe_dsa": dict(also=("mlp_bias",)),  # GLM-5
    # No shared experts: the block builds none, whatever `n_shared_experts` says.
    "mimo_v2_flash": dict(shared=None, also=("n_shared_experts",)),
    "exaone_moe": dict(experts="num_experts", shared="num_shared_experts"),
    # Kimi-Linear and Bailing-Hybrid: the original checkpoints' names (transformers'
    # `attribute_map`).
    **dict.fromkeys(
        ("kimi_linear", "bailing_hybrid"),
        dict(
            experts="num_experts",
            shared="num_shared_experts",
            group="num_expert_group",
            top_k="num_experts_per_token",
            norm="moe_renormalize",
        ),
    ),
    # dots.3-note's text block: its shared experts `shared_experts_intermediate_size`
    # wide each (`mlp_bias` sizes the vision tower's).
    "dots3_note_text": dict(
        shared_width_key="shared_experts_intermediate_size", also=("mlp_bias",)
    ),
}


def v3_block_family(r: Reader) -> dict:
    keys = dict(V3_BLOCKS[r.model_type])
    for key in keys.pop("also", ()):
        r.get(key, default=None)
    return v3_block(r, **keys)


def mistral4(r: Reader, *, always_norm: bool = False) -> dict:
    """Mistral-4's block: softmax scores, groups scored by the sum of their best two,
    no selection bias, `norm_topk_prob` (always, with `always_norm`), then
    `routed_scaling_factor`; a shared SwiGLU of `n_shared_experts` times
    `moe_intermediate_size`. Its router fills the other groups' experts with 0,
    which every chosen group's positive softmax score beats: the layer's -inf."""
    swiglu(r)
    f = int(r.get("moe_intermediate_size"))
    n_group = int(r.get("n_group", default=1) or 1)
    norm = r.get("norm_topk_prob", default=True)  # read; ignored with `always_norm`
    return dict(
        d_ff=f,
        num_experts=r.get("n_routed_experts"),
        score_func="softmax",
        num_groups=n_group,
        top_groups=int(r.get("topk_group", default=n_group) or n_group),
        norm_topk=always_norm or bool(norm),
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        shared_d_ff=shared_width(r, "n_shared_experts", f),
    )


def mistral_large4_text(r: Reader) -> dict:
    # Mistral-4's block with the top-k always renormalised.
    return mistral4(r, always_norm=True)


def axk1(r: Reader) -> dict:
    # A.X-K1: DeepSeek-V3's block, its output through an RMSNorm
    # (`post_mlp_layernorm`, of `rms_norm_eps`).
    return dict(
        v3_block(r), output=OutputTransform(norm_eps=float(r.get("rms_norm_eps")))
    )


def axk2(r: Reader) -> dict:
    # A.X-K2: DeepSeek-V3's block, with no group step when `n_group` is None (its
    # light checkpoints); with groups, its router fills the other groups' experts'
    # selection scores with 0 rather than -inf.
    out = v3_block(r)
    if out["num_groups"] > 1:
        out["selection"] = Selection(group_fill=0.0)
    return out


def nemotron_h(r: Reader) -> dict:
    # DeepSeek-V3's routing over ungated experts (ReLU^2 by default), an ungated shared
    # expert of `moe_shared_expert_intermediate_size`.
    act = r.require("mlp_hidden_act", tuple(UNGATED_ACTIVATIONS), default="relu2")
    r.require(
        "moe_latent_size", (None,), why=" (latent projections around the experts)"
    )
    unset(r, "mlp_bias")
    return dict(
        v3_routing(r),
        shared_d_ff=int(r.get("moe_shared_expert_intermediate_size", default=0) or 0),
        activation=UNGATED_ACTIVATIONS[act],
    )


def deepseek_v4(r: Reader) -> dict:
    # `sqrt(softplus)` (or sigmoid) scores with a selection bias, always renormalised;
    # SwiGLU clamped at `swiglu_limit` in the routed and the one shared expert. Its
    # first layers route by token id (`gate.tid2eid`): imported with a
    # `moe_eqx.HashRouter`.
    swiglu(r)
    score = r.require(
        "scoring_func", ("sqrtsoftplus", "sigmoid"), default="sqrtsoftplus"
    )
    unset(r, "mlp_bias")
    f = int(r.get("moe_intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("n_routed_experts"),
        score_func=score,
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        shared_d_ff=f,
        activation=clamped_swiglu(r.get("swiglu_limit", default=None)),
    )


def hy_v4(r: Reader) -> dict:
    # DeepSeek-V3's routing; SwiGLU clamped at `swiglu_limit` in the routed experts
    # only (the shared expert is not clamped).
    swiglu(r)
    f = int(r.get("moe_intermediate_size"))
    limit = r.get("swiglu_limit", default=None)
    out = dict(
        v3_routing(r),
        shared_d_ff=shared_width(r, "n_shared_experts", f),
        activation=clamped_swiglu(limit),
    )
    if limit is not None and out["shared_d_ff"]:
        out["shared"] = SharedCombination(activation="swiglu")
    return out


def beam(r: Reader) -> dict:
    # DeepSeek-V3's routing over gated experts of `hidden_act`; no shared expert.
    return dict(v3_routing(r, experts="num_experts"), activation=gated_activation(r))


def glm5_next_text(r: Reader) -> dict:
    # DeepSeek-V3's routing; SwiGLU clamped at `swiglu_limit` in the routed and the
    # shared experts (its block always clamps: the key is required).
    swiglu(r)
    f = int(r.get("moe_intermediate_size"))
    return dict(
        v3_routing(r),
        shared_d_ff=shared_width(r, "n_shared_experts", f),
        activation=clamped_swiglu(r.get("swiglu_limit")),
    )


FAMILIES = {
    "deepseek_v2": deepseek_v2,
    "deepseek_ocr2_text": deepseek_v2,
    "unlimited_ocr_text": deepseek_v2,  # `unlimited_ocr`'s `text_config`
    "deepseek_v3": deepseek_v3,
    "glm4_moe": deepseek_v3,
    "dots1": deepseek_v3,
    # DeepSeek-V3's MoE block (its sparse attention is not the block's); its shared
    # experts have no biases whatever `mlp_bias` says.
    "deepseek_v32": deepseek_v3,
    "glm4v_moe_text": deepseek_v3,
    "sarvam_moe": sarvam,
    "sarvam_mla": sarvam,
    **dict.fromkeys(V3_BLOCKS, v3_block_family),
    "mistral4": mistral4,
    "mistral_large4_text": mistral_large4_text,
    "axk1": axk1,
    "axk2": axk2,
    "nemotron_h": nemotron_h,
    "deepseek_v4": deepseek_v4,
    "hy_v4": hy_v4,
    "hy_v4_vl_text": hy_v4,  # `hy_v4_vl`'s `text_config`
    "beam": beam,
    "glm5_next_text": glm5_next_text,  # a `glm5_next` config's `text_config`
}
