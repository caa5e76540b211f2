"""`MoEConfig`: the static description of an MoE layer, validated at construction, and
`Execution`, how the layer runs."""

import dataclasses
import difflib
import math

import equinox as eqx

from ._activation import AbstractActivation, as_activation
from ._checks import check_int
from ._combine import OutputTransform
from ._exchange import AbstractExchange, check_exchange
from ._experts import ExpertOptions, SharedCombination
from ._gmm import AbstractGMMBackend
from ._scoring import (
    AbstractScore,
    Selection,
    Weighting,
    as_score,
    check_routing_settings,
)
from ._settings import (
    axis_names as _axis_names,
    boolean as _boolean,
    integer as _integer,
    real as _real,
)
from ._slots import SLOT_BACKWARDS

GMM_BACKENDS = ("auto", "tiled", "ragged_dot", "dense", "mosaic_gpu")
EXCHANGES = ("auto", "dense", "ragged", "allgather")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_bool(owner: str, names, obj) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise ValueError(f"`{owner}{name}` must be True or False, got {value!r}.")


class Execution(eqx.Module):
    """How an MoE layer runs, as opposed to what it computes: buffers, overflow,
    duplication, deduplication, backends and mesh axes (`MoEConfig.execution`).
    [`moe_eqx.MoEConfig`][] takes each field as a keyword of its own too
    (`MoEConfig(..., buffer_factor=1.5)`) and reads it as an attribute
    (`config.buffer_factor`); no model's config sets one.

    **Fields:**

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
        step (the duplication plan's out-degree bound, which sizes the slot exchange);
        `None` = `default_max_exports(R, L, S)` of the planner.
    - `dedup`: send a token once per destination shard rather than once per pair.
    - `gmm_backend`: `"auto"`, `"tiled"`, `"ragged_dot"`, `"dense"` or `"mosaic_gpu"`,
        or a backend instance (e.g. a tuned `TiledGMM(tile_rows=...)` or
        `MosaicGPUGMM(...)`), as optimistix and lineax take solver objects.
    - `exchange`: exchange backend, `"auto"`, `"dense"`, `"ragged"` or `"allgather"`
        (tokens all-gathered, outputs reduce-scattered), or an
        [`moe_eqx.AbstractExchange`][] instance over the layer's `axis_name` (a
        `DenseExchange` gets the block size of the layer's buffers; other instances
        are used as given). `"auto"`
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
    - `tensor_axis`: a mesh axis over which every expert's hidden width `d_ff` is
        split, routed and shared experts alike (expert tensor parallelism): each
        device of it holds `d_ff / P` hidden units of every expert of its shard (the
        gate and up columns of `w_gate_up` and the rows of `w_down` that make them).
        The tokens are split over it like over a data axis; a tensor group's devices
        compute all of their received rows, each with its hidden units, and
        reduce-scatter the partial outputs (`moe_eqx._tensor`). `None` (default):
        no split; a mesh axis of that name, if any, is a data axis.
    - `token_chunks`: `C`, how many chunks each shard's tokens are cut into under
        expert parallelism, each a round trip of its own (its exchange, its
        duplication plan, its exact overflow predicate and fallback): chunk
        `c + 1`'s dispatch depends on nothing of chunk `c`'s expert compute, so the
        compiler can overlap one chunk's exchange with another's experts. Outputs
        and gradients are those of `C = 1` (stats too, but for `overflow` and
        `fallback_used`, which any chunk sets). 1 (default): one round trip.
    """

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
    tensor_axis: str | None = eqx.field(static=True, default=None)
    token_chunks: int = eqx.field(static=True, default=1, converter=_integer)

    def __check_init__(self):
        _check_bool("", ("dedup",), self)
        if self.buffer_factor is not None and not (
            _is_number(self.buffer_factor)
            and math.isfinite(self.buffer_factor)
            and self.buffer_factor > 0
        ):
            raise ValueError(
                f"`buffer_factor` must be a positive finite number or None, got "
                f"{self.buffer_factor!r}."
            )
        if self.on_overflow not in ("fallback", "drop"):
            raise ValueError(
                f"`on_overflow` must be 'fallback' or 'drop', got {self.on_overflow!r}."
            )
        check_int(self.num_slots, "num_slots", minimum=0)
        if self.slot_backward not in SLOT_BACKWARDS:
            raise ValueError(
                f"`slot_backward` must be one of {SLOT_BACKWARDS}, got "
                f"{self.slot_backward!r}."
            )
        check_int(self.max_slot_exports, "max_slot_exports", optional=True)
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
        if isinstance(self.exchange, AbstractExchange):
            check_exchange(self.exchange, self.axis_name)
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
        check_int(self.token_chunks, "token_chunks")
        tensor = self.tensor_axis
        if tensor is not None:
            if not isinstance(tensor, str) or not tensor:
                raise ValueError(
                    f"`tensor_axis` must be a non-empty axis name or None, got "
                    f"{tensor!r}."
                )
            if tensor == self.axis_name or tensor in self.fsdp_axes:
                raise ValueError(
                    f"`tensor_axis` {tensor!r} must differ from the expert axis "
                    f"{self.axis_name!r} and from `fsdp_axes` {self.fsdp_axes}."
                )


EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(Execution))
_UNSET = object()
# The sizes every MoE has: a default only so that a misspelt one is reported as such.
_REQUIRED = object()

# Fields of earlier releases and where each went: a model family's variant is a field
# of the stage object that computes it.
REMOVED_FIELDS = {
    "norm_topk_min": "`weighting=me.Weighting(floor=...)`",
    "group_score": "`selection=me.Selection(group_top=2)` ('top2') or `group_top=1` "
    "('max')",
    "group_fill": "`selection=me.Selection(group_fill=...)`",
    "bias_on_logits": "`selection=me.Selection(bias_on_logits=True)`",
    "router_softcap": "`score_func=me.Softmax(softcap=...)` (or `me.Sigmoid`, "
    "`me.SqrtSoftplus`)",
    "router_logit_bias": "`score_func=me.Softmax(logit_bias=True)` (or `me.Sigmoid`, "
    "`me.SqrtSoftplus`)",
    "activation_limit": "`activation=me.SwiGLU(limit=...)` (or "
    "`me.ClampedSwiGLU(limit=..., alpha=...)`)",
    "activation_alpha": "`activation=me.ClampedSwiGLU(limit=..., alpha=...)`",
    "activation_limit_after": "`activation=me.SwiGLU(limit=..., limit_after=True)`",
    "activation_softcap": "`activation=me.SoftcapSwiGLU(gate_cap=..., up_cap=...)`",
    "limit_shared": "`shared=me.SharedCombination(activation=...)`, the shared "
    "experts' own activation",
    "shared_activation_limit": "`shared=me.SharedCombination(activation=me.SwiGLU("
    "limit=...))`",
    "shared_scale": "`shared=me.SharedCombination(scale=...)`",
    "shared_in_norm": "`shared=me.SharedCombination(scored=...)`",
    "expert_bias": "`expert_options=me.ExpertOptions(bias=True)`",
    "weight_on_input": "`expert_options=me.ExpertOptions(weight_on_input=True)`",
    "output_bias": "`output=me.OutputTransform(bias=True)`",
    "output_norm_eps": "`output=me.OutputTransform(norm_eps=...)`",
}


class MoEConfig(eqx.Module):
    """Static configuration of an MoE layer: what every MoE has, the parts a model
    family varies (each an object that computes its part), and how the layer runs.

    **Arguments** (each also readable as an attribute):

    - `d_model`: model width `H`.
    - `d_ff`: hidden width `F` of each expert.
    - `num_experts`: number of routed experts `E`.
    - `top_k`: experts per token `k`.
    - `score_func`: how the router's logits become scores: `"softmax"`,
        `"sigmoid"` (DeepSeek-V3) or `"sqrtsoftplus"` (`sqrt(softplus(logit))`,
        DeepSeek-V4), or an [`moe_eqx.AbstractScore`][] (e.g.
        `me.Sigmoid(softcap=30.0)`, or with `logit_bias=True` a trained bias on the
        logits).
    - `norm_topk`: renormalise the chosen k scores to sum to 1; `False` uses the raw
        scores (softmax probabilities, or sigmoid scores as DeepSeek-V3 with
        `norm_topk_prob=False`).
    - `num_groups`, `top_groups`: group-limited routing (DeepSeek-V3): experts are split
        into `num_groups` contiguous groups and each token may only choose among the
        experts of its `top_groups` best groups (scored as `selection` says).
    - `use_router_bias`: add a selection-only bias (aux-loss-free balancing).
    - `routed_scaling_factor`: multiplies the routed experts' output, after the
        weights are normalised (DeepSeek-V3 uses 2.5).
    - `shared_d_ff`: hidden width of the shared expert that every token goes through
        (0 = none; DeepSeek-V3's is `n_shared_experts * moe_intermediate_size`).
    - `shared_gate`: scale the shared expert's output by a per-token sigmoid gate
        `sigmoid(x @ gate)` (Qwen2-MoE); needs `shared_d_ff > 0`.
    - `num_identity_experts`: zero-computation experts that return their input
        (LongCat-Flash): the router scores `E + num_identity_experts` columns, and a
        token's picks among the last ones add `w x`, computed on its own shard and
        never sent.
    - `activation`: the experts' activation, an [`moe_eqx.AbstractActivation`][]
        (`me.SwiGLU(limit=7.0)`, `me.ClampedSwiGLU(...)`, your own) or a name:
        gated `"swiglu"` (default), `"geglu"`, `"geglu_tanh"`, or ungated
        `"relu"`, `"relu2"`, `"gelu"`, `"gelu_tanh"`, `"silu"` (whose `w_gate_up` is
        `[E, d_model, d_ff]`, the up projection alone).
    - `buffer_factor`, `on_overflow`, `num_slots`, `slot_backward`, `dedup`,
        `gmm_backend`, `exchange`, `axis_name`, `fsdp_axes`, `max_slot_exports`,
        `tensor_axis`, `token_chunks`: how the layer runs, stored in `execution`: see [`moe_eqx.Execution`][].
    - `selection`: a [`moe_eqx.Selection`][]: how groups are scored and what the
        experts outside a token's groups score, and whether the selection bias is
        on the logits.
    - `weighting`: a [`moe_eqx.Weighting`][]: the renormalisation's floor.
    - `shared`: a [`moe_eqx.SharedCombination`][]: the shared experts' scale, own
        activation, and how many of them the router scores.
    - `output`: an [`moe_eqx.OutputTransform`][]: a bias and an RMSNorm of the
        layer's output.
    - `expert_options`: an [`moe_eqx.ExpertOptions`][]: biases on the experts'
        projections, routing weights on their inputs.
    - `execution`: an [`moe_eqx.Execution`][] holding the how-it-runs settings at
        once (the keywords above override its fields).

    A field of an earlier release (e.g. `activation_limit`) is a `TypeError` naming
    where it went.
    """

    d_model: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    score_func: str | AbstractScore = eqx.field(static=True)
    norm_topk: bool = eqx.field(static=True)
    num_groups: int = eqx.field(static=True)
    top_groups: int = eqx.field(static=True)
    use_router_bias: bool = eqx.field(static=True)
    routed_scaling_factor: float | int = eqx.field(static=True)
    shared_d_ff: int = eqx.field(static=True)
    shared_gate: bool = eqx.field(static=True)
    num_identity_experts: int = eqx.field(static=True)
    activation: str | AbstractActivation = eqx.field(static=True)
    selection: Selection = eqx.field(static=True)
    weighting: Weighting = eqx.field(static=True)
    shared: SharedCombination = eqx.field(static=True)
    output: OutputTransform = eqx.field(static=True)
    expert_options: ExpertOptions = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)

    def __init__(
        self,
        d_model=_REQUIRED,
        d_ff=_REQUIRED,
        num_experts=_REQUIRED,
        top_k=_REQUIRED,
        score_func="softmax",
        norm_topk=True,
        num_groups=1,
        top_groups=1,
        use_router_bias=False,
        routed_scaling_factor=1.0,
        shared_d_ff=0,
        shared_gate=False,
        num_identity_experts=0,
        activation="swiglu",
        buffer_factor=_UNSET,
        on_overflow=_UNSET,
        num_slots=_UNSET,
        slot_backward=_UNSET,
        dedup=_UNSET,
        gmm_backend=_UNSET,
        exchange=_UNSET,
        axis_name=_UNSET,
        fsdp_axes=_UNSET,
        *,
        max_slot_exports=_UNSET,
        tensor_axis=_UNSET,
        token_chunks=_UNSET,
        selection=None,
        weighting=None,
        shared=None,
        output=None,
        expert_options=None,
        execution=None,
        **unknown,
    ):
        # Unknown keywords first: a misspelt required field gets its "did you mean".
        if unknown:
            _unknown_keywords(unknown)
        required = dict(
            d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=top_k
        )
        missing = [f"`{name}`" for name, v in required.items() if v is _REQUIRED]
        if missing:
            raise TypeError(f"`MoEConfig` needs {', '.join(missing)}.")
        self.d_model = _integer(d_model)
        self.d_ff = _integer(d_ff)
        self.num_experts = _integer(num_experts)
        self.top_k = _integer(top_k)
        self.score_func = score_func
        self.norm_topk = _boolean(norm_topk)
        self.num_groups = _integer(num_groups)
        self.top_groups = _integer(top_groups)
        self.use_router_bias = _boolean(use_router_bias)
        self.routed_scaling_factor = _real(routed_scaling_factor)
        self.shared_d_ff = _integer(shared_d_ff)
        self.shared_gate = _boolean(shared_gate)
        self.num_identity_experts = _integer(num_identity_experts)
        self.activation = activation
        # `None`: the part that computes what every MoE does.
        self.selection = Selection() if selection is None else selection
        self.weighting = Weighting() if weighting is None else weighting
        self.shared = SharedCombination() if shared is None else shared
        self.output = OutputTransform() if output is None else output
        self.expert_options = (
            ExpertOptions() if expert_options is None else expert_options
        )
        given = dict(
            buffer_factor=buffer_factor,
            on_overflow=on_overflow,
            num_slots=num_slots,
            slot_backward=slot_backward,
            max_slot_exports=max_slot_exports,
            dedup=dedup,
            gmm_backend=gmm_backend,
            exchange=exchange,
            axis_name=axis_name,
            fsdp_axes=fsdp_axes,
            tensor_axis=tensor_axis,
            token_chunks=token_chunks,
        )
        given = {k: v for k, v in given.items() if v is not _UNSET}
        if execution is None:
            execution = Execution(**given)
        elif not isinstance(execution, Execution):
            raise ValueError(
                f"`execution` must be an `moe_eqx.Execution`, got {execution!r}."
            )
        elif given:
            execution = dataclasses.replace(execution, **given)
        self.execution = execution

    # How the layer runs, read from `execution` (one value per setting).
    @property
    def buffer_factor(self) -> float | int | None:
        return self.execution.buffer_factor

    @property
    def on_overflow(self) -> str:
        return self.execution.on_overflow

    @property
    def num_slots(self) -> int:
        return self.execution.num_slots

    @property
    def slot_backward(self) -> str:
        return self.execution.slot_backward

    @property
    def max_slot_exports(self) -> int | None:
        return self.execution.max_slot_exports

    @property
    def dedup(self) -> bool:
        return self.execution.dedup

    @property
    def gmm_backend(self) -> str | AbstractGMMBackend:
        return self.execution.gmm_backend

    @property
    def exchange(self) -> str | AbstractExchange:
        return self.execution.exchange

    @property
    def axis_name(self) -> str:
        return self.execution.axis_name

    @property
    def tensor_axis(self) -> str | None:
        return self.execution.tensor_axis

    @property
    def token_chunks(self) -> int:
        return self.execution.token_chunks

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        return self.execution.fsdp_axes

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups

    def __getattr__(self, name: str):
        # Only reached for names that are not attributes: a removed field names its
        # replacement.
        if name in REMOVED_FIELDS:
            raise AttributeError(
                f"`MoEConfig.{name}` was removed: it is now {REMOVED_FIELDS[name]}."
            )
        raise AttributeError(f"'MoEConfig' object has no attribute {name!r}")

    def __check_init__(self):
        for name in ("d_model", "d_ff", "num_experts", "top_k"):
            check_int(getattr(self, name), name)
        _check_bool("", ("norm_topk", "use_router_bias", "shared_gate"), self)
        for name in ("num_identity_experts", "shared_d_ff"):
            check_int(getattr(self, name), name, minimum=0)
        score = as_score(self.score_func)
        activation = as_activation(self.activation)
        for name, cls in (
            ("selection", Selection),
            ("weighting", Weighting),
            ("shared", SharedCombination),
            ("output", OutputTransform),
            ("expert_options", ExpertOptions),
        ):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"`{name}` must be an `moe_eqx.{cls.__name__}`, got "
                    f"{getattr(self, name)!r}."
                )
        identity = self.num_identity_experts
        check_routing_settings(
            num_experts=self.num_experts,
            num_identity=identity,
            top_k=self.top_k,
            num_groups=self.num_groups,
            top_groups=self.top_groups,
            has_bias=self.use_router_bias,
            norm_topk=self.norm_topk,
            selection=self.selection,
            weighting=self.weighting,
        )
        self._check_shared(score, activation)
        if identity and (self.num_groups > 1 or self.expert_options.weight_on_input):
            raise ValueError(
                "`num_identity_experts` with group-limited routing or "
                "`ExpertOptions.weight_on_input` is not supported."
            )
        if not (
            _is_number(self.routed_scaling_factor)
            and math.isfinite(self.routed_scaling_factor)
            and self.routed_scaling_factor > 0
        ):
            raise ValueError(
                f"`routed_scaling_factor` must be a positive finite number, got "
                f"{self.routed_scaling_factor!r}."
            )

    def _check_shared(self, score: AbstractScore, activation) -> None:
        if self.shared_gate and self.shared_d_ff == 0:
            raise ValueError(
                "`shared_gate=True` needs a shared expert (`shared_d_ff > 0`)."
            )
        s = self.shared.scored
        if s:
            if self.shared_d_ff == 0 or self.shared_d_ff % s or self.shared_gate:
                raise ValueError(
                    f"`SharedCombination(scored={s})` needs `shared_d_ff` a positive "
                    f"multiple of it and no `shared_gate`, got `shared_d_ff="
                    f"{self.shared_d_ff}`, `shared_gate={self.shared_gate}`."
                )
            if score.sums_to_one:
                raise ValueError(
                    f"`SharedCombination(scored={s})` needs per-expert scores "
                    f"(`score_func='sigmoid'` or `'sqrtsoftplus'`), got "
                    f"{self.score_func!r}."
                )


def _unknown_keywords(unknown) -> None:
    """A `TypeError` naming the first unknown keyword, with the closest field."""
    name = next(iter(unknown))
    if name in REMOVED_FIELDS:
        raise TypeError(
            f"`MoEConfig({name}=...)` was removed: use {REMOVED_FIELDS[name]}."
        )
    known = [f.name for f in dataclasses.fields(MoEConfig)] + list(EXECUTION_FIELDS)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean `{close[0]}`?" if close else "."
    raise TypeError(f"`MoEConfig` has no field `{name}`{hint}")
