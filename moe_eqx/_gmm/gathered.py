"""A grouped matmul that gathers each row's matrix: for fewer rows than groups.

The tiled loop visits every group and slices its weights, so its cost has a floor of
reading all `G` matrices however few rows there are. Gathering row `i`'s matrix
`rhs[g(i)]` reads `M` of them instead: cheaper whenever `M < G` (decode steps). The
products are plain JAX (a gather and a batched product), so JAX differentiates them
to every order. Quantized experts (`QuantizedArray`, or one with its bias folded in)
run one row at a time instead: its expert's stored bytes and scales gathered and
dequantized, its two products, then the next row, so that the float matrices held
are one row's, never `M` of them (which at `M` rows near `G` would be more than the
quantized experts themselves); the row's matrices are recomputed in the backward.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._activation import SWIGLU, AbstractActivation, apply_activation
from .._quant import QuantizedWeight, is_quantized
from .._rules import HIDDEN, acc_dtype, match_varying, remat_name
from ._base import (
    AbstractGMMBackend,
    GradAcc,
    group_ids,
    two_products,
    with_tangent_of,
)


def _row_weights(w, gid, dtype):
    """`w[g(i)]` for each row `i`, `[M, K, N]` in `dtype`. Rows past
    `sum(group_sizes)` read the last group's matrix (any valid index); their products
    are zeroed by `_row_products`."""
    index = jnp.minimum(gid, w.shape[0] - 1)
    if is_quantized(w):
        # Values and block scales alike are indexed by their leading (expert) axis,
        # so each row gets its own expert's bytes and scales before dequantizing.
        return w.map_experts(lambda a: a[index]).dequantize(dtype)
    return w.astype(dtype)[index]


def _row_products(lhs, weights, gid, num_groups):
    """`lhs[i] @ weights[i]` accumulated in float32, zero past the last group, in
    `lhs.dtype`."""
    out = jnp.einsum(
        "mk,mkn->mn", lhs, weights, preferred_element_type=acc_dtype(lhs.dtype)
    )
    out = jnp.where((gid < num_groups)[:, None], out, jnp.zeros((), out.dtype))
    return out.astype(lhs.dtype)


def _expert_matrix(w, g, dtype):
    """Expert `g`'s matrix of `w` in `dtype` (a quantized one dequantized alone)."""
    if is_quantized(w):
        return w.map_experts(lambda a: a[g]).dequantize(dtype)
    return w[g].astype(dtype)


def _row_by_row_ffn(x, w_gate_up, w_down, gid, num_groups, activation):
    """The FFN of each row with its expert's matrices, one row at a time (see the
    module's docstring); rows past the last group give zeros."""

    @jax.checkpoint  # the backward recomputes a row's matrices rather than keep M
    def row(xr, g):
        e = jnp.minimum(g, num_groups - 1)
        acc = acc_dtype(x.dtype)
        h = jnp.dot(
            xr, _expert_matrix(w_gate_up, e, x.dtype), preferred_element_type=acc
        )
        h = remat_name(h.astype(x.dtype), HIDDEN)
        a = apply_activation(activation, h[None])[0].astype(x.dtype)
        y = jnp.dot(a, _expert_matrix(w_down, e, x.dtype), preferred_element_type=acc)
        return jnp.where(g < num_groups, y, jnp.zeros((), y.dtype)).astype(x.dtype)

    return jax.lax.map(lambda args: row(*args), (x, gid))


class GatheredGMM(AbstractGMMBackend):
    """Grouped matmul as one batched product of each row with its gathered matrix.

    Builds `[M, K, N]` (`rhs[g(i)]` for each row `i`): `M / G` times the weights'
    memory, so only for `M` at most a small multiple of `G`; `TiledGMM` uses it when
    `M < G`. Gradients come from JAX's autodiff (the weights' is a scatter-add into
    `[G, K, N]`). Its `ffn` gathers a [`moe_eqx.QuantizedArray`][]'s stored bytes
    and scales per row and dequantizes only those `M` matrices: no float copy of all
    `G` is built.
    """

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        with jax.named_scope("moe_eqx.gmm.gathered"):
            lhs, rhs, group_sizes = match_varying(
                lhs, rhs, group_sizes.astype(jnp.int32)
            )
            gid = group_ids(group_sizes, lhs.shape[0])
            weights = _row_weights(rhs, gid, rhs.dtype)
            return _row_products(lhs, weights, gid, rhs.shape[0])

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
        with jax.named_scope("moe_eqx.gmm.gathered"):
            if grad_acc is not None:  # see `AbstractGMMBackend.ffn`
                w_gate_up = with_tangent_of(w_gate_up, grad_acc[0])
                w_down = with_tangent_of(w_down, grad_acc[1])
            x, w_gate_up, w_down, group_sizes = match_varying(
                x, w_gate_up, w_down, group_sizes.astype(jnp.int32)
            )
            gid = group_ids(group_sizes, x.shape[0])
            num_groups = w_gate_up.shape[0]
            if grad_acc is None and (is_quantized(w_gate_up) or is_quantized(w_down)):
                return _row_by_row_ffn(
                    x, w_gate_up, w_down, gid, num_groups, activation
                )

            def product(lhs, w, _):
                weights = _row_weights(w, gid, lhs.dtype)
                return _row_products(lhs, weights, gid, num_groups)

            out = two_products(product, x, w_gate_up, w_down, group_sizes, activation)
            return out if grad_acc is None else (out, grad_acc)
