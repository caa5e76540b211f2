"""The experts' activations: an abstract interface and the built-in ones.

An activation maps the first product of an expert, `h = x @ W1` (`[rows, 2 d_ff]` for a
gated activation, `[gate | up]`; `[rows, d_ff]` ungated), to the hidden units
`[rows, d_ff]` that the down projection takes. A model family's variant (a clamp, a
slope, a soft-cap) is a field of the activation object that computes it.

Every backend applies the activation between its two products as a plain JAX function
of `h` in float32, so a user's own subclass runs wherever a built-in does: one device,
expert parallel, the fallback, slots, quantized experts, forward mode and second
order. Its derivatives are JAX's own (`jvp` and `vjp` below); between two whole
products (`activate`) the backward keeps only `h` and recomputes the rest from it. A
backend may form that backward's cotangent of `h` its own way for the built-in gated
activations (`AbstractGMMBackend.hidden_vjp`: on a TPU one Pallas pass,
`moe_eqx._gmm.activation_tpu`), with the same arithmetic.
"""

import abc
import functools as ft
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._autodiff import custom_linear
from ._checks import check_positive
from ._settings import boolean, real


class AbstractActivation(eqx.Module):
    """The activation of an expert's first product.

    Subclass it with the class attribute `gated: ClassVar[bool]` and `__call__`; every
    field must be static (hashable: the activation is part of a compiled program's
    static configuration). For example:

    ```python
    class ScaledSiLU(me.AbstractActivation):
        scale: float = eqx.field(static=True, default=2.0)
        gated: ClassVar[bool] = False

        def __call__(self, h):
            return self.scale * jax.nn.silu(h)
    ```

    Its derivatives are JAX's own, so `__call__` must be differentiable by JAX to
    every order a user needs (second order for Hessian-vector products).
    """

    gated: eqx.AbstractClassVar[bool]
    # Whether it calls collectives (`moe_eqx.internal.TensorSplit`): backends then
    # apply it once between two whole products, never per window of rows.
    collective: ClassVar[bool] = False

    @abc.abstractmethod
    def __call__(self, h: Float[Array, "*rows width"]) -> Float[Array, "*rows d_ff"]:
        """The hidden units of the first product `h`.

        **Arguments:**

        - `h`: `[..., 2 d_ff]` (`[gate | up]`) when `gated`, else `[..., d_ff]`, in
            float32.

        **Returns:**

        `[..., d_ff]`, float32.
        """

    def jvp(self, h: Array, t_h: Array) -> tuple[Array, Array]:
        """`(self(h), its tangent along t_h)`, both float32."""
        f32 = jnp.float32
        return jax.jvp(
            lambda a: apply_activation(self, a), (h.astype(f32),), (t_h.astype(f32),)
        )

    def vjp(self, h: Array, d_act: Array) -> Array:
        """The cotangent of `h` for the cotangent `d_act` of `self(h)`, float32."""
        _, pullback = jax.vjp(
            lambda a: apply_activation(self, a), h.astype(jnp.float32)
        )
        return pullback(d_act.astype(jnp.float32))[0]


def _halves(h: Array) -> tuple[Array, Array]:
    # A split, whose transpose is one concatenation (two slices' would pad both
    # halves to full width and add them).
    gate, up = jnp.split(h, 2, axis=-1)
    return gate, up


def _clamp(gate: Array, up: Array, limit: float | None, *, gate_too: bool = True):
    """GPT-OSS's and DeepSeek-V4's clamps: `gate <= limit`, `|up| <= limit`."""
    if limit is None:
        return gate, up
    if gate_too:
        gate = jnp.minimum(gate, limit)
    return gate, jnp.clip(up, -limit, limit)


class SwiGLU(AbstractActivation):
    """`silu(gate) * up`, gated.

    **Fields:**

    - `limit`: with a limit, `gate` is clamped to at most `limit` and `up` to
        `[-limit, limit]` first (DeepSeek-V4's `swiglu_limit`); `None`: no clamp.
    - `limit_after`: the gate's clamp applies to `silu(gate)` instead of `gate`
        (Step-3.7: `min(silu(gate), limit)`); `up` is clamped as before.
    """

    limit: float | None = eqx.field(static=True, default=None, converter=real)
    limit_after: bool = eqx.field(static=True, default=False, converter=boolean)
    gated: ClassVar[bool] = True

    def __check_init__(self):
        check_positive(self.limit, "limit", "SwiGLU", optional=True)
        if self.limit_after and self.limit is None:
            raise ValueError("`SwiGLU.limit_after` needs a `limit`.")

    def __call__(self, h):
        gate, up = _halves(h)
        gate, up = _clamp(gate, up, self.limit, gate_too=not self.limit_after)
        activated = jax.nn.silu(gate)
        if self.limit_after:
            activated = jnp.minimum(activated, self.limit)
        return activated * up


class GeGLU(AbstractActivation):
    """`gelu(gate) * up`, gated; `approximate`: the tanh approximation of the GELU
    (`gelu_pytorch_tanh`)."""

    approximate: bool = eqx.field(static=True, default=False, converter=boolean)
    gated: ClassVar[bool] = True

    def __call__(self, h):
        gate, up = _halves(h)
        return jax.nn.gelu(gate, approximate=self.approximate) * up


class ClampedSwiGLU(AbstractActivation):
    """GPT-OSS's activation, gated: `gate * sigmoid(alpha * gate) * (up + 1)` after
    the clamps `gate <= limit`, `-limit <= up <= limit`.

    **Fields:**

    - `limit`: the clamp (GPT-OSS's `swiglu_limit`, 7.0).
    - `alpha`: the sigmoid's slope (GPT-OSS's 1.702).
    """

    limit: float = eqx.field(static=True, converter=real)
    alpha: float = eqx.field(static=True, default=1.702, converter=real)
    gated: ClassVar[bool] = True

    def __check_init__(self):
        check_positive(self.limit, "limit", "ClampedSwiGLU")
        check_positive(self.alpha, "alpha", "ClampedSwiGLU")

    def __call__(self, h):
        gate, up = _clamp(*_halves(h), self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)


class SoftcapSwiGLU(AbstractActivation):
    """Inkling-2's activation, gated: `cap(gate, gate_cap) * sigmoid(gate) *
    cap(up, up_cap)` with `cap(v, c) = c * tanh(v / c)`."""

    gate_cap: float = eqx.field(static=True, converter=real)
    up_cap: float = eqx.field(static=True, converter=real)
    gated: ClassVar[bool] = True

    def __check_init__(self):
        check_positive(self.gate_cap, "gate_cap", "SoftcapSwiGLU")
        check_positive(self.up_cap, "up_cap", "SoftcapSwiGLU")

    def __call__(self, h):
        gate, up = _halves(h)
        linear = self.gate_cap * jnp.tanh(gate / self.gate_cap)
        return (
            linear * jax.nn.sigmoid(gate) * (self.up_cap * jnp.tanh(up / self.up_cap))
        )


class ReLU(AbstractActivation):
    """`relu(h)`, ungated."""

    gated: ClassVar[bool] = False

    def __call__(self, h):
        return jax.nn.relu(h)


class ReLU2(AbstractActivation):
    """`relu(h) ** 2`, ungated (Nemotron-H)."""

    gated: ClassVar[bool] = False

    def __call__(self, h):
        return jnp.square(jax.nn.relu(h))


class GELU(AbstractActivation):
    """`gelu(h)`, ungated; `approximate`: the tanh approximation."""

    approximate: bool = eqx.field(static=True, default=False, converter=boolean)
    gated: ClassVar[bool] = False

    def __call__(self, h):
        return jax.nn.gelu(h, approximate=self.approximate)


class SiLU(AbstractActivation):
    """`silu(h)`, ungated."""

    gated: ClassVar[bool] = False

    def __call__(self, h):
        return jax.nn.silu(h)


class WithBiasColumn(AbstractActivation):
    """`inner` on all columns but the last, which passes through: the experts' biases
    ride in their weights as one more row (`x @ W1 + b1 = [x, 1] @ [W1; b1]`, and the
    same for `Wd`), and this carries the constant 1 from the first product to the
    down projection, so that every backend, the exchange, the slot copies and the
    fallback compute the biases without knowing (`moe_eqx.internal.fold_biases`)."""

    inner: AbstractActivation = eqx.field(static=True)
    gated: ClassVar[bool] = False  # its widths: `first_width`

    @property
    def collective(self) -> bool:
        return self.inner.collective

    def __call__(self, h):
        core = apply_activation(self.inner, h[..., :-1])
        return jnp.concatenate([core, h[..., -1:].astype(jnp.float32)], axis=-1)


def first_width(activation: AbstractActivation, d_ff: int) -> int:
    """Columns of the first product for hidden width `d_ff` (with a bias column,
    `d_ff` counts it, and so does the result)."""
    if isinstance(activation, WithBiasColumn):
        return first_width(activation.inner, d_ff - 1) + 1
    return 2 * d_ff if activation.gated else d_ff


def apply_activation(activation: AbstractActivation, h: Array) -> Array:
    """`activation(h)` in float32, its shape checked at trace time: the call every
    backend makes."""
    out = activation(h.astype(jnp.float32))
    if isinstance(activation, WithBiasColumn):
        return out
    want = h.shape[:-1] + (h.shape[-1] // 2 if activation.gated else h.shape[-1],)
    if out.shape != want:
        raise ValueError(
            f"The activation {type(activation).__name__} mapped a first product of "
            f"shape {h.shape} to {out.shape}; it must give {want} (gated="
            f"{activation.gated})."
        )
    return out.astype(jnp.float32)


def activate(activation: AbstractActivation, h: Array, dtype, vjp=None) -> Array:
    """`apply_activation(activation, h)` rounded to `dtype`: the hidden units the
    down projection takes, as the backends compute them between their products.

    Its derivatives are JAX's own of `apply_activation`, but the backward keeps only
    `h` (in its own dtype) and recomputes the float32 intermediates from it in the
    pass that forms `h`'s cotangent. Plain autodiff keeps float32 `[rows, d_ff]`
    intermediates (or a float32 copy of `h`) alive between the forward and the
    backward, and every one of them is written and read once more in memory.

    `vjp`: a backend's own way of forming that cotangent of a gated activation
    (`AbstractGMMBackend.hidden_vjp`): `vjp(activation, h, ct)`, `h`'s cotangent in
    `h.dtype`, the same values as `halves_cotangent`'s; `None`: that function.
    """
    return _activate(activation, jnp.dtype(dtype).name, vjp, h)


def _as_float(activation: AbstractActivation, h: Array) -> Array:
    """`h` in float32; a gated activation's two halves converted apart, so that
    each conversion has one user that it fuses into (XLA:TPU wrote a float32 copy
    of the whole of `h` to memory before splitting it)."""
    f32 = jnp.float32
    if not activation.gated or h.shape[-1] % 2:
        return h.astype(f32)
    gate, up = _halves(h)
    return jnp.concatenate([gate.astype(f32), up.astype(f32)], axis=-1)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _activate(activation, dtype, vjp, h):
    return apply_activation(activation, _as_float(activation, h)).astype(dtype)


@_activate.defjvp
def _activate_jvp(activation, dtype, vjp, primals, tangents):
    (h,), (t_h,) = primals, tangents
    out = _activate(activation, dtype, vjp, h)
    res = (h, activation, dtype, vjp)
    return out, custom_linear(_activate_tangent, _activate_transpose, res, t_h, out)


def _activate_tangent(res, t_h):
    h, activation, dtype, _ = res
    _, t_out = activation.jvp(_as_float(activation, h), _as_float(activation, t_h))
    return t_out.astype(dtype)


def _activate_transpose(res, ct):
    h, activation, _, vjp = res
    # `h` is read only once the cotangent exists: XLA can neither move its float32
    # copy into the forward (where it would stay alive until here) nor share the
    # forward's.
    h, ct = jax.lax.optimization_barrier((h, ct))
    if not _by_halves(activation, h):
        return activation.vjp(_as_float(activation, h), ct).astype(h.dtype)
    return (halves_cotangent if vjp is None else vjp)(activation, h, ct)


def _by_halves(activation: AbstractActivation, h: Array) -> bool:
    """Whether `h`'s cotangent is formed a half at a time: a gated activation of an
    even width whose `vjp` is JAX's own (a subclass's own `vjp` is called as it is)."""
    return (
        activation.gated
        and h.shape[-1] % 2 == 0
        and type(activation).vjp is AbstractActivation.vjp
    )


def halves_vjp(
    activation: AbstractActivation, h: Array, ct: Array
) -> tuple[Array, Array]:
    """The cotangents of a gated activation's two halves of `h` (`[gate | up]`) for
    the cotangent `ct` of its output, float32: `activation.vjp(h, ct)`'s two halves,
    each from its own half of `h`.

    The backward rounds each to `h`'s dtype before concatenating them, and a
    backend's `hidden_vjp` may write both halves in one pass (on a TPU, XLA's
    concatenation was a pass of its own, as long as the rest of the backward)."""
    f32 = jnp.float32
    gate, up = _halves(h)

    def call(g, u):
        return apply_activation(activation, jnp.concatenate([g, u], axis=-1))

    _, pullback = jax.vjp(call, gate.astype(f32), up.astype(f32))
    d_gate, d_up = pullback(ct.astype(f32))
    return d_gate, d_up


def halves_cotangent(activation: AbstractActivation, h: Array, ct: Array) -> Array:
    """`h`'s cotangent in `h.dtype`: `halves_vjp`'s two halves, each rounded, then
    concatenated (JAX's way; a backend's `hidden_vjp` gives the same values)."""
    parts = halves_vjp(activation, h, ct)
    return jnp.concatenate([p.astype(h.dtype) for p in parts], axis=-1)


# The names `MoEConfig(activation=...)` takes as shorthands.
ACTIVATIONS: dict[str, AbstractActivation] = {
    "swiglu": SwiGLU(),
    "geglu": GeGLU(),
    "geglu_tanh": GeGLU(approximate=True),
    "relu": ReLU(),
    "relu2": ReLU2(),
    "gelu": GELU(),
    "gelu_tanh": GELU(approximate=True),
    "silu": SiLU(),
}
# Names of activations that need settings: only their objects are taken.
_NEEDS_SETTINGS = {
    "swiglu_oai": "me.ClampedSwiGLU(limit=..., alpha=...)",
    "swiglu_softcap": "me.SoftcapSwiGLU(gate_cap=..., up_cap=...)",
}
SWIGLU = ACTIVATIONS["swiglu"]


def as_activation(value, name: str = "activation") -> AbstractActivation:
    """The activation object of `value`: an [`moe_eqx.AbstractActivation`][] as it
    is, or one of the shorthand names of `ACTIVATIONS`; anything else a `ValueError`
    naming `name`."""
    if isinstance(value, AbstractActivation):
        return value
    if isinstance(value, str) and value in ACTIVATIONS:
        return ACTIVATIONS[value]
    if isinstance(value, str) and value in _NEEDS_SETTINGS:
        raise ValueError(
            f"`{name}={value!r}` needs its settings: pass "
            f"`{name}={_NEEDS_SETTINGS[value]}`."
        )
    raise ValueError(
        f"`{name}` must be one of {tuple(ACTIVATIONS)} or an "
        f"`moe_eqx.AbstractActivation`, got {value!r}."
    )
