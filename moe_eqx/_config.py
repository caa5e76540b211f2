"""`MoEConfig`: the static description of an MoE layer, validated at construction."""

import math
import numbers

import equinox as eqx
import numpy as np

from ._exchange import AbstractExchange
from ._gmm import AbstractGMMBackend
from ._gmm._base import ACTIVATIONS, Activation
from ._slots import SLOT_BACKWARDS

GMM_BACKENDS = ("auto", "tiled", "ragged_dot", "dense", "mosaic_gpu")
EXCHANGES = ("auto", "dense", "ragged", "allgather")
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
# How a layer is parallelised and buffered, as opposed to what it computes: the fields
# that no model's config sets (`config_from_hf`'s overrides).
PARALLEL_FIELDS = (
    "buffer_factor",
    "on_overflow",
    "num_slots",
    "slot_backward",
    "max_slot_exports",
    "dedup",
    "gmm_backend",
    "exchange",
    "axis_name",
    "fsdp_axes",
)


def _integer(value):
    # NumPy and other integral scalars become Python ints (hashable, static); anything
    # else is left for `__check_init__` to reject with the field's name.
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _real(value):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def _pair(value):
    # A list from a config file becomes a hashable tuple of reals.
    if isinstance(value, list | tuple):
        return tuple(_real(v) for v in value)
    return value


def _axis_names(value):
    # One name or a sequence of names; anything else reaches `__check_init__`.
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _boolean(value):
    # NumPy booleans become Python bools; strings such as "false" are not truthy here.
    return bool(value) if isinstance(value, np.bool_) else value


class MoEConfig(eqx.Module):
    """Static configuration of an MoE layer.

    **Arguments:**

    - `d_model`: model width `H`.
    - `d_ff`: hidden width `F` of each expert.
    - `num_experts`: number of routed experts `E`.
    - `top_k`: experts per token `k`.
    - `score_func`: `"softmax"` (top-k of softmax), `"sigmoid"` (top-k of
        per-expert sigmoid scores, DeepSeek-V3) or `"sqrtsoftplus"` (top-k of
        `sqrt(softplus(logit))`, DeepSeek-V4).
    - `norm_topk`: renormalise the chosen k scores to sum to 1 (both score
        functions); `False` uses the raw scores (softmax probabilities, or sigmoid
        scores as DeepSeek-V3 with `norm_topk_prob=False`).
    - `norm_topk_min`: the floor of that renormalisation's divisor: the chosen scores
        are divided by `max(sum, norm_topk_min)` (ERNIE-4.5's `moe_norm_min`), so a
        token whose chosen scores sum below it keeps weights summing below 1; `0`
        (default): divided by the sum. Needs `norm_topk=True` when positive.
    - `num_groups`, `top_groups`: group-limited routing (DeepSeek-V3): experts are split
        into `num_groups` contiguous groups and each token may only choose among the
        experts of its `top_groups` best groups.
    - `shared_scale`: multiplies the shared expert's output (Cohere2-MoE's
        "average" combination: `routed_scaling_factor=0.5, shared_scale=0.5`).
    - `group_score`: a group's score in group-limited routing: `"top2"`, the sum of
        its best two selection scores (DeepSeek-V3), or `"max"`, its best one
        (DeepSeek-V2's `group_limited_greedy`).
    - `group_fill`: the selection score of the experts outside a token's
        `top_groups` groups: `-inf` (default: never chosen), or a finite value that
        they compete with (A.X-K2's router fills them with 0, so one of them is
        chosen over an expert of a kept group whose biased score is below 0).
    - `use_router_bias`: add a selection-only bias (aux-loss-free balancing).
    - `routed_scaling_factor`: multiplies the routed experts' output, after the
        weights are normalised (DeepSeek-V3 uses 2.5).
    - `shared_d_ff`: hidden width of the shared expert that every token goes through
        (0 = none; DeepSeek-V3's is `n_shared_experts * moe_intermediate_size`).
    - `shared_gate`: scale the shared expert's output by a per-token sigmoid gate
        `sigmoid(x @ gate)` (Qwen2-MoE); needs `shared_d_ff > 0`.
    - `shared_in_norm`: `S > 0` shared experts of width `shared_d_ff / S` each that
        the router scores too (Inkling): its weight has `S` more columns, and shared
        expert `s` is weighted per token by its score normalised together with the
        chosen routed experts' (`norm_topk`: one denominator, the sum of the `k`
        chosen and the `S` shared scores), times `shared_scale`. Needs sigmoid or
        sqrt-softplus scores, `shared_d_ff` a multiple of `S` and no `shared_gate`.
    - `buffer_factor`: receive buffer rows per shard `B = ceil(buffer_factor * T * k)`;
        `None` means the worst case, which never overflows.
    - `on_overflow`: `"fallback"` (chunked dropless path; no token ever dropped) or
        `"drop"` (pairs beyond the buffer are dropped, counted in `stats.dropped_pairs`).
    - `num_slots`: spare expert slots per shard for dynamic duplication (0 = off).
    - `slot_backward`: how the slot weights' gradients reach their home shards:
        `"all_gather"` (all-gather the `[S, ...]` slot gradients, `R*S` expert-sized
        buffers per device), `"home"` (send each only to its home shard: `S + C` with
        the ragged exchange) or `"auto"` (the one with fewer buffers); see
        [`moe_eqx.internal.gather_slot_weights`][].
    - `max_slot_exports`: `C`, the most slot copies of one shard's home experts per
        step (the plan's out-degree bound, which sizes the slot exchange);
        `None` = `default_max_exports(R, L, S)` of the planner.
    - `dedup`: send a token once per destination shard rather than once per pair.
    - `gmm_backend`: `"auto"`, `"tiled"`, `"ragged_dot"`, `"dense"` or `"mosaic_gpu"`,
        or a backend instance (e.g. a tuned `TiledGMM(tile_rows=...)` or
        `MosaicGPUGMM(...)`), as optimistix and lineax take solver objects.
    - `exchange`: exchange backend, `"auto"`, `"dense"`, `"ragged"` or `"allgather"`
        (tokens all-gathered, outputs reduce-scattered), or an
        [`moe_eqx.AbstractExchange`][] instance (a `DenseExchange` gets the layer's
        `axis_name` and block size; other instances are used as given). `"auto"`
        chooses from the call's static shapes and platform
        ([`moe_eqx.internal.choose_exchange`][]).
    - `axis_name`: the expert-parallel mesh axis.
    - `fsdp_axes`: data-parallel mesh axes that the experts are split over too
        (FSDP / ZeRO-3): [`moe_eqx.shard_model`][] places them so, and the layer
        gathers a shard's experts over these axes when it runs; their gradients come
        back reduce-scattered. The experts' dimension is split over the expert axis
        and these jointly when their `D` devices divide a shard's `E / R` experts,
        else each expert's `d_ff` dimension over them. `()` (default): experts
        replicated over the data axes.
    - `activation`: the experts' (and shared expert's) activation, a name of
        [`moe_eqx.Activation`][]: gated `"swiglu"` (default), `"geglu"`,
        `"geglu_tanh"`, `"swiglu_oai"` (GPT-OSS), `"swiglu_softcap"` (Inkling-2),
        or ungated `"relu"`, `"relu2"`,
        `"gelu"`, `"gelu_tanh"`, `"silu"` (whose `w_gate_up` is `[E, d_model, d_ff]`,
        the up projection alone).
    - `activation_limit`: clamp of `"swiglu"` (`swiglu_limit`) and `"swiglu_oai"`:
        `gate <= limit`, `-limit <= up <= limit`; `None` = no clamp.
    - `activation_limit_after`: `"swiglu"`'s clamp of the gate applies to `silu(gate)`
        instead of `gate` (Step-3.7: `min(silu(gate), limit)`); `up` is clamped as
        before.
    - `shared_activation_limit`: the shared expert's own clamp (Step-3.7, whose
        shared expert has another limit than its routed experts); `None`: the shared
        expert follows `limit_shared`.
    - `limit_shared`: `activation_limit` also clamps the shared expert (DeepSeek-V4);
        `False` clamps the routed experts only (HY-V4).
    - `activation_alpha`: the sigmoid's slope in `"swiglu_oai"` (GPT-OSS: 1.702).
    - `activation_softcap`: `(gate cap, up cap)` of `"swiglu_softcap"` (Inkling-2:
        `c * tanh(v / c)` on the gate's linear factor and on `up`); `None` otherwise.
    - `weight_on_input`: the routing weight scales the expert's input instead of its
        output: `sum_e expert_e(w_e x)` (Llama-4).
    - `expert_bias`: per-expert biases on both projections,
        `act(x @ W1_e + b1_e) @ Wd_e + bd_e` (GPT-OSS); see [`moe_eqx.Experts`][].
    - `num_identity_experts`: zero-computation experts that return their input
        (LongCat-Flash): the router scores `E + num_identity_experts` columns, and a
        token's picks among the last ones add `w x`, computed on its own shard and
        never sent.
    - `output_bias`: a bias added once to every token's output, after the routed and
        shared experts (JetMoE), `layer.output_bias [d_model]`.
    - `output_norm_eps`: an RMSNorm of the output over `d_model`, last, with this
        epsilon and the weight `layer.output_norm [d_model]` (A.X-K1's
        `post_mlp_layernorm`); `None` (default): none.
    - `router_logit_bias`: a trained bias added to the router's logits (GPT-OSS),
        `layer.router.logit_bias [E + num_identity_experts]`; unlike
        `use_router_bias`'s, it changes the weights too.
    - `bias_on_logits`: the selection bias (`use_router_bias`) is added to the
        router's logits instead of its scores, `experts = top_k(logits + bias)`
        (Kolibri-1); the weights are still the chosen experts' scores.
    - `router_softcap`: tanh soft-capping of the router's logits,
        `logits = c * tanh(logits / c)` with `c = router_softcap`, before the scores
        and the selection (Laguna's `moe_router_logit_softcapping`); 0 = none.
    """

    d_model: int = eqx.field(static=True, converter=_integer)
    d_ff: int = eqx.field(static=True, converter=_integer)
    num_experts: int = eqx.field(static=True, converter=_integer)
    top_k: int = eqx.field(static=True, converter=_integer)
    # Plain `str`/`float` annotations so that bad values reach `__check_init__` and raise
    # a ValueError naming the field, rather than a type-check error.
    score_func: str = eqx.field(static=True, default="softmax")
    norm_topk: bool = eqx.field(static=True, default=True, converter=_boolean)
    norm_topk_min: float | int = eqx.field(static=True, default=0.0, converter=_real)
    num_groups: int = eqx.field(static=True, default=1, converter=_integer)
    top_groups: int = eqx.field(static=True, default=1, converter=_integer)
    use_router_bias: bool = eqx.field(static=True, default=False, converter=_boolean)
    routed_scaling_factor: float | int = eqx.field(
        static=True, default=1.0, converter=_real
    )
    shared_d_ff: int = eqx.field(static=True, default=0, converter=_integer)
    shared_gate: bool = eqx.field(static=True, default=False, converter=_boolean)
    buffer_factor: float | int | None = eqx.field(
        static=True, default=2.0, converter=_real
    )
    on_overflow: str = eqx.field(static=True, default="fallback")
    num_slots: int = eqx.field(static=True, default=0, converter=_integer)
    slot_backward: str = eqx.field(static=True, default="auto")
    max_slot_exports: int | None = eqx.field(
        static=True, default=None, converter=_integer
    )
    dedup: bool = eqx.field(static=True, default=True, converter=_boolean)
    gmm_backend: str | AbstractGMMBackend = eqx.field(static=True, default="auto")
    exchange: str | AbstractExchange = eqx.field(static=True, default="auto")
    axis_name: str = eqx.field(static=True, default="expert")
    fsdp_axes: tuple[str, ...] = eqx.field(
        static=True, default=(), converter=_axis_names
    )
    group_score: str = eqx.field(static=True, default="top2")
    shared_scale: float | int = eqx.field(static=True, default=1.0, converter=_real)
    activation: str = eqx.field(static=True, default="swiglu")
    activation_limit: float | int | None = eqx.field(
        static=True, default=None, converter=_real
    )
    activation_alpha: float | int = eqx.field(
        static=True, default=1.702, converter=_real
    )
    weight_on_input: bool = eqx.field(static=True, default=False, converter=_boolean)
    limit_shared: bool = eqx.field(static=True, default=True, converter=_boolean)
    activation_limit_after: bool = eqx.field(
        static=True, default=False, converter=_boolean
    )
    shared_activation_limit: float | int | None = eqx.field(
        static=True, default=None, converter=_real
    )
    activation_softcap: tuple[float, ...] | None = eqx.field(
        static=True, default=None, converter=_pair
    )
    expert_bias: bool = eqx.field(static=True, default=False, converter=_boolean)
    router_logit_bias: bool = eqx.field(static=True, default=False, converter=_boolean)
    output_bias: bool = eqx.field(static=True, default=False, converter=_boolean)
    num_identity_experts: int = eqx.field(static=True, default=0, converter=_integer)
    output_norm_eps: float | int | None = eqx.field(
        static=True, default=None, converter=_real
    )
    group_fill: float | int = eqx.field(static=True, default=-math.inf, converter=_real)
    bias_on_logits: bool = eqx.field(static=True, default=False, converter=_boolean)
    router_softcap: float | int = eqx.field(static=True, default=0.0, converter=_real)
    shared_in_norm: int = eqx.field(static=True, default=0, converter=_integer)

    def __check_init__(self):
        for name in ("d_model", "d_ff", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        for name in (
            "norm_topk",
            "use_router_bias",
            "dedup",
            "shared_gate",
            "weight_on_input",
            "limit_shared",
            "activation_limit_after",
            "expert_bias",
            "router_logit_bias",
            "output_bias",
            "bias_on_logits",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}.")
        if self.bias_on_logits and not self.use_router_bias:
            raise ValueError(
                "`bias_on_logits=True` needs `use_router_bias=True` (without a bias, "
                "the top-k of the logits is the top-k of the scores)."
            )
        if self.bias_on_logits and self.num_groups > 1:
            raise ValueError(
                "`bias_on_logits=True` with group-limited routing is not supported."
            )
        identity = self.num_identity_experts
        identity = identity if isinstance(identity, int) and identity > 0 else 0
        if self.top_k > self.num_experts + identity:
            raise ValueError(
                f"`top_k` ({self.top_k}) must not exceed `num_experts` "
                f"({self.num_experts})"
                + (f" plus `num_identity_experts` ({identity})." if identity else ".")
            )
        eps = self.output_norm_eps
        if eps is not None and not (
            isinstance(eps, int | float)
            and not isinstance(eps, bool)
            and math.isfinite(eps)
            and eps > 0
        ):
            raise ValueError(
                f"`output_norm_eps` must be a positive finite number or None, got "
                f"{eps!r}."
            )
        if not (
            isinstance(self.group_fill, int | float)
            and not isinstance(self.group_fill, bool)
            and (math.isfinite(self.group_fill) or self.group_fill == -math.inf)
        ):
            raise ValueError(
                f"`group_fill` must be a finite number or -inf, got "
                f"{self.group_fill!r}."
            )
        if not (
            isinstance(self.shared_scale, int | float)
            and not isinstance(self.shared_scale, bool)
            and math.isfinite(self.shared_scale)
        ):
            raise ValueError(
                f"`shared_scale` must be a finite number, got {self.shared_scale!r}."
            )
        if self.group_score not in ("top2", "max"):
            raise ValueError(
                f"`group_score` must be 'top2' or 'max', got {self.group_score!r}."
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"`score_func` must be one of {SCORE_FUNCS}, got {self.score_func!r}."
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {ACTIVATIONS}, got {self.activation!r}."
            )
        for name in ("activation_limit", "activation_alpha", "shared_activation_limit"):
            value = getattr(self, name)
            if value is None and name != "activation_alpha":
                continue
            if not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value > 0
            ):
                raise ValueError(
                    f"`{name}` must be a positive finite number, got {value!r}."
                )
        for name in (
            "num_identity_experts",
            "shared_d_ff",
            "num_slots",
            "shared_in_norm",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
        if self.num_identity_experts and (self.num_groups > 1 or self.weight_on_input):
            raise ValueError(
                "`num_identity_experts` with group-limited routing or "
                "`weight_on_input` is not supported."
            )
        if self.weight_on_input and self.expert_bias:
            raise ValueError(
                "`weight_on_input=True` with `expert_bias=True` is not supported (an "
                "expert's bias would act on every token, routed or not)."
            )
        try:
            _ = (self.expert_activation, self.shared_activation)
        except ValueError as e:
            raise ValueError(f"`activation`: {e}") from None
        if (
            not isinstance(self.num_groups, int)
            or isinstance(self.num_groups, bool)
            or self.num_groups < 1
        ):
            raise ValueError(f"`num_groups` must be >= 1, got {self.num_groups!r}.")
        if self.num_experts % self.num_groups != 0:
            raise ValueError(
                f"`num_experts` ({self.num_experts}) must be divisible by `num_groups` "
                f"({self.num_groups})."
            )
        if (
            not isinstance(self.top_groups, int)
            or isinstance(self.top_groups, bool)
            or not (1 <= self.top_groups <= self.num_groups)
        ):
            raise ValueError(
                f"`top_groups` must be in [1, num_groups={self.num_groups}], got "
                f"{self.top_groups!r}."
            )
        if self.num_groups > 1:
            per_group = self.num_experts // self.num_groups
            if self.top_groups * per_group < self.top_k:
                raise ValueError(
                    f"`top_groups` ({self.top_groups}) groups of {per_group} experts "
                    f"hold fewer than `top_k` ({self.top_k}) experts."
                )
        if self.buffer_factor is not None and not (
            isinstance(self.buffer_factor, int | float)
            and not isinstance(self.buffer_factor, bool)
            and math.isfinite(self.buffer_factor)
            and self.buffer_factor > 0
        ):
            raise ValueError(
                f"`buffer_factor` must be a positive finite number or None, got "
                f"{self.buffer_factor!r}."
            )
        if not (
            isinstance(self.routed_scaling_factor, int | float)
            and not isinstance(self.routed_scaling_factor, bool)
            and math.isfinite(self.routed_scaling_factor)
            and self.routed_scaling_factor > 0
        ):
            raise ValueError(
                f"`routed_scaling_factor` must be a positive finite number, got "
                f"{self.routed_scaling_factor!r}."
            )
        if not (
            isinstance(self.norm_topk_min, int | float)
            and not isinstance(self.norm_topk_min, bool)
            and math.isfinite(self.norm_topk_min)
            and self.norm_topk_min >= 0
        ):
            raise ValueError(
                f"`norm_topk_min` must be a finite number >= 0, got "
                f"{self.norm_topk_min!r}."
            )
        if not (
            isinstance(self.router_softcap, int | float)
            and not isinstance(self.router_softcap, bool)
            and math.isfinite(self.router_softcap)
            and self.router_softcap >= 0
        ):
            raise ValueError(
                f"`router_softcap` must be a finite number >= 0, got "
                f"{self.router_softcap!r}."
            )
        if self.norm_topk_min > 0 and not self.norm_topk:
            raise ValueError(
                "`norm_topk_min` > 0 floors the renormalisation's divisor: it needs "
                "`norm_topk=True`."
            )
        if self.shared_gate and self.shared_d_ff == 0:
            raise ValueError(
                "`shared_gate=True` needs a shared expert (`shared_d_ff > 0`)."
            )
        if self.shared_in_norm:
            s = self.shared_in_norm
            if self.shared_d_ff == 0 or self.shared_d_ff % s or self.shared_gate:
                raise ValueError(
                    f"`shared_in_norm={s}` needs `shared_d_ff` a positive multiple of "
                    f"it and no `shared_gate`, got `shared_d_ff={self.shared_d_ff}`, "
                    f"`shared_gate={self.shared_gate}`."
                )
            if self.score_func == "softmax":
                raise ValueError(
                    f"`shared_in_norm={s}` needs per-expert scores "
                    "(`score_func='sigmoid'` or `'sqrtsoftplus'`), got 'softmax'."
                )
        if self.on_overflow not in ("fallback", "drop"):
            raise ValueError(
                f"`on_overflow` must be 'fallback' or 'drop', got {self.on_overflow!r}."
            )
        if self.slot_backward not in SLOT_BACKWARDS:
            raise ValueError(
                f"`slot_backward` must be one of {SLOT_BACKWARDS}, got "
                f"{self.slot_backward!r}."
            )
        if self.max_slot_exports is not None and (
            not isinstance(self.max_slot_exports, int)
            or isinstance(self.max_slot_exports, bool)
            or self.max_slot_exports < 1
        ):
            raise ValueError(
                f"`max_slot_exports` must be a positive integer or None, got "
                f"{self.max_slot_exports!r}."
            )
        if (
            not isinstance(self.gmm_backend, AbstractGMMBackend)
            and self.gmm_backend not in GMM_BACKENDS
        ):
            raise ValueError(
                f"`gmm_backend` must be one of {GMM_BACKENDS}, got {self.gmm_backend!r}."
            )
        if (
            not isinstance(self.exchange, AbstractExchange)
            and self.exchange not in EXCHANGES
        ):
            raise ValueError(
                f"`exchange` must be one of {EXCHANGES}, got {self.exchange!r}."
            )
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise ValueError(
                f"`axis_name` must be a non-empty string, got {self.axis_name!r}."
            )
        axes = self.fsdp_axes
        if (
            not isinstance(axes, tuple)
            or not all(isinstance(a, str) and a for a in axes)
            or len(set(axes)) != len(axes)
        ):
            raise ValueError(
                "`fsdp_axes` must be distinct non-empty axis names, got "
                f"{self.fsdp_axes!r}."
            )
        if self.axis_name in self.fsdp_axes:
            raise ValueError(
                f"`fsdp_axes` {self.fsdp_axes} must not contain the expert axis "
                f"{self.axis_name!r}: the experts are already split over it."
            )

    @property
    def expert_activation(self) -> Activation:
        """The [`moe_eqx.Activation`][] of `activation`, `activation_limit` and
        `activation_alpha`."""
        return Activation(
            self.activation,
            self.activation_limit,
            self.activation_alpha,
            softcap=self.activation_softcap,
            limit_after=self.activation_limit_after,
        )

    @property
    def shared_activation(self) -> Activation:
        """The shared expert's [`moe_eqx.Activation`][]: the routed experts', without
        the clamp when `limit_shared` is False, with `shared_activation_limit` when
        set."""
        limit = self.activation_limit if self.limit_shared else None
        if self.shared_activation_limit is not None:
            limit = self.shared_activation_limit
        return Activation(
            self.activation,
            limit,
            self.activation_alpha,
            softcap=self.activation_softcap,
            limit_after=self.activation_limit_after,
        )

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups
