"""The grouped-matmul backend interface, the experts' activations, and the expert FFN
built on them."""

import abc
import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._autodiff import symbolic_zeros_to_none
from .._quant import QuantizedArray, as_float
from .._rules import HIDDEN, remat_name

GradAcc = tuple[
    Float[Array, "groups d_in two_d_ff"], Float[Array, "groups d_ff d_model"]
]


_GATED = ("swiglu", "geglu", "geglu_tanh", "swiglu_oai", "swiglu_softcap")
_UNGATED = ("relu", "relu2", "gelu", "gelu_tanh", "silu")
ACTIVATIONS = _GATED + _UNGATED


@dataclasses.dataclass(frozen=True)
class Activation:
    """An expert's activation, applied in float32 to the first product `h = x @ W1`.

    Gated activations split `h` into `[gate | up]` halves (`W1` is `[d_model, 2 d_ff]`);
    ungated ones take `h` whole (`W1` is `[d_model, d_ff]`).

    - `"swiglu"`: `silu(gate) * up`; with `limit`, `gate` is clamped to at most
        `limit` and `up` to `[-limit, limit]` first; with `limit_after` too, `silu(gate)`
        is clamped to at most `limit` instead of `gate` (Step-3.7).
    - `"geglu"`, `"geglu_tanh"`: `gelu(gate) * up` (exact, or the tanh approximation).
    - `"swiglu_oai"`: `gate * sigmoid(alpha * gate) * (up + 1)` after the clamps above
        (`limit` required).
    - `"swiglu_softcap"`: `cap(gate, c_g) * sigmoid(gate) * cap(up, c_u)` with
        `cap(v, c) = c * tanh(v / c)` and `softcap = (c_g, c_u)` (required; Inkling-2).
    - `"relu"`, `"relu2"` (`relu(h)**2`), `"gelu"`, `"gelu_tanh"`, `"silu"`: ungated.

    With `bias`, `h` carries one more column, a constant 1 that is passed through to
    the output's last column: the experts' biases ride in their weights as one more
    row (`x @ W1 + b1 = [x, 1] @ [W1; b1]`, and the same for `Wd`), so every backend,
    the exchange, the slot copies and the fallback compute them without knowing.

    Its derivatives are JAX's own (`jvp`, `vjp` below), in float32.
    """

    name: str = "swiglu"
    limit: float | None = None
    alpha: float = 1.702
    bias: bool = False
    softcap: tuple[float, ...] | None = None
    limit_after: bool = False

    def __post_init__(self):
        if self.name not in ACTIVATIONS:
            raise ValueError(
                f"Unknown activation {self.name!r}; expected one of {ACTIVATIONS}."
            )
        if (self.name == "swiglu_softcap") != (self.softcap is not None):
            raise ValueError(
                "`activation_softcap` (a pair of positive caps) is needed by "
                f"'swiglu_softcap' and by no other activation; got "
                f"{self.softcap!r} for {self.name!r}."
            )
        if self.softcap is not None and not (
            isinstance(self.softcap, tuple)
            and len(self.softcap) == 2
            and all(
                isinstance(c, int | float)
                and not isinstance(c, bool)
                and math.isfinite(c)
                and c > 0
                for c in self.softcap
            )
        ):
            raise ValueError(
                "`activation_softcap` must be a pair of positive finite numbers "
                f"(gate cap, up cap), got {self.softcap!r}."
            )
        if self.limit is not None and not (
            self.name in ("swiglu", "swiglu_oai") and self.limit > 0
        ):
            raise ValueError(
                f"An activation `limit` applies to 'swiglu' and 'swiglu_oai' and must "
                f"be positive; got limit={self.limit!r} for {self.name!r}."
            )
        if self.limit_after and self.name != "swiglu":
            raise ValueError(
                "`activation_limit_after` (a clamp after the activation) applies to "
                f"'swiglu' only; got {self.name!r}."
            )
        if self.name == "swiglu_oai" and self.limit is None:
            raise ValueError("The 'swiglu_oai' activation needs a `limit`.")

    @property
    def gated(self) -> bool:
        return self.name in _GATED

    def width(self, d_ff: int) -> int:
        """Columns of the first product for hidden width `d_ff` (biases not
        counted)."""
        return 2 * d_ff if self.gated else d_ff

    def in_width(self, rows: int) -> int:
        """Columns of the first product for a down projection of `rows` rows (with
        `bias`, both count the bias's column)."""
        return self.width(rows - 1) + 1 if self.bias else self.width(rows)

    def __call__(self, h: Array) -> Array:
        """The activation of `h` (`[..., 2 d_ff]` gated, `[..., d_ff]` ungated, one
        more column with `bias`), in float32."""
        h = h.astype(jnp.float32)
        if self.bias:
            core = dataclasses.replace(self, bias=False)
            return jnp.concatenate([core(h[..., :-1]), h[..., -1:]], axis=-1)
        if not self.gated:
            if self.name == "relu":
                return jax.nn.relu(h)
            if self.name == "relu2":
                return jnp.square(jax.nn.relu(h))
            if self.name == "silu":
                return jax.nn.silu(h)
            return jax.nn.gelu(h, approximate=self.name == "gelu_tanh")
        gate, up = jnp.split(h, 2, axis=-1)
        if self.limit is not None:
            if not self.limit_after:
                gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
        if self.name == "swiglu":
            activated = jax.nn.silu(gate)
            if self.limit_after and self.limit is not None:
                activated = jnp.minimum(activated, self.limit)
            return activated * up
        if self.name == "swiglu_oai":
            return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)
        if self.name == "swiglu_softcap":
            c_gate, c_up = self.softcap
            capped_up = c_up * jnp.tanh(up / c_up)
            return c_gate * jnp.tanh(gate / c_gate) * jax.nn.sigmoid(gate) * capped_up
        return jax.nn.gelu(gate, approximate=self.name == "geglu_tanh") * up

    def jvp(self, h: Array, t_h: Array) -> tuple[Array, Array]:
        """`(self(h), its tangent along t_h)`, both float32."""
        f32 = jnp.float32
        return jax.jvp(self, (h.astype(f32),), (t_h.astype(f32),))

    def vjp(self, h: Array, d_act: Array) -> Array:
        """The cotangent of `h` for the cotangent `d_act` of `self(h)`, float32."""
        _, pullback = jax.vjp(self, h.astype(jnp.float32))
        return pullback(d_act.astype(jnp.float32))[0]


SWIGLU = Activation()


class AbstractGMMBackend(eqx.Module):
    """A grouped matrix multiply: rows of `lhs` are split into consecutive groups, and
    group `g` is multiplied by `rhs[g]`; and the SwiGLU expert FFN made of two of
    them."""

    @abc.abstractmethod
    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        """Computes `out[i] = lhs[i] @ rhs[g(i)]` where `g(i)` is the group of row `i`.

        **Arguments:**

        - `lhs`: `[M, K]` rows sorted by group.
        - `rhs`: `[G, K, N]` one matrix per group.
        - `group_sizes`: `[G]` non-negative int32 sizes with `sum(group_sizes) <= M`.

        **Returns:**

        `[M, N]` in `lhs.dtype` (accumulated in float32). Rows at or beyond
        `sum(group_sizes)` are exactly zero. Differentiable with respect to `lhs` and
        `rhs` in forward and reverse mode; gradients of rows beyond `sum(group_sizes)`
        and of empty groups are zero.
        """

    @abc.abstractmethod
    def ffn(
        self,
        x: Float[Array, "rows d_in"],
        w_gate_up: Float[Array, "groups d_in two_d_ff"] | QuantizedArray,
        w_down: Float[Array, "groups d_ff d_model"] | QuantizedArray,
        group_sizes: Int[Array, " groups"],
        grad_acc: GradAcc | None = None,
        *,
        activation: Activation = SWIGLU,
    ):
        """The expert FFN of each group: `out[i] = act(x[i] @ W1) @ Wd` with the
        group's weights (`w_gate_up[g] = W1`, `[Wg | Wu]` for a gated activation, so
        SwiGLU is `(silu(x[i] @ Wg) * (x[i] @ Wu)) @ Wd`), products in `x.dtype` with
        float32 accumulation and the activation in float32 (as [`moe_eqx.gmm`][]
        twice).

        - `x`: `[M, d_model]` rows sorted by group.
        - `w_gate_up`: `[G, d_model, 2 d_ff]` (`[G, d_model, d_ff]` for an ungated
            activation); `w_down`: `[G, d_ff, d_model]`.
        - `group_sizes`: `[G]` int32, `sum <= M`.
        - `activation`: the [`moe_eqx.Activation`][] (SwiGLU by default).
        - `grad_acc`: optional float32 accumulators shaped like the weights, for
            the chunked fallback's backward, which sums its chunks' weight gradients
            in one buffer. The function is then `(ffn(x, w + acc - acc'), acc)`
            with `acc'` a constant equal to `acc`: its value is `(ffn(x, w), acc)`
            and its derivative in `acc` that in the weights, so under `jax.vjp` the
            cotangent of the input accumulators is that of the output ones plus the
            weights' gradient (summed in place where the backend can), and so is
            the weights' own (without the output's cotangent) when they are
            differentiated too.

        **Returns:**

        `[M, d_model]` in `x.dtype` (rows beyond `sum(group_sizes)` are zero); with
        `grad_acc`, `(out, grad_acc)`.
        """


def gmm_ffn(
    backend: AbstractGMMBackend,
    x: Array,
    w_gate_up: Array | QuantizedArray,
    w_down: Array | QuantizedArray,
    group_sizes: Array,
    grad_acc: GradAcc | None = None,
    activation: Activation = SWIGLU,
) -> Array | tuple[Array, GradAcc]:
    """`AbstractGMMBackend.ffn` as two calls of `backend` (for backends without a
    fused FFN)."""
    ffn = (backend, activation)
    if grad_acc is None:
        return _two_products(ffn, x, w_gate_up, w_down, group_sizes)
    return _accumulating_ffn(ffn, x, w_gate_up, w_down, group_sizes, grad_acc)


def _two_products(ffn, x, w_gate_up, w_down, group_sizes):
    backend, activation = ffn

    def product(lhs, w, sizes):
        # A quantized weight is dequantized whole here, before the product.
        return backend(lhs, as_float(w, lhs.dtype), sizes)

    return two_products(product, x, w_gate_up, w_down, group_sizes, activation)


def two_products(product, x, w_gate_up, w_down, group_sizes, activation):
    """The expert FFN as `product(act(product(x, w_gate_up)), w_down)`, with the
    hidden product named for remat; `product(lhs, w, group_sizes)` is a grouped
    matmul in `lhs.dtype` that takes the weights as given (float or quantized)."""
    gate_up = product(x, w_gate_up, group_sizes)
    gate_up = remat_name(gate_up, HIDDEN)
    act = activation(gate_up).astype(x.dtype)
    return product(act, w_down, group_sizes)


@jax.custom_jvp
def with_tangent_of(w: Array, acc: Array) -> Array:
    """`w`, whose tangent is `w`'s plus `acc`'s (cast to `w.dtype`): so under
    `jax.vjp` the cotangent of `w` also goes to `acc`. The weights of an accumulating
    FFN (see `AbstractGMMBackend.ffn`)."""
    return w


def _with_tangent_of_jvp(primals, tangents):
    w, acc = primals
    t_w, t_acc = symbolic_zeros_to_none(tangents)
    terms = [t for t in (t_w, t_acc) if t is not None]
    terms = [t.astype(w.dtype) for t in terms]
    # The primal through the function itself, so that its own derivative (a higher
    # order's) keeps `acc`'s part.
    out = with_tangent_of(w, acc)
    return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]


with_tangent_of.defjvp(_with_tangent_of_jvp, symbolic_zeros=True)


def _accumulating_ffn(ffn, x, w_gate_up, w_down, group_sizes, grad_acc):
    w_gate_up = with_tangent_of(w_gate_up, grad_acc[0])
    w_down = with_tangent_of(w_down, grad_acc[1])
    return _two_products(ffn, x, w_gate_up, w_down, group_sizes), grad_acc
