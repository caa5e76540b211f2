"""`lax.ragged_dot`: the TPU path and a reference everywhere else.

Off TPU it lowers to a dense masked product, `G` times the work (see
`docs/measured.md`), so `auto` never picks it there.

Derivatives: the three grouped products of `moe_eqx._gmm._products` as
`lax.ragged_dot_general` calls (the same ones JAX's own transposes of `ragged_dot`
emit), so every order is defined; JAX's own would fail at the second order in reverse
mode (it has no transpose of the weights' gradient, a ragged contraction).
"""

from typing import ClassVar

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from .._rules import acc_dtype
from ._base import AbstractGMMBackend, zero_past_groups
from ._products import AbstractProducts, gmm

# `a_i @ b[g]^T` (`a`'s columns against `b`'s last axis), and `a_g^T d_g` (the ragged
# rows contracted: one output per group).
_GMM_T = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
_TGMM = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def _ragged(a, b, group_sizes, dims=None, out=None):
    """`ragged_dot_general` of `a` and `b` (cast to `a.dtype`) accumulated in
    `acc_dtype` (float32; float64 for float64 inputs) and returned in `out` (default:
    that accumulation dtype). A 16-bit `out` is the float32 accumulator rounded once
    (the TPU's matrix unit accumulates in float32 and writes `out`: no float32 copy
    of the product is made)."""
    b = b.astype(a.dtype)
    sizes = group_sizes.astype(jnp.int32)
    acc = acc_dtype(a.dtype) if out is None else out
    # Explicit for 16-bit operands: on a TPU the product is a Mosaic kernel, which
    # rejects the float32 contract precision a global
    # `jax_default_matmul_precision="highest"` would ask for (their products are
    # exact in float32 whatever the precision).
    precision = lax.Precision.DEFAULT if a.dtype.itemsize < 4 else None
    if dims is None:
        return lax.ragged_dot(
            a, b, sizes, precision=precision, preferred_element_type=acc
        )
    return lax.ragged_dot_general(
        a, b, sizes, dims, precision=precision, preferred_element_type=acc
    )


class _RaggedDotProducts(AbstractProducts):
    has_effects: ClassVar[bool] = False

    def gmm(self, a, b, group_sizes):
        out = _ragged(a, b, group_sizes, out=_rounded(a.dtype))
        return zero_past_groups(out, group_sizes).astype(a.dtype)

    def gmm_t(self, a, b, group_sizes):
        out = _ragged(a, b, group_sizes, _GMM_T, _rounded(a.dtype))
        return zero_past_groups(out, group_sizes).astype(a.dtype)

    def tgmm(self, a, d, group_sizes):
        return _ragged(a, d, group_sizes, _TGMM)

    def backward(self, a, b, group_sizes, d_out, want):
        d_a = self.gmm_t(d_out, b, group_sizes) if want[0] else None
        d_b = None
        if want[1]:
            d_b = _ragged(a, d_out, group_sizes, _TGMM, _rounded(b.dtype))
        return d_a, d_b


def _rounded(dtype):
    """The output dtype of a product rounded to `dtype`: `dtype` itself when it is
    16-bit (see `_ragged`), else the accumulation dtype (then cast)."""
    return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize < 4 else None


class RaggedDotGMM(AbstractGMMBackend):
    """Grouped matmul through `jax.lax.ragged_dot`."""

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        return gmm(_RaggedDotProducts(), lhs, rhs, group_sizes.astype(jnp.int32))
