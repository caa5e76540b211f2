"""Softmax routers: Mixtral and its likes (Qwen, OLMoE, Jamba, GraniteMoE, DBRX,
Aria, ERNIE-4.5, Cohere2-MoE, Gemma-4, JetMoE, ...) and GPT-OSS."""

from ..._activation import ClampedSwiGLU
from ..._combine import OutputTransform
from ..._experts import ExpertOptions, SharedCombination
from ..._scoring import Softmax, Weighting
from ..reader import (
    Reader,
    gated_activation,
    norm_topk_prob,
    one_per_model,
    shared_width,
    softmax_family,
    softmax_with_shared,
    swiglu,
    ungated_shared,
    unset,
)
from .deepseek import no_shared_bias

# Families that differ only in key names: `(the experts' width, how the top-k is
# renormalised: always, never, or by `norm_topk_prob`)`.
_SOFTMAX = {
    "olmoe": ("intermediate_size", None),
    "flex_olmo": ("intermediate_size", None),  # OLMoE's block
    "qwen3_moe": ("moe_intermediate_size", None),
    "mellum": ("moe_intermediate_size", None),  # Qwen3-MoE's block
    "qwen3_omni_moe_text": ("moe_intermediate_size", None),  # its thinker's
    # Qwen3-VL-MoE's text block: Qwen3-MoE's, whose router always renormalises.
    "qwen3_vl_moe_text": ("moe_intermediate_size", True),
    "jamba": ("intermediate_size", False),
}


def softmax_table(r: Reader) -> dict:
    d_ff, norm = _SOFTMAX[r.model_type]
    return softmax_family(r, d_ff, norm_topk_prob(r) if norm is None else norm)


def jetmoe(r: Reader) -> dict:
    # Softmax over the chosen k logits; `input_linear`/`output_linear` experts with
    # `activation_function`; one bias on the block's output.
    r.require("activation_function", ("silu", "swish"), default="silu")
    return dict(
        d_ff=r.get("intermediate_size"),
        num_experts=r.get("num_local_experts", "num_experts"),
        score_func="softmax",
        norm_topk=True,
        output=OutputTransform(bias=True),
    )


def mixtral(r: Reader) -> dict:
    r.require(
        "router_jitter_noise",
        (0, 0.0),
        default=0.0,
        why=" (training-time noise on the router's logits)",
    )
    return softmax_family(r, "intermediate_size", True)


def qwen2_moe(r: Reader) -> dict:
    # Qwen3-MoE's block with a gated shared expert (also Qwen3-Next's and
    # Qwen4-Exp's).
    out = softmax_family(r, "moe_intermediate_size", norm_topk_prob(r))
    shared = int(r.get("shared_expert_intermediate_size", default=0))
    return dict(out, shared_d_ff=shared, shared_gate=shared > 0)


def qwen3_5_moe_text(r: Reader) -> dict:
    # Qwen3.5-MoE's text block: Qwen2-MoE's with the top-k always renormalised and
    # the gated shared expert always built.
    out = softmax_family(r, "moe_intermediate_size", True)
    shared = int(r.get("shared_expert_intermediate_size"))
    return dict(out, shared_d_ff=shared, shared_gate=True)


def granitemoe(r: Reader) -> dict:
    # Softmax over the chosen k logits: the renormalised top-k probabilities.
    r.require(
        "shared_intermediate_size",
        (0, None),
        default=0,
        why=" (GraniteMoE-Shared's shared expert is not read yet)",
    )
    return softmax_family(r, "intermediate_size", True)


def granitemoe_shared(r: Reader) -> dict:
    # GraniteMoE's routing, plus the decoder layer's `shared_mlp` (a SwiGLU of
    # `shared_intermediate_size`, summed), imported with the block.
    out = softmax_family(r, "intermediate_size", True)
    return dict(out, shared_d_ff=int(r.get("shared_intermediate_size", default=0)))


def ernie4_5_moe(r: Reader) -> dict:
    # A selection bias; its router divides by `max(sum, moe_norm_min)`.
    unset(r, "use_bias")
    return softmax_with_shared(
        r,
        d_ff="moe_intermediate_size",
        experts="moe_num_experts",
        top_k="moe_k",
        shared="moe_num_shared_experts",
        use_router_bias=True,
        weighting=Weighting(floor=float(r.get("moe_norm_min", default=0.0))),
    )


def hunyuan_v1_moe(r: Reader) -> dict:
    # Softmax top-k renormalised, plus an ungated shared SwiGLU of the model's width.
    swiglu(r)
    f = int(r.get("intermediate_size"))
    return dict(
        d_ff=f,
        num_experts=one_per_model(r, "num_experts"),
        top_k=one_per_model(r, "moe_topk"),
        score_func="softmax",
        norm_topk=True,
        shared_d_ff=f,
    )


def cohere2_moe(r: Reader) -> dict:
    # Top-k of the logits, then a softmax over the chosen k (the renormalised top-k
    # probabilities) or their sigmoids; shared experts summed or averaged.
    swiglu(r)
    selection = r.require(
        "expert_selection_fn", ("softmax", "sigmoid"), default="softmax"
    )
    f = int(r.get("intermediate_size"))
    shared = shared_width(r, "num_shared_experts", f)
    strategy = r.require(
        "shared_expert_combination_strategy", ("sum", "average"), default="sum"
    )
    half = shared > 0 and strategy == "average"
    return dict(
        d_ff=f,
        num_experts=r.get("num_experts"),
        score_func=selection,
        norm_topk=selection == "softmax"
        or bool(r.get("norm_topk_prob", default=False)),
        shared_d_ff=shared,
        routed_scaling_factor=0.5 if half else 1.0,
        shared=SharedCombination(scale=0.5 if half else 1.0),
    )


def dbrx(r: Reader) -> dict:
    # Its block's settings live in `ffn_config`: softmax top-k, the weights divided by
    # their p-norm (p = 1: renormalised; None: raw).
    ffn = r.get("ffn_config")
    f = Reader(dict(ffn, model_type="dbrx ffn_config"))
    act = (f.get("ffn_act_fn", default={}) or {}).get("name", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"dbrx config: ffn_config.ffn_act_fn={act!r} is not supported."
        )
    f.require("moe_jitter_eps", (None, 0, 0.0), why=" (training-time input noise)")
    norm = f.require(
        "moe_normalize_expert_weights", (None, 1, 1.0), why=" (p-norm other than 1)"
    )
    return dict(
        d_ff=f.get("ffn_hidden_size"),
        num_experts=f.get("moe_num_experts"),
        top_k=f.get("moe_top_k"),
        d_model=r.get("d_model", "hidden_size"),
        score_func="softmax",
        norm_topk=norm is not None,
    )


def aria(r: Reader) -> dict:
    # Softmax over the chosen logits; shared experts of `moe_num_shared_experts` times
    # the experts' width. Its experts are stored transposed (`transposed_experts`).
    no_shared_bias(r)
    return softmax_with_shared(
        r,
        d_ff="intermediate_size",
        experts="moe_num_experts",
        top_k="moe_topk",
        shared="moe_num_shared_experts",
    )


def flint(r: Reader) -> dict:
    # Qwen3-MoE's block with sigmoid scores of the logits (no selection bias), the
    # chosen renormalised under `norm_topk_prob`, plus an ungated shared expert.
    out = softmax_family(r, "moe_intermediate_size", norm_topk_prob(r))
    return dict(out, score_func="sigmoid", shared_d_ff=ungated_shared(r))


def lara_mini(r: Reader) -> dict:
    # Flint's block (ungated shared expert) with Qwen3-Next's softmax router.
    out = softmax_family(r, "moe_intermediate_size", norm_topk_prob(r))
    return dict(out, shared_d_ff=ungated_shared(r))


def gemma4_text(r: Reader) -> dict:
    # Gemma-4's MoE block (its decoder layer's `router` and `experts`, beside a dense
    # MLP): softmax top-k, renormalised, then times `per_expert_scale` of the chosen
    # expert; gated experts of `hidden_activation`. The layer's input is the
    # residual's RMS norm without a weight (`rms_norm_eps`): the router's and the
    # experts' own scales are folded into their weights on import.
    if r.model_type == "gemma4_text":
        r.require("enable_moe_block", (True,), why=" (a model without MoE blocks)")
    act = gated_activation(r, "hidden_activation", default="gelu_pytorch_tanh")
    r.get("rms_norm_eps")  # of the caller's norm, the layer's input
    return dict(
        d_ff=r.get("moe_intermediate_size"),
        num_experts=r.get("num_experts"),
        top_k=r.get("top_k_experts"),
        score_func="softmax",
        norm_topk=True,
        activation=act,
    )


def gpt_oss(r: Reader) -> dict:
    # A logit bias on the router, softmax over the chosen k logits (the renormalised
    # top-k probabilities); experts with biases and the clamped `gate * sigmoid(alpha
    # gate) * (up + 1)` activation. OpenAI-Privacy-Filter's (a token classifier with
    # GPT-OSS's routing and experts) divides the chosen weights by k and multiplies
    # the output by k, which cancel; its experts' gate and up columns are stored in
    # halves (`layers_from_hf` reads them so).
    return dict(
        d_ff=r.get("intermediate_size"),
        num_experts=r.get("num_local_experts", "num_experts"),
        score_func=Softmax(logit_bias=True),
        norm_topk=True,
        expert_options=ExpertOptions(bias=True),
        activation=ClampedSwiGLU(
            limit=float(r.get("swiglu_limit", default=7.0)),
            alpha=float(r.get("swiglu_alpha", default=1.702)),
        ),
    )


FAMILIES = {
    **dict.fromkeys(_SOFTMAX, softmax_table),
    "mixtral": mixtral,
    "minimax": mixtral,
    "jetmoe": jetmoe,
    "qwen2_moe": qwen2_moe,
    "qwen3_next": qwen2_moe,
    "qwen4_exp_text": qwen2_moe,  # Qwen3-Next's block: a gated shared expert
    "qwen3_5_moe_text": qwen3_5_moe_text,
    "granitemoe": granitemoe,
    "granitemoeshared": granitemoe_shared,
    "granitemoehybrid": granitemoe_shared,
    "granitemoe_swa": granitemoe_shared,  # GraniteMoE-Shared's block and shared_mlp
    "ernie4_5_moe": ernie4_5_moe,
    "hunyuan_v1_moe": hunyuan_v1_moe,
    "cohere2_moe": cohere2_moe,
    "dbrx": dbrx,
    "aria_text": aria,
    "flint": flint,
    "lara_mini": lara_mini,
    "gemma4_text": gemma4_text,  # also a `gemma4` config's `text_config`
    "diffusion_gemma_text": gemma4_text,  # a `diffusion_gemma` config's
    "gpt_oss": gpt_oss,
    "openai_privacy_filter": gpt_oss,
}
