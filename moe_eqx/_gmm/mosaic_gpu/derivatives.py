"""The backend's differentiable grouped matmul: a `jax.custom_jvp` over the kernels,
whose tangent is a `custom_linear` (`moe_eqx._autodiff`) transposing to the kernels.

Tangent: `gmm(t_lhs, rhs) + gmm(lhs, t_rhs)` (the forward kernel twice). Transpose:
`d_lhs` is the forward kernel on `d_out` with `transpose_rhs=True` (contracting `N`
against `rhs [G, K, N]` without materialising `rhs^T`), or on a materialised
`[G, N, K]` transpose; `d_rhs` is the transposed kernel, `lhs_g^T @ d_out_g`,
`[G, K, N]`. Each kernel call is itself a `jax.custom_jvp` (a bilinear function's
tangent is the same kernel on the tangents), so the transpose can be differentiated
again: Hessian-vector products work.
"""

import functools

import jax
import jax.numpy as jnp

from ..._autodiff import custom_linear, symbolic_zeros_to_none
from .kernels import ragged, transposed_ragged
from .tiling import MosaicTileConfig


def _bilinear(kernel):
    """`kernel(a, b, group_sizes)`, bilinear in `(a, b)`, with forward mode."""

    @jax.custom_jvp
    def f(a, b, group_sizes):
        return kernel(a, b, group_sizes)

    def f_jvp(primals, tangents):
        a, b, group_sizes = primals
        t_a, t_b, _ = symbolic_zeros_to_none(tangents)
        out = f(a, b, group_sizes)
        terms = []
        if t_a is not None:
            terms.append(f(t_a, b, group_sizes))
        if t_b is not None:
            terms.append(f(a, t_b, group_sizes))
        if not terms:
            return out, jnp.zeros_like(out)
        return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]

    f.defjvp(f_jvp, symbolic_zeros=True)
    return f


@functools.cache
def mosaic_gmm(
    fwd: MosaicTileConfig,
    dlhs: MosaicTileConfig,
    drhs: MosaicTileConfig,
    transpose_in_kernel: bool,
):
    """The differentiable grouped matmul with these tilings (one function per tiling,
    cached, so that jit sees the same callable for the same configuration).

    **Arguments:**

    - `fwd`, `dlhs`, `drhs`: tilings of the forward, `d_lhs` and `d_rhs` kernels.
    - `transpose_in_kernel`: compute `d_lhs` with the kernel's `transpose_rhs` instead
        of materialising `rhs^T`.

    **Returns:**

    `f(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`, with `K` and `N`
    already padded to the tiles; differentiable with respect to `lhs` and `rhs` in
    forward and reverse mode.
    """

    forward = _bilinear(lambda a, b, gs: ragged(a, b, gs, fwd, False))
    backward_lhs = _bilinear(
        lambda a, b, gs: ragged(a, b, gs, dlhs, transpose_in_kernel)
    )
    backward_rhs = _bilinear(lambda a, b, gs: transposed_ragged(a, b, gs, drhs))

    def tangent(res, lin):
        lhs, rhs, group_sizes, _ = res
        t_lhs, t_rhs = lin
        terms = []
        if t_lhs is not None:
            terms.append(forward(t_lhs, rhs, group_sizes))
        if t_rhs is not None:
            terms.append(forward(lhs, t_rhs, group_sizes))
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    def transpose(res, d_out):
        lhs, rhs, group_sizes, (want_lhs, want_rhs) = res
        d_out = d_out.astype(lhs.dtype)
        d_lhs = d_rhs = None
        if want_lhs:
            rhs_t = rhs if transpose_in_kernel else jnp.swapaxes(rhs, 1, 2)
            d_lhs = backward_lhs(d_out, rhs_t, group_sizes)
        if want_rhs:
            d_rhs = backward_rhs(lhs, d_out, group_sizes).astype(rhs.dtype)
        return d_lhs, d_rhs

    @jax.custom_jvp
    def mosaic(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes)

    def mosaic_jvp(primals, tangents):
        lhs, rhs, group_sizes = primals
        t_lhs, t_rhs, _ = symbolic_zeros_to_none(tangents)
        out = mosaic(lhs, rhs, group_sizes)
        res = (lhs, rhs, group_sizes, (t_lhs is not None, t_rhs is not None))
        # No `out` given: `tangent` is traced, so that the kernels' effects (in the
        # Pallas interpreter) are declared.
        return out, custom_linear(tangent, transpose, res, (t_lhs, t_rhs))

    mosaic.defjvp(mosaic_jvp, symbolic_zeros=True)
    return mosaic
