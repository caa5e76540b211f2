"""Expert stage: gated (SwiGLU, ...) or ungated experts, applied as grouped matmuls."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._activation import (
    SWIGLU,
    AbstractActivation,
    WithBiasColumn,
    apply_activation,
    as_activation,
    first_width,
)
from ._checks import check_array, check_finite, check_group_sizes, check_int
from ._gmm import AbstractGMMBackend, GradAcc, resolve_backend
from ._quant import QuantizedArray, QuantizedWeight, QuantizedWithBias, as_float
from ._rules import DISPATCHED, EXPERT_OUT, remat_name
from ._settings import boolean, integer, real
from ._tensor import TensorSplit, local_units, pooled


def _check_float(dtype) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"Expert weights must have a floating-point `dtype`, got {jnp.dtype(dtype)}."
        )


def _check_width(owner: str, activation, w_gate_up, w_down) -> None:
    """The first product's width fits the activation (`2 d_ff` gated, `d_ff` not),
    else a `ValueError` naming the stage: e.g. an ungated activation swapped onto
    gated weights."""
    shape_up = getattr(w_gate_up, "shape", None)
    shape_down = getattr(w_down, "shape", None)
    if shape_up is None or shape_down is None or len(shape_down) < 2:
        return  # a tree of other leaves (specs, tangents)
    d_ff = shape_down[-2]
    want = first_width(activation, d_ff)
    if shape_up[-1] != want:
        raise ValueError(
            f"`{owner}.w_gate_up` has {shape_up[-1]} columns; its activation "
            f"{type(activation).__name__} ({'gated' if activation.gated else 'ungated'}) "
            f"with `d_ff` {d_ff} (`w_down`'s rows) needs {want}. A gated and an "
            "ungated activation need different weights: build new ones."
        )


def weight_sizes(w_gate_up, w_down, *, routed: bool) -> tuple[int, ...] | None:
    """The sizes the weights have: `(E, d_model, d_ff)` of routed experts' (`routed`),
    `(d_model, shared_d_ff)` of shared experts'; `None` for leaves without shapes."""
    up, down = getattr(w_gate_up, "shape", None), getattr(w_down, "shape", None)
    lead = 1 if routed else 0
    if up is None or down is None or len(up) < 2 + lead or len(down) < 2:
        return None
    return (*(int(n) for n in up[len(up) - 2 - lead : -1]), int(down[-2]))


class ExpertOptions(eqx.Module):
    """How a model's routed experts differ from `act(x @ W1_e) @ Wd_e` weighted by
    the routing weight (`MoEConfig.expert_options`).

    **Fields:**

    - `bias`: per-expert biases on both projections, `act(x @ W1_e + b1_e) @ Wd_e +
        bd_e`, the whole output weighted (GPT-OSS): [`moe_eqx.Experts`][]'s
        `b_gate_up` and `b_down`.
    - `weight_on_input`: the routing weight scales the expert's input instead of its
        output: `sum_e expert_e(w_e x)` (Llama-4).
    """

    bias: bool = eqx.field(static=True, default=False, converter=boolean)
    weight_on_input: bool = eqx.field(static=True, default=False, converter=boolean)

    def __check_init__(self):
        for name in ("bias", "weight_on_input"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"`ExpertOptions.{name}` must be True or False, got "
                    f"{getattr(self, name)!r}."
                )
        if self.bias and self.weight_on_input:
            raise ValueError(
                "`ExpertOptions(weight_on_input=True, bias=True)` is not supported (an "
                "expert's bias would act on every token, routed or not)."
            )


class Experts(eqx.Module):
    """`E` experts: `expert_e(x) = act(x @ W1_e) @ Wd_e`; with SwiGLU (the default)
    `(silu(x @ Wg_e) * (x @ Wu_e)) @ Wd_e`.

    **Fields:**

    - `w_gate_up`: `[E, d_model, 2 * d_ff]`, gate = first half, up = second half
        (`[E, d_model, d_ff]`, the up projection, for an ungated activation).
    - `w_down`: `[E, d_ff, d_model]`.
    - `b_gate_up`, `b_down`: `[E, 2 * d_ff]` (`[E, d_ff]` ungated) and
        `[E, d_model]` per-expert biases of the two projections
        (`ExpertOptions.bias`, GPT-OSS: `act(x @ W1_e + b1_e) @ Wd_e + bd_e`, the
        whole output weighted), else `None`.
    - `activation`: the [`moe_eqx.AbstractActivation`][] (`MoEConfig.activation`).
    - `weight_on_input`: the routing weight scales the expert's input
        (`ExpertOptions.weight_on_input`, Llama-4).
    - `sizes`: `(E, d_model, d_ff)` of the whole weights, read from them when the
        stage is built (static: the same inside `shard_map`, where a device holds
        part of them, and in trees of other leaves); checked against them when the
        layer is called.
    """

    w_gate_up: Float[Array, "experts d_model two_d_ff"] | QuantizedArray
    w_down: Float[Array, "experts d_ff d_model"] | QuantizedArray
    b_gate_up: Float[Array, "experts two_d_ff"] | None
    b_down: Float[Array, "experts d_model"] | None
    activation: AbstractActivation = eqx.field(static=True)
    weight_on_input: bool = eqx.field(static=True)
    # `(E, d_model, d_ff)` of the whole weights, read from them when built: kept
    # inside `shard_map` (where each device holds a part) and in trees of the
    # layer's structure whose leaves are not arrays (optimizer states, specs).
    sizes: tuple[int, int, int] | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        w_gate_up,
        w_down=None,
        b_gate_up=None,
        b_down=None,
        *,
        activation: "AbstractActivation | str" = "swiglu",
        weight_on_input: bool = False,
        sizes: tuple[int, int, int] | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray | None = None,
    ):
        """Either from its own fields, `Experts(w_gate_up, w_down, b_gate_up,
        b_down, activation=..., weight_on_input=...)` (each as listed above;
        `dataclasses.replace` of the experts works so), or from a config,
        `Experts(config, dtype=..., key=key)`, as the layer builds them: the
        config's settings, the weights initialised from `key` (normal, scaled by
        `1 / sqrt(fan_in)`) and zero biases where it asks for them.

        **Arguments:**

        - `w_gate_up`: the weight (a float array or a `QuantizedArray`), or a
            [`moe_eqx.MoEConfig`][].
        - `w_down`, `b_gate_up`, `b_down`, `activation` (an
            [`moe_eqx.AbstractActivation`][] or its name), `weight_on_input`: as the
            fields (`w_down` required with a weight).
        - `sizes`: `(E, d_model, d_ff)`; read from the weights whenever they have
            shapes (`dataclasses.replace` passes the old ones).
        - `dtype`, `key`: with a config only: the weights' floating-point dtype and
            the key of their initialisation.
        """
        if not hasattr(w_gate_up, "shape"):  # a config
            config = w_gate_up
            if key is None:
                raise ValueError("`Experts(config, key=...)` needs a `key`.")
            _check_float(dtype)
            gu_key, down_key = jr.split(key)
            e, h, f = config.num_experts, config.d_model, config.d_ff
            activation = as_activation(config.activation)
            weight_on_input = config.expert_options.weight_on_input
            width = first_width(activation, f)
            w_gate_up = (jr.normal(gu_key, (e, h, width), jnp.float32) / h**0.5).astype(
                dtype
            )
            w_down = (jr.normal(down_key, (e, f, h), jnp.float32) / f**0.5).astype(
                dtype
            )
            if config.expert_options.bias:
                b_gate_up = jnp.zeros((e, width), dtype)
                b_down = jnp.zeros((e, h), dtype)
        elif key is not None:
            raise ValueError("`key` is for `Experts(config, key=...)` only.")
        elif w_down is None:
            raise TypeError("`Experts(w_gate_up, w_down, ...)` needs `w_down`.")
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self.b_gate_up, self.b_down = b_gate_up, b_down
        self.activation = as_activation(activation)
        self.weight_on_input = boolean(weight_on_input)
        read = weight_sizes(w_gate_up, w_down, routed=True)
        self.sizes = sizes if read is None else read

    def __check_init__(self):
        if not isinstance(self.weight_on_input, bool):
            raise ValueError(
                f"`Experts.weight_on_input` must be True or False, got "
                f"{self.weight_on_input!r}."
            )
        if self.weight_on_input and self.b_gate_up is not None:
            raise ValueError(
                "`Experts` with `weight_on_input=True` and biases is not supported (an "
                "expert's bias would act on every token, routed or not)."
            )
        _check_width("Experts", self.activation, self.w_gate_up, self.w_down)

    @property
    def num_experts(self) -> int:
        """`E`, of the whole weights (see `sizes`)."""
        return self.w_gate_up.shape[-3] if self.sizes is None else self.sizes[0]

    def with_biases_folded(
        self, x: Float[Array, "rows d_model"]
    ) -> tuple[
        Array, Array | QuantizedWeight, Array | QuantizedWeight, AbstractActivation
    ]:
        """`(x, w_gate_up, w_down, activation)` for [`moe_eqx.internal.expert_ffn`][],
        with the biases (if any) folded into the weights: `x` gets a column of ones,
        `w_gate_up` the row `b_gate_up` and a column that carries that one through the
        activation, `w_down` the row `b_down` (`fold_biases`). Without biases, the
        arrays as they are."""
        return expert_arrays(self, x)

    def __call__(
        self,
        x: Float[Array, "rows d_model"],
        group_sizes: Int[Array, " experts"],
        *,
        backend: str | AbstractGMMBackend = "auto",
    ) -> Float[Array, "rows d_model"]:
        """Applies expert `g` to the `g`-th consecutive group of rows of `x`.

        **Arguments:**

        - `x`: `[M, d_model]` rows sorted by expert.
        - `group_sizes`: `[E]` rows per expert, `sum <= M`.
        - `backend`: the [`moe_eqx.gmm`][] backend.

        **Returns:**

        `[M, d_model]`; rows beyond `sum(group_sizes)` are zero.
        """
        d_model, num_experts = self.w_gate_up.shape[1], self.w_gate_up.shape[0]
        check_array("x", x, shape=(None, d_model), kind="float", where="Experts")
        check_group_sizes(
            "group_sizes", group_sizes, num_experts, x.shape[0], "Experts"
        )
        x_in, w_gate_up, w_down, activation = self.with_biases_folded(x)
        return expert_ffn(
            x_in, w_gate_up, w_down, group_sizes, backend=backend, activation=activation
        )


def expert_ffn(
    x: Float[Array, "rows d_in"],
    w_gate_up: Float[Array, "groups d_in two_d_ff"] | QuantizedWeight,
    w_down: Float[Array, "groups d_ff d_model"] | QuantizedWeight,
    group_sizes: Int[Array, " groups"],
    *,
    backend: str | AbstractGMMBackend = "auto",
    grad_acc: GradAcc | None = None,
    activation: AbstractActivation = SWIGLU,
) -> Float[Array, "rows d_model"] | tuple[Float[Array, "rows d_model"], GradAcc]:
    """`act(x @ W1) @ Wd` over consecutive groups of rows: two grouped matmuls (one
    loop of windows with the tiled backend).

    **Arguments:**

    - `x`: `[M, d_model]` rows sorted by group.
    - `w_gate_up`: `[G, d_model, 2 * d_ff]` (`[G, d_model, d_ff]` ungated).
    - `w_down`: `[G, d_ff, d_model]`.
    - `group_sizes`: `[G]` int32.
    - `backend`: the [`moe_eqx.gmm`][] backend.
    - `grad_acc`: optional float accumulators `(acc_gate_up, acc_down)` shaped like
        the weights, passed through: under `jax.vjp` the cotangent of the input
        accumulators is that of the output ones plus the weights' gradient (their
        derivative is the weights', see `moe_eqx.AbstractGMMBackend.ffn`).
    - `activation`: the [`moe_eqx.AbstractActivation`][] (SwiGLU by default).

    **Returns:**

    `[M, d_model]` in `x.dtype`; rows beyond `sum(group_sizes)` are zero. With
    `grad_acc`, `(out, grad_acc)`.
    """
    where = "expert_ffn"
    check_array("x", x, shape=(None, w_gate_up.shape[-2]), kind="float", where=where)
    check_group_sizes("group_sizes", group_sizes, w_gate_up.shape[0], x.shape[0], where)
    with jax.named_scope("moe_eqx.experts"):
        want = first_width(activation, w_down.shape[-2])
        if w_gate_up.shape[-1] != want:
            raise ValueError(
                f"`w_gate_up` has {w_gate_up.shape[-1]} columns, but the "
                f"{activation!r} activation with d_ff={w_down.shape[-2]} needs "
                f"{want}."
            )
        impl = resolve_backend(backend)
        sizes = group_sizes.astype(jnp.int32)
        if grad_acc is not None:
            # The accumulators are the folded weights' gradients: the floats.
            w_gate_up, w_down = (
                as_float(w, w.dtype) if isinstance(w, QuantizedWithBias) else w
                for w in (w_gate_up, w_down)
            )
        x = remat_name(x, DISPATCHED)
        if activation == SWIGLU:  # any backend, including one written before
            out = impl.ffn(x, w_gate_up, w_down, sizes, grad_acc)
        else:
            out = impl.ffn(x, w_gate_up, w_down, sizes, grad_acc, activation=activation)
        if grad_acc is None:
            return remat_name(out, EXPERT_OUT)
        return remat_name(out[0], EXPERT_OUT), out[1]


def expert_arrays(experts: Experts, x):
    """`(x, w_gate_up, w_down, activation)` of `experts` for `expert_ffn`, their biases
    (if any) folded in (`fold_biases`)."""
    if experts.b_gate_up is None:
        return x, experts.w_gate_up, experts.w_down, experts.activation
    return fold_biases(
        x,
        experts.w_gate_up,
        experts.w_down,
        experts.b_gate_up,
        experts.b_down,
        experts.activation,
    )


def fold_biases(x, w_gate_up, w_down, b_gate_up, b_down, activation):
    """Per-expert biases as one more weight row: `[x, 1] @ [[W1, 0], [b1, 1]]` gives
    `[x @ W1 + b1, 1]`, the activation passes the 1 through (`WithBiasColumn`), and
    `[act, 1] @ [Wd; bd]` adds `bd`. Returns `(x, w_gate_up, w_down, activation)` for
    `expert_ffn`. A quantized weight keeps its bias beside it
    (`QuantizedWithBias`), folded where an expert is loaded: no float copy of every
    expert is made here."""
    ones = jnp.ones((*x.shape[:-1], 1), x.dtype)
    return (
        jnp.concatenate([x, ones], axis=-1),
        _with_bias(w_gate_up, b_gate_up, one_column=True),
        _with_bias(w_down, b_down, one_column=False),
        WithBiasColumn(activation),
    )


def _with_bias(w, bias, *, one_column: bool):
    """`w` with `bias` as one more row (and the column carrying the 1)."""
    if isinstance(w, QuantizedArray):
        return QuantizedWithBias(w, bias, one_column)
    folded = jnp.concatenate([w, bias[:, None, :].astype(w.dtype)], axis=1)
    if not one_column:
        return folded
    column = jnp.zeros((*folded.shape[:-1], 1), w.dtype).at[:, -1].set(1)
    return jnp.concatenate([folded, column], axis=2)


class SharedCombination(eqx.Module):
    """How the shared experts' output joins the routed one
    (`MoEConfig.shared`): `y = routed_scaling_factor * routed + scale * g(x) *
    shared(x)`, with `g` the optional gate (`MoEConfig.shared_gate`).

    **Fields:**

    - `scale`: multiplies the shared experts' output (Cohere2-MoE's "average"
        combination: `routed_scaling_factor=0.5` and `scale=0.5`).
    - `activation`: the shared experts' own activation (a name or an
        [`moe_eqx.AbstractActivation`][]); `None` (default): the routed experts'
        (`MoEConfig.activation`). DeepSeek-V4 clamps both, HY-V4 only the routed
        ones, Step-3.7 each at its own limit.
    - `scored`: `S > 0` shared experts of width `shared_d_ff / S` each that the
        router scores too (Inkling): the router's weight has `S` more columns, and
        shared expert `s` is weighted per token by its score normalised together
        with the chosen routed experts' (`norm_topk`: one denominator), times
        `scale`. Needs per-expert scores (not softmax), `shared_d_ff` a multiple of
        `S` and no `shared_gate`.
    """

    scale: float = eqx.field(static=True, default=1.0, converter=real)
    activation: AbstractActivation | str | None = eqx.field(static=True, default=None)
    scored: int = eqx.field(static=True, default=0, converter=integer)

    def __check_init__(self):
        check_finite(self.scale, "scale", "SharedCombination")
        if self.activation is not None:
            as_activation(self.activation, "SharedCombination.activation")
        check_int(self.scored, "SharedCombination.scored", minimum=0)


class SharedExperts(eqx.Module):
    """The shared expert(s) every token goes through (DeepSeek-V3, Qwen2-MoE): one expert
    of width `shared_d_ff` (several shared experts are one wider one), optionally
    scaled per token by `sigmoid(x @ gate)`, or, given the router's weights of `S`
    equal blocks of `shared_d_ff / S` hidden units scaled per token by that shared
    expert's routing weight.

    **Fields:**

    - `w_gate_up`: `[d_model, 2 * shared_d_ff]`, gate = first half, up = second half
        (`[d_model, shared_d_ff]` for an ungated activation).
    - `w_down`: `[shared_d_ff, d_model]`.
    - `gate`: `[d_model]` with `MoEConfig.shared_gate`, else `None`.
    - `activation`: its [`moe_eqx.AbstractActivation`][]
        (`SharedCombination.activation`, else the routed experts').
    - `scale`: multiplies its output in the layer (`SharedCombination.scale`).
    - `sizes`: `(d_model, shared_d_ff)` of the whole weights (as `Experts.sizes`).
    """

    w_gate_up: Float[Array, "d_model two_d_ff"]
    w_down: Float[Array, "d_ff d_model"]
    gate: Float[Array, " d_model"] | None
    activation: AbstractActivation = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    # `(d_model, shared_d_ff)` of the whole weights (as `Experts.sizes`).
    sizes: tuple[int, int] | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        w_gate_up,
        w_down=None,
        gate=None,
        *,
        activation: "AbstractActivation | str" = "swiglu",
        scale: float = 1.0,
        sizes: tuple[int, int] | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray | None = None,
    ):
        """Either from its own fields, `SharedExperts(w_gate_up, w_down, gate,
        activation=..., scale=...)` (each as listed above;
        `dataclasses.replace` works so), or from a config, `SharedExperts(config,
        dtype=..., key=key)`, as the layer builds them (`shared_d_ff > 0`; the
        weights and the gate initialised from `key`, normal, scaled by
        `1 / sqrt(fan_in)`).

        **Arguments:**

        - `w_gate_up`: the weight, or a [`moe_eqx.MoEConfig`][].
        - `w_down`, `gate`, `activation` (an [`moe_eqx.AbstractActivation`][] or its
            name), `scale`: as the fields (`w_down` required with a
            weight).
        - `sizes`: `(d_model, shared_d_ff)`; read from the weights whenever they
            have shapes.
        - `dtype`, `key`: with a config only.
        """
        if not hasattr(w_gate_up, "shape"):  # a config
            config = w_gate_up
            if config.shared_d_ff < 1:
                raise ValueError("`SharedExperts` needs `config.shared_d_ff > 0`.")
            if key is None:
                raise ValueError("`SharedExperts(config, key=...)` needs a `key`.")
            _check_float(dtype)
            gu_key, down_key, gate_key = jr.split(key, 3)
            h, f = config.d_model, config.shared_d_ff
            combination = config.shared
            own = combination.activation
            activation = as_activation(
                config.activation if own is None else own,
                "SharedCombination.activation",
            )
            scale = combination.scale
            width = first_width(activation, f)
            w_gate_up = (jr.normal(gu_key, (h, width), jnp.float32) / h**0.5).astype(
                dtype
            )
            w_down = (jr.normal(down_key, (f, h), jnp.float32) / f**0.5).astype(dtype)
            gate = (
                (jr.normal(gate_key, (h,), jnp.float32) / h**0.5).astype(dtype)
                if config.shared_gate
                else None
            )
        elif key is not None:
            raise ValueError("`key` is for `SharedExperts(config, key=...)` only.")
        elif w_down is None:
            raise TypeError("`SharedExperts(w_gate_up, w_down, ...)` needs `w_down`.")
        self.w_gate_up, self.w_down, self.gate = w_gate_up, w_down, gate
        self.activation = as_activation(activation, "SharedExperts.activation")
        self.scale = real(scale)
        read = weight_sizes(w_gate_up, w_down, routed=False)
        self.sizes = sizes if read is None else read

    def __check_init__(self):
        check_finite(self.scale, "scale", "SharedExperts")
        _check_width("SharedExperts", self.activation, self.w_gate_up, self.w_down)

    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        weights: Float[Array, "tokens shared"] | None = None,
    ) -> Float[Array, "tokens d_model"]:
        """`g(x) * act(x @ W1) @ Wd`, with `g = sigmoid(x @ gate)` or 1; with
        `weights`, `(act(x @ W1) * w) @ Wd` where `w` repeats shared expert `s`'s
        weight over its block of hidden units. (`scale` is the layer's to apply.)

        **Arguments:**

        - `x`: `[T, d_model]`.
        - `weights`: `[T, S]` per-token weights of `S` shared experts the router
            scores (`Routing.shared_weights`, `SharedCombination.scored = S`), each
            `shared_d_ff / S` hidden units wide; `None` for unscored ones.

        **Returns:**

        `[T, d_model]` in `x.dtype`.
        """
        where = "SharedExperts"
        check_array(
            "x", x, shape=(None, self.w_gate_up.shape[0]), kind="float", where=where
        )
        if weights is not None:
            shape = (x.shape[0], None)
            check_array("weights", weights, shape=shape, kind="float", where=where)
            units, num_shared = self.w_down.shape[0], weights.shape[1]
            if num_shared < 1 or units % num_shared:
                raise ValueError(
                    f"{where}: `weights` score {num_shared} shared experts, which "
                    f"must divide the {units} hidden units (`shared_d_ff`)."
                )
        return self.hidden_part(x, weights)

    def hidden_part(self, x, weights=None, *, activation=None, units=None):
        """`__call__` with some of the hidden units: those this device holds under
        expert tensor parallelism (`activation` the `TensorSplit` of its own, `units
        = (start, total)`: its `w_down` rows are units `[start, start + rows)` of
        `total`). Unchecked: `__call__` checks the arguments."""
        activation = self.activation if activation is None else activation
        with jax.named_scope("moe_eqx.shared_experts"):
            gate_up = jnp.dot(x, self.w_gate_up.astype(x.dtype))
            act = apply_activation(activation, gate_up)
            if weights is not None:
                rows = self.w_down.shape[0]
                start, total = (0, rows) if units is None else units
                block = total // weights.shape[1]
                w = jnp.repeat(weights.astype(jnp.float32), block, axis=1)
                act = act * jax.lax.dynamic_slice_in_dim(w, start, rows, axis=1)
            out = jnp.dot(act.astype(x.dtype), self.w_down.astype(x.dtype))
            if self.gate is not None:
                g = jax.nn.sigmoid(
                    jnp.dot(x.astype(jnp.float32), self.gate.astype(jnp.float32))
                )
                out = (out.astype(jnp.float32) * g[:, None]).astype(x.dtype)
            return out


def add_shared(cfg, routed, shared, x, shared_weights=None, tensor=1):
    """`routed_scaling_factor * routed + scale * shared(x)` (each shard on its own
    tokens; `shared_weights`: the routing's, for shared experts the router
    scores). With `tensor > 1` devices of `cfg.tensor_axis`, the shared experts'
    hidden units are split over them: the tokens of the axis are pooled."""
    if shared is None and cfg.routed_scaling_factor == 1:
        return routed
    y = routed.astype(jnp.float32) * jnp.float32(cfg.routed_scaling_factor)
    if shared is not None:
        if tensor > 1:
            s = _shared_on_tensor(cfg, shared, x, shared_weights, tensor)
        else:
            s = shared(x, shared_weights)
        s = s.astype(jnp.float32)
        y = y + (s if shared.scale == 1 else s * jnp.float32(shared.scale))
    return y.astype(routed.dtype)


def _shared_on_tensor(cfg, shared, x, weights, tensor: int):
    """The shared experts, their hidden units split over `cfg.tensor_axis`: every
    device computes the axis's tokens with its units, summed back per token."""
    axis = cfg.tensor_axis
    activation = TensorSplit(shared.activation, axis, tensor)
    start, _ = local_units(axis, tensor, cfg.shared_d_ff)

    def part(x, weights):
        return shared.hidden_part(
            x, weights, activation=activation, units=(start, cfg.shared_d_ff)
        )

    if weights is None:
        return pooled(lambda x: part(x, None), axis, x)
    return pooled(part, axis, x, weights)
