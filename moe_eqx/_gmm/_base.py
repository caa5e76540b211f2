"""The grouped-matmul backend interface and the expert FFN built on it."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._activation import SWIGLU, AbstractActivation, activate
from .._autodiff import symbolic_zeros_to_none
from .._quant import QuantizedWeight, as_float
from .._rules import HIDDEN, remat_name

GradAcc = tuple[
    Float[Array, "groups d_in two_d_ff"], Float[Array, "groups d_ff d_model"]
]


class AbstractGMMBackend(eqx.Module):
    """A grouped matrix multiply: rows of `lhs` are split into consecutive groups, and
    group `g` is multiplied by `rhs[g]`; and the expert FFN made of two of them
    (`ffn`, with a default: a backend of your own need only define `__call__`)."""

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

    def ffn(
        self,
        x: Float[Array, "rows d_in"],
        w_gate_up: Float[Array, "groups d_in two_d_ff"] | QuantizedWeight,
        w_down: Float[Array, "groups d_ff d_model"] | QuantizedWeight,
        group_sizes: Int[Array, " groups"],
        grad_acc: GradAcc | None = None,
        *,
        activation: AbstractActivation = SWIGLU,
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
        - `activation`: the [`moe_eqx.AbstractActivation`][] (SwiGLU by default).
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

        The default is two calls of the backend with the activation between them
        (a quantized weight dequantized whole first); a backend overrides it only to
        do better (fuse, or keep quantized weights quantized).
        """
        return gmm_ffn(self, x, w_gate_up, w_down, group_sizes, grad_acc, activation)

    def hidden_vjp(self, activation: AbstractActivation, rows: int):
        """The backend's own way of forming the first product's cotangent from the
        hidden units' in the backward of its two products (`activation` gated,
        `rows` rows): a function `(activation, h, ct) -> h's cotangent` (in
        `h.dtype`) for `moe_eqx._activation.activate`; `None` (the default): JAX's
        own vjp."""
        return None


def gmm_ffn(
    backend: AbstractGMMBackend,
    x: Array,
    w_gate_up: Array | QuantizedWeight,
    w_down: Array | QuantizedWeight,
    group_sizes: Array,
    grad_acc: GradAcc | None = None,
    activation: AbstractActivation = SWIGLU,
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

    vjp = backend.hidden_vjp(activation, x.shape[0])
    return two_products(product, x, w_gate_up, w_down, group_sizes, activation, vjp)


def two_products(product, x, w_gate_up, w_down, group_sizes, activation, vjp=None):
    """The expert FFN as `product(act(product(x, w_gate_up)), w_down)`, with the
    hidden product named for remat; `product(lhs, w, group_sizes)` is a grouped
    matmul in `lhs.dtype` that takes the weights as given (float or quantized);
    `vjp` the backend's `hidden_vjp`."""
    gate_up = product(x, w_gate_up, group_sizes)
    gate_up = remat_name(gate_up, HIDDEN)
    act = activate(activation, gate_up, x.dtype, vjp)
    return product(act, w_down, group_sizes)


def biased_two_products(product, x, w_gate_up, w_down, group_sizes, activation):
    """The expert FFN of quantized experts with their biases beside them
    (`QuantizedWithBias`, `x` with the column of ones `fold_biases` appended,
    `activation` passing it through): `act(x @ W1 + b1[g]) @ Wd + bd[g]` as
    `product`s on the quantized weights, with each row's group's biases added between
    them (plain JAX: the biases get their gradient, the quantized weights none), so
    that no float copy of the experts is made. `product(lhs, w, group_sizes)` as for
    `two_products`."""
    x = x[:, :-1]  # the ones that carry the biases of the folded layout
    activation = activation.inner
    gid = group_ids(group_sizes, x.shape[0])
    num_groups = group_sizes.shape[0]
    real = (gid < num_groups)[:, None]
    index = jnp.minimum(gid, num_groups - 1)

    def biased(lhs, w):
        # The product in float32 (exact on the `x.dtype` values), its bias added
        # before one rounding to `x.dtype`, as in the folded product.
        rows = product(lhs.astype(jnp.float32), w.weight, group_sizes)
        b = jnp.where(real, w.bias[index].astype(jnp.float32), 0.0)
        return (rows + b).astype(x.dtype)

    gate_up = remat_name(biased(x, w_gate_up), HIDDEN)
    act = activate(activation, gate_up, x.dtype)
    return biased(act, w_down)


def zero_past_groups(
    out: Float[Array, "rows n_dim"], group_sizes: Int[Array, " groups"]
) -> Float[Array, "rows n_dim"]:
    """`out` with its rows past `sum(group_sizes)` zero, as every backend's contract
    says: on a TPU `lax.ragged_dot` and the megablox kernels leave them unwritten
    (NaN was seen there)."""
    real = jnp.arange(out.shape[0], dtype=jnp.int32) < jnp.sum(
        group_sizes, dtype=jnp.int32
    )
    return jnp.where(real[:, None], out, jnp.zeros((), out.dtype))


def group_ids(group_sizes: Int[Array, " groups"], num_rows: int) -> Int[Array, " rows"]:
    """Group of each row; `len(group_sizes)` for rows past `sum(group_sizes)`.

    **Arguments:**

    - `group_sizes`: `[G]` non-negative sizes.
    - `num_rows`: `M`, the number of rows.

    **Returns:**

    `[M]` int32 group ids in `[0, G]`.
    """
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


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
