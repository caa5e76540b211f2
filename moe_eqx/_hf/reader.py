"""Reading a Hugging Face config: `Reader`, which refuses what it cannot map and any
key that changes a block's computation but goes unread, and the readers' shared
pieces (activations, widths, DeepSeek-V3's routing)."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._activation import SwiGLU


class Reader:
    """Reads a config mapping's keys, refusing values it cannot map; remembers which
    keys it read, so that `check_read` can refuse a computation-changing key that its
    family's reader never looked at."""

    def __init__(self, hf: Mapping[str, Any]):
        self.hf = hf
        self.model_type = hf.get("model_type")
        self.read: set[str] = set()

    def get(self, *names: str, default: Any = dataclasses.MISSING):
        self.read.update(names)
        for name in names:
            if name in self.hf and self.hf[name] is not None:
                return self.hf[name]
        if default is dataclasses.MISSING:
            raise ValueError(
                f"{self.model_type} config: missing key {names[0]!r}"
                + (f" (or {', '.join(map(repr, names[1:]))})" if names[1:] else "")
                + "."
            )
        return default

    def require(self, name: str, allowed, *, default: Any = None, why: str = ""):
        """`name` must be absent (or None) or one of `allowed`."""
        self.read.add(name)
        value = self.hf.get(name, default)
        if value is None:
            value = default
        if value not in allowed:
            raise ValueError(
                f"{self.model_type} config: {name}={value!r} is not supported "
                f"(supported: {', '.join(map(repr, allowed))}){why}."
            )
        return value

    def check_read(self) -> None:
        """Refuses a key of `COMPUTATION_KEYS` that is present with a value other
        than its neutral ones and that the family's reader did not read (nor lists in
        `IGNORED_KEYS` as unused by its block)."""
        ignored = IGNORED_KEYS.get(self.model_type, ())
        for name, neutral in COMPUTATION_KEYS.items():
            value = self.hf.get(name)
            if name in self.read or name in ignored or value is None:
                continue
            if isinstance(value, list | dict) or value not in neutral:
                raise ValueError(
                    f"{self.model_type} config: {name}={value!r} changes the MoE "
                    f"computation and is not read for this family (the layer would "
                    f"ignore it; neutral: None"
                    + "".join(f", {v!r}" for v in neutral)
                    + ")."
                )


# Config keys that change an MoE block's computation (routing, scores, weights'
# normalisation and scale, experts' activation and biases, shared and identity
# experts, noise), each with the values (besides None) under which a block computes
# what the layer's defaults do. A family's reader reads (`get`/`require`) each key its
# block uses; any other key here with another value is refused (`_Reader.check_read`).
# Which layers are MoE (`first_k_dense_replace`, `moe_layer_freq`, `mlp_only_layers`,
# ...) is not a block's computation: `layers_from_hf` finds the blocks by their
# weights.
COMPUTATION_KEYS: dict[str, tuple] = {
    # experts' activation
    "hidden_act": ("silu", "swish"),
    "mlp_hidden_act": ("silu", "swish"),
    "activation_function": ("silu", "swish"),
    "expert_hidden_act": ("silu", "swish"),
    "swiglu_limit": (),
    "swiglu_alpha": (),
    # biases on the projections or the router
    "mlp_bias": (False,),
    "use_bias": (False,),
    "expert_bias": (False,),
    "router_bias": (False,),
    "use_routing_bias": (False,),
    "use_expert_bias": (False,),
    "moe_router_bias": (False,),
    # scores, selection and the routed weights
    "scoring_func": ("softmax",),
    "score_func": ("softmax",),
    "expert_selection_fn": ("softmax",),
    "topk_method": ("greedy",),
    "norm_topk_prob": (),
    "normalize_expert_weights": (),
    "n_group": (1,),
    "topk_group": (1,),
    "routed_scaling_factor": (1, 1.0),
    "route_scale": (1, 1.0),
    "router_scaling_factor": (1, 1.0),
    "moe_routed_scaling_factor": (1, 1.0),
    "moe_norm_min": (0, 0.0),
    "router_temperature": (1, 1.0),
    "router_logit_softcapping": (0, 0.0),
    "moe_router_logit_softcapping": (0, 0.0),
    "moe_apply_router_weight_on_input": (False,),
    # noise on the router's logits or inputs
    "router_jitter_noise": (0, 0.0),
    "input_jitter_noise": (0, 0.0),
    "jitter_noise": (0, 0.0),
    "moe_jitter_eps": (0, 0.0),
    # shared, identity and latent experts
    "n_shared_experts": (0,),
    "num_shared_experts": (0,),
    "moe_num_shared_experts": (0,),
    "shared_expert_intermediate_size": (0,),
    "shared_intermediate_size": (0,),
    "moe_shared_expert_intermediate_size": (0,),
    "shared_expert_combination_strategy": ("sum",),
    "zero_expert_num": (0,),
    "moe_latent_size": (),
}
# Keys of `COMPUTATION_KEYS` that a family's config carries but its block does not
# use (so they are not read).
IGNORED_KEYS: dict[str, tuple[str, ...]] = {
    # Its router never renormalises; groups only with `topk_method=
    # "group_limited_greedy"`, where its reader reads them.
    "deepseek_v2": ("norm_topk_prob", "n_group", "topk_group"),
    # Its shared experts have no biases whatever `mlp_bias` says.
    "deepseek_v32": ("mlp_bias",),
    # Its router always renormalises and adds no noise; its block builds one shared
    # expert whatever `n_shared_experts` says.
    "deepseek_v4": ("norm_topk_prob", "n_shared_experts", "router_jitter_noise"),
    # Used only with sigmoid selection, where its reader reads it.
    "cohere2_moe": ("norm_topk_prob",),
    # Its shared expert's width is `moe_shared_expert_intermediate_size`;
    # `use_bias` is its Mamba mixers'.
    "nemotron_h": ("n_shared_experts", "use_bias"),
    "llama4_text": ("router_jitter_noise",),  # its router adds no noise
    # Their routers always renormalise (hub configs may still carry the key).
    "qwen3_vl_moe_text": ("norm_topk_prob",),
    "qwen3_5_moe_text": ("norm_topk_prob",),
    "gpt_oss": ("hidden_act",),  # its experts' activation is their own
    "qwen3_moe": ("shared_expert_intermediate_size",),  # it has no shared expert
    # DeepSeek-V2's block.
    "deepseek_ocr2_text": ("norm_topk_prob", "n_group", "topk_group"),
    "unlimited_ocr_text": ("norm_topk_prob", "n_group", "topk_group"),
}


def swiglu(r: Reader) -> None:
    r.require("hidden_act", ("silu", "swish"), default="silu")


def unset(r: Reader, key: str, why: str = " (biases on the projections)") -> None:
    """`key` must be absent, None or false: a setting the layer does not compute."""
    r.require(key, (False,), default=False, why=why)


def biased_sigmoid(
    r: Reader,
    *,
    d_ff: tuple[str, ...] = ("moe_intermediate_size",),
    experts: tuple[str, ...] = ("num_experts",),
    scale: tuple[str, ...] | None = None,
    **fields,
) -> dict:
    """Sigmoid scores with a selection bias, always renormalised, then the factor at
    `scale` (1 without): MiniMax-M2's routing and the families that share it, under
    their own key names (`d_ff`, `experts`: the first key present)."""
    factor = 1.0 if scale is None else float(r.get(*scale, default=1.0))
    return dict(
        d_ff=r.get(*d_ff),
        num_experts=r.get(*experts),
        score_func="sigmoid",
        use_router_bias=True,
        norm_topk=True,
        routed_scaling_factor=factor,
        **fields,
    )


def softmax_with_shared(
    r: Reader,
    *,
    d_ff: str,
    experts: str,
    top_k: str,
    shared: str,
    **fields,
) -> dict:
    """Softmax top-k renormalised over SwiGLU experts of width `d_ff`, and `shared`
    shared experts of that width (ERNIE-4.5's and Aria's blocks, under their key
    names)."""
    swiglu(r)
    f = int(r.get(d_ff))
    return dict(
        d_ff=f,
        num_experts=r.get(experts),
        top_k=r.get(top_k),
        score_func="softmax",
        norm_topk=True,
        shared_d_ff=shared_width(r, shared, f),
        **fields,
    )


# `hidden_act` -> the gated activation `act(x @ Wg) * (x @ Wu)` of experts that apply
# `ACT2FN[hidden_act]` to their gate projection.
GATED_ACTIVATIONS = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
}
# Hugging Face activation names (`ACT2FN`) -> the layer's ungated ones.
UNGATED_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "relu2": "relu2",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def gated_activation(r: Reader, key: str = "hidden_act", default: str = "silu") -> str:
    """The gated activation of `ACT2FN[key]` on the gate projection."""
    return GATED_ACTIVATIONS[r.require(key, tuple(GATED_ACTIVATIONS), default=default)]


def clamped_swiglu(limit, *, after: bool = False) -> str | SwiGLU:
    """SwiGLU clamped at `limit` (`swiglu_limit`; `None`: unclamped), the gate's
    clamp after the SiLU with `after` (Step-3.7)."""
    if limit is None:
        return "swiglu"
    return SwiGLU(limit=float(limit), limit_after=after)


def softmax_family(r: Reader, d_ff_key: str, norm_topk: bool) -> dict:
    """Softmax top-k routing over gated experts (and shared expert) of `hidden_act`,
    the experts' width at `d_ff_key`."""
    return dict(
        d_ff=r.get(d_ff_key),
        num_experts=r.get("num_experts", "num_local_experts"),
        score_func="softmax",
        norm_topk=norm_topk,
        activation=gated_activation(r),
    )


def shared_width(r: Reader, count_key: str, width: int) -> int:
    """The shared expert's width: `count_key` shared experts (0 if absent) of `width`."""
    return int(r.get(count_key, default=0) or 0) * width


def norm_topk_prob(r: Reader) -> bool:
    return bool(r.get("norm_topk_prob", default=False))


def ungated_shared(r: Reader) -> int:
    """A shared expert of `shared_expert_intermediate_size`, summed without a gate
    (Flint's, Laguna's, Lara-Mini's)."""
    return int(r.get("shared_expert_intermediate_size", default=0) or 0)


def one_per_model(r: Reader, name: str, default: Any = dataclasses.MISSING):
    """A per-layer setting given as a list must be the same for every layer
    (`layers_from_hf` reads each layer's own entry); an empty list is `None`."""
    value = r.get(name, default=default)
    if isinstance(value, list):
        if len(set(value)) > 1:
            raise ValueError(
                f"{r.model_type} config: {name}={value!r} differs between layers; "
                f"`layers_from_hf` reads each layer's own value, or pass the layer's "
                f"own config (with {name} set to its value)."
            )
        value = value[0] if value else None
    return value


def v3_routing(
    r: Reader,
    *,
    experts: str = "n_routed_experts",
    group: str = "n_group",
    norm: str = "norm_topk_prob",
) -> dict:
    """DeepSeek-V3's routing and experts' keys (also Nemotron-H's and HY-V4's), under
    a family's own names for the experts, the groups and the renormalisation:
    sigmoid scores with a selection bias, groups (`group` of them, `topk_group` kept)
    scored by their best two, renormalised when `norm`, then
    `routed_scaling_factor`."""
    n_group = int(r.get(group, default=1) or 1)
    return dict(
        d_ff=r.get("moe_intermediate_size"),
        num_experts=r.get(experts),
        score_func="sigmoid",
        num_groups=n_group,
        top_groups=int(r.get("topk_group", default=n_group) or n_group),
        use_router_bias=True,
        norm_topk=bool(r.get(norm, default=True)),
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
    )


def v3_block(
    r: Reader,
    *,
    experts: str = "n_routed_experts",
    shared: str | None = "n_shared_experts",
    shared_width_key: str = "moe_intermediate_size",
    group: str = "n_group",
    top_k: str = "num_experts_per_tok",
    norm: str = "norm_topk_prob",
) -> dict:
    """DeepSeek-V3's block under a family's own key names (`v3_routing`), the top-k
    at `top_k`; a shared SwiGLU of `shared` times `shared_width_key` (`shared=None`:
    the block has none)."""
    swiglu(r)
    width = 0 if shared is None else int(r.get(shared_width_key))
    return dict(
        v3_routing(r, experts=experts, group=group, norm=norm),
        top_k=r.get(top_k),
        shared_d_ff=0 if shared is None else shared_width(r, shared, width),
    )
