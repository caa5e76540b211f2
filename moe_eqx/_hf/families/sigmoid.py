"""Per-expert (sigmoid) routers outside DeepSeek's lineage: MiniMax-M2 and the
families derived from it (MiniMax-M3, Step-3.7), LFM2-MoE, AFMoE, HY-V3, Llama-4,
Laguna, Kolibri-1 and Inkling."""

from ..._activation import ClampedSwiGLU, SoftcapSwiGLU
from ..._experts import ExpertOptions, SharedCombination
from ..._scoring import Selection, Sigmoid
from ..reader import (
    Reader,
    biased_sigmoid,
    clamped_swiglu,
    gated_activation,
    norm_topk_prob,
    one_per_model,
    shared_width,
    softmax_family,
    swiglu,
    ungated_shared,
    unset,
)


def minimax_m2(r: Reader) -> dict:
    # Its block adds `e_score_correction_bias` whatever `use_routing_bias` says.
    swiglu(r)
    r.require("router_jitter_noise", (0, 0.0), default=0.0)
    r.require("scoring_func", ("sigmoid",), default="sigmoid")
    return biased_sigmoid(
        r, d_ff=("intermediate_size",), experts=("num_local_experts", "num_experts")
    )


def minimax_m3_vl_text(r: Reader) -> dict:
    # MiniMax-M2's routing (sigmoid, a selection bias, renormalised), then
    # `routed_scaling_factor`; GPT-OSS's clamped `gate * sigmoid(alpha gate) * (up +
    # 1)` (gate and up not interleaved, no biases) in the routed experts and the
    # shared expert of `shared_intermediate_size`. Its experts and router read neither
    # `hidden_act` nor `router_jitter_noise`.
    for unused in ("hidden_act", "router_jitter_noise"):
        r.get(unused, default=None)
    return biased_sigmoid(
        r,
        d_ff=("intermediate_size",),
        experts=("num_local_experts", "num_experts"),
        scale=("routed_scaling_factor",),
        shared_d_ff=int(r.get("shared_intermediate_size")),
        activation=ClampedSwiGLU(
            limit=float(r.get("swiglu_limit")), alpha=float(r.get("swiglu_alpha"))
        ),
    )


def step3p5(r: Reader) -> dict:
    # Step-3.7's text model (a `step3p7` config's `text_config`): MiniMax-M2's routing
    # (sigmoid, a selection bias, renormalised), then `moe_router_scaling_factor`; a
    # shared gated expert of `share_expert_dim`. Its per-layer clamps come after the
    # activation, `min(silu(gate), limit)`, with the shared expert's own limit.
    act = gated_activation(r)
    unset(r, "mlp_bias")
    routed, shared = (
        float(v) if v else None
        for v in (
            one_per_model(r, key, default=None)
            for key in ("swiglu_limits", "swiglu_limits_shared")
        )
    )
    if (routed or shared) and act != "swiglu":
        raise ValueError(
            f"{r.model_type} config: hidden_act={r.hf.get('hidden_act')!r} with "
            "swiglu_limits is not supported (the layer clamps SwiGLU only)."
        )
    out = biased_sigmoid(
        r,
        experts=("n_routed_experts", "num_local_experts"),
        scale=("moe_router_scaling_factor",),
        shared_d_ff=int(r.get("share_expert_dim")),
        activation=act if routed is None else clamped_swiglu(routed, after=True),
    )
    if routed is not None or shared is not None:
        own = act if shared is None else clamped_swiglu(shared, after=True)
        out["shared"] = SharedCombination(activation=own)
    return out


def lfm2_moe(r: Reader) -> dict:
    # Its top-k normalisation adds 1e-6 to the sum (a relative 1e-6 or less).
    return dict(
        d_ff=r.get("moe_intermediate_size"),
        num_experts=r.get("num_experts"),
        score_func="sigmoid",
        use_router_bias=bool(r.get("use_expert_bias", default=True)),
        norm_topk=bool(r.get("norm_topk_prob", default=True)),
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
    )


# MiniMax-M2's routing over SwiGLU experts, with `num_shared_experts` summed shared
# experts of their width, under each family's key names: AFMoE's (its 1e-20 in the
# renormalisation is below float32's resolution of the sum) and HY-V3's (its selection
# bias on the block).
_SHARED_SIGMOID = {
    "afmoe": dict(scale=("route_scale",)),
    "hy_v3": dict(
        experts=("num_experts", "num_local_experts"),
        scale=("router_scaling_factor",),
        unset=("mlp_bias",),
    ),
}


def shared_sigmoid(r: Reader) -> dict:
    keys = dict(_SHARED_SIGMOID[r.model_type])
    for key in keys.pop("unset", ()):
        unset(r, key)
    swiglu(r)
    width = int(r.get("moe_intermediate_size"))
    return biased_sigmoid(
        r, **keys, shared_d_ff=shared_width(r, "num_shared_experts", width)
    )


def llama4_text(r: Reader) -> dict:
    # Top-1 (or k) of the logits; the sigmoid of the chosen logits scales the expert's
    # input; one shared SwiGLU of the experts' width.
    swiglu(r)
    f = int(r.get("intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=r.get("num_local_experts"),
        score_func="sigmoid",
        norm_topk=False,
        expert_options=ExpertOptions(weight_on_input=True),
        shared_d_ff=f,
    )


def laguna(r: Reader) -> dict:
    # Sigmoid scores of the (optionally tanh soft-capped) logits with a selection
    # bias, always renormalised, the routed sum times `moe_routed_scaling_factor`,
    # plus an ungated shared expert.
    unset(
        r,
        "moe_apply_router_weight_on_input",
        why=" (transformers does not implement it)",
    )
    out = softmax_family(r, "moe_intermediate_size", True)
    cap = float(r.get("moe_router_logit_softcapping", default=0.0))
    return dict(
        out,
        score_func=Sigmoid(softcap=cap) if cap else "sigmoid",
        use_router_bias=True,
        routed_scaling_factor=float(r.get("moe_routed_scaling_factor", default=1.0)),
        shared_d_ff=ungated_shared(r),
    )


def kolibri1(r: Reader) -> dict:
    # Top-k of the logits plus a selection bias; the weights are the chosen logits'
    # sigmoids, renormalised under `norm_topk_prob`; an ungated shared expert summed.
    out = softmax_family(r, "moe_intermediate_size", norm_topk_prob(r))
    return dict(
        out,
        score_func="sigmoid",
        use_router_bias=True,
        selection=Selection(bias_on_logits=True),
        shared_d_ff=ungated_shared(r),
    )


def inkling2_text(r: Reader) -> dict:
    # Sigmoid scores with a selection bias, renormalised (its 1e-20 is below float32's
    # resolution of the sum), times `route_scale`; experts with the softcapped SwiGLU
    # `cap(gate) * sigmoid(gate) * cap(up)`; no shared expert.
    r.get("hidden_act", default=None)  # read by its vision tower only
    r.require("scoring_func", ("sigmoid",), default="sigmoid")
    r.get("route_scale", "routed_scaling_factor")  # required
    return biased_sigmoid(
        r,
        d_ff=("moe_intermediate_size", "intermediate_size"),
        experts=("n_routed_experts", "num_local_experts"),
        scale=("route_scale", "routed_scaling_factor"),
        activation=SoftcapSwiGLU(
            gate_cap=float(r.get("mlp_gate_softcap")),
            up_cap=float(r.get("mlp_up_softcap")),
        ),
    )


def inkling_text(r: Reader) -> dict:
    # Sigmoid scores, top-k of them plus a selection bias; the router scores its
    # `n_shared_experts` shared experts too (its last rows), and one denominator, the
    # chosen routed and all shared scores, normalises both; every weight times
    # `route_scale` (and the learned `gate.global_scale`, folded into the down
    # projections on import). Its code always scores the shared experts so:
    # `shared_expert_sink` and `rms_norm_eps_moe_gate` are not read by its block.
    act = gated_activation(r)
    shared = r.get("n_shared_experts")
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
        raise ValueError(
            f"{r.model_type} config: n_shared_experts={shared!r} is not supported "
            "(its router needs at least one shared expert)."
        )
    # A checkpoint's config.json with `dense_intermediate_size` gives the experts'
    # width as `intermediate_size` (its config class moves it).
    dense = r.get("dense_intermediate_size", default=None) is not None
    d_ff = "intermediate_size" if dense else "moe_intermediate_size"
    f = int(r.get(d_ff))
    scale = float(r.get("route_scale"))
    return biased_sigmoid(
        r,
        d_ff=(d_ff,),
        experts=("n_routed_experts",),
        scale=("route_scale",),
        shared_d_ff=shared * f,
        shared=SharedCombination(scale=scale, scored=shared),
        activation=act,
    )


def longcat_flash(r: Reader) -> dict:
    # Softmax over the routed and the identity ("zero-computation") experts, a
    # selection bias over both, the chosen scores not renormalised, then
    # `routed_scaling_factor`; identity experts return their input.
    swiglu(r)
    unset(r, "router_bias", why=" (its block creates it, unused)")
    return dict(
        d_ff=r.get("expert_ffn_hidden_size", "moe_intermediate_size"),
        num_experts=r.get("n_routed_experts", "num_local_experts"),
        top_k=r.get("moe_topk", "num_experts_per_tok"),
        score_func="softmax",
        norm_topk=False,
        use_router_bias=True,
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        num_identity_experts=int(r.get("zero_expert_num", default=0) or 0),
    )


FAMILIES = {
    "minimax_m2": minimax_m2,
    "minimax_m3_vl_text": minimax_m3_vl_text,
    "step3p5": step3p5,  # a `step3p7` config's `text_config`
    "lfm2_moe": lfm2_moe,
    **dict.fromkeys(_SHARED_SIGMOID, shared_sigmoid),
    "llama4_text": llama4_text,
    "laguna": laguna,
    "kolibri1": kolibri1,
    "inkling2_text": inkling2_text,  # an `inkling2` config's `text_config`
    # Inkling-2's block; its looped layers run the same block again.
    "inkling2_loop_text": inkling2_text,
    "inkling_text": inkling_text,  # an `inkling_mm_model` config's `text_config`
    "longcat_flash": longcat_flash,
}
