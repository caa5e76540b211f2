"""A backend's raw grouped products, made differentiable to every order.

A backend supplies three raw grouped products (`AbstractProducts`), which are only
ever evaluated (a loop whose trip count is traced, a kernel: JAX could not transpose
their derivatives):

- `gmm(a [M, K], b [G, K, N]) -> [M, N]`: `a_i @ b[g(i)]`;
- `gmm_t(a [M, N], b [G, K, N]) -> [M, K]`: `a_i @ b[g(i)]^T`;
- `tgmm(a [M, K], d [M, N]) -> [G, K, N]`: `a_g^T @ d_g` over each group's rows;

and `backward`, both cotangents of a `gmm` (in one pass where the backend can). Each
product is bilinear, and the transposes of each are two of the others: `gmm`'s are
`gmm_t` and `tgmm`, `gmm_t`'s `gmm` and `tgmm`, `tgmm`'s `gmm_t` and `gmm`. So `gmm`,
`gmm_t` and `tgmm` below, each a `jax.custom_jvp` whose tangent is a `custom_linear`
(`moe_eqx._autodiff`) transposing to the others, have every derivative of every order
(forward, reverse and their compositions), and each value is the raw product's.

Precision: products in `a.dtype` (`b` is cast to it), accumulated in float32; `gmm`
and `gmm_t` return `a.dtype`, `tgmm` float32 (`a` and `d` of one dtype).
"""

import abc
import functools as ft

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int

from .._autodiff import custom_linear, fused, symbolic_zeros_to_none
from .._quant import QuantizedArray


class AbstractProducts(eqx.Module):
    """A backend's raw grouped products (see the module); rows at or beyond
    `sum(group_sizes)` belong to no group: zero rows out, no contribution to `tgmm`.

    `has_effects`: whether the products have side effects (a Pallas kernel in its
    interpreter), which the derivative rules then find by tracing them.
    """

    has_effects: eqx.AbstractClassVar[bool]

    @abc.abstractmethod
    def gmm(
        self,
        a: Float[Array, "rows k_dim"],
        b: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        """`a_i @ b[g(i)]` in `a.dtype`."""

    @abc.abstractmethod
    def gmm_t(
        self,
        a: Float[Array, "rows n_dim"],
        b: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows k_dim"]:
        """`a_i @ b[g(i)]^T` in `a.dtype`."""

    @abc.abstractmethod
    def tgmm(
        self,
        a: Float[Array, "rows k_dim"],
        d: Float[Array, "rows n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "groups k_dim n_dim"]:
        """`a_g^T @ d_g` in float32."""

    @abc.abstractmethod
    def backward(self, a, b, group_sizes, d_out, want: tuple[bool, bool]):
        """`(gmm_t(d_out, b), tgmm(a, d_out))`, each `None` unless `want`ed (`d_out`
        already in `a.dtype`), `tgmm` rounded once to `b.dtype` (a kernel may write
        it so from its float32 accumulator, without a float32 copy)."""


def _both(terms):
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _tangent(res, lin):
    kind, products, a, b, group_sizes = res
    t_a, t_b = lin
    terms = []
    if t_a is not None:
        terms.append(_product(kind, products, t_a, b, group_sizes))
    if t_b is not None:
        terms.append(_product(kind, products, a, t_b, group_sizes))
    return _both(terms)


def _backward(products, a, b, group_sizes, d_out, want):
    d_a = gmm_t(products, d_out, b, group_sizes) if want[0] else None
    d_b = tgmm(products, a, d_out, group_sizes).astype(b.dtype) if want[1] else None
    return d_a, d_b


def _transpose(res, ct, want):
    """`(ct_a, ct_b)` of `kind(a, b)` for the output cotangent `ct` (see the module),
    each `None` unless `want`ed."""
    kind, products, a, b, group_sizes = res
    if kind == "gmm":
        ct = ct.astype(a.dtype)
        args = (products, a, b, group_sizes, ct, want)
        return fused(_raw_backward, _backward, *args)
    d_a = d_b = None
    if kind == "gmm_t":
        ct = ct.astype(a.dtype)
        if want[0]:
            d_a = gmm(products, ct, b, group_sizes)
        if want[1]:
            d_b = tgmm(products, ct, a, group_sizes).astype(b.dtype)
    else:  # tgmm
        if want[0]:
            d_a = gmm_t(products, b, ct, group_sizes)
        if want[1]:
            d_b = gmm(products, a, ct, group_sizes)
    return d_a, d_b


def _raw_backward(products, a, b, group_sizes, d_out, want):
    d_a, d_b = products.backward(a, b, group_sizes, d_out, want)
    return d_a, None if d_b is None else d_b.astype(b.dtype)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _product(kind, products, a, b, group_sizes):
    return getattr(products, kind)(a, b, group_sizes)


def _product_jvp(kind, products, primals, tangents):
    a, b, group_sizes = primals
    t_a, t_b, _ = symbolic_zeros_to_none(tangents)
    out = _product(kind, products, a, b, group_sizes)
    res = (kind, products, a, b, group_sizes)
    transpose = ft.partial(_transpose, want=(t_a is not None, t_b is not None))
    out_struct = None if products.has_effects else out
    return out, custom_linear(_tangent, transpose, res, (t_a, t_b), out_struct)


_product.defjvp(_product_jvp, symbolic_zeros=True)


def gmm(
    products: AbstractProducts,
    a: Float[Array, "rows k_dim"],
    b: Float[Array, "groups k_dim n_dim"] | QuantizedArray,
    group_sizes: Int[Array, " groups"],
) -> Float[Array, "rows n_dim"]:
    """`products.gmm(a, b, group_sizes)`, differentiable to every order (a
    `QuantizedArray` `b`, for products that take one, is a constant)."""
    return _product("gmm", products, a, b, group_sizes)


def gmm_t(
    products: AbstractProducts,
    a: Float[Array, "rows n_dim"],
    b: Float[Array, "groups k_dim n_dim"] | QuantizedArray,
    group_sizes: Int[Array, " groups"],
) -> Float[Array, "rows k_dim"]:
    """`products.gmm_t(a, b, group_sizes)`, differentiable to every order."""
    return _product("gmm_t", products, a, b, group_sizes)


def tgmm(
    products: AbstractProducts,
    a: Float[Array, "rows k_dim"],
    d: Float[Array, "rows n_dim"],
    group_sizes: Int[Array, " groups"],
) -> Float[Array, "groups k_dim n_dim"]:
    """`products.tgmm(a, d, group_sizes)`, differentiable to every order."""
    return _product("tgmm", products, a, d, group_sizes)
