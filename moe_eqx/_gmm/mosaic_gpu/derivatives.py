"""The backend's differentiable grouped matmul: the kernels as the raw grouped
products of `moe_eqx._gmm._products`, which makes them differentiable to every order
(reverse over reverse included), each value a kernel call.

`gmm` is the forward kernel; `gmm_t` (`d_lhs = d_out @ rhs[g]^T`) the forward kernel
with `transpose_rhs=True` (contracting `N` against `rhs [G, K, N]` without
materialising `rhs^T`), or on a materialised `[G, N, K]` transpose; `tgmm`
(`d_rhs[g] = lhs_g^T @ d_out_g`, `[G, K, N]`) the transposed kernel. The derivatives of
each are the others, with the same tilings (a derivative has the shapes of the
forward, `d_lhs` or `d_rhs` kernel call it transposes).
"""

import functools
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from .._products import AbstractProducts, gmm
from .kernels import ragged, transposed_ragged
from .tiling import MosaicTileConfig


class _MosaicProducts(AbstractProducts):
    fwd: MosaicTileConfig = eqx.field(static=True)
    dlhs: MosaicTileConfig = eqx.field(static=True)
    drhs: MosaicTileConfig = eqx.field(static=True)
    transpose_in_kernel: bool = eqx.field(static=True)
    # In the Pallas interpreter the kernels have effects, which the custom derivative
    # rules must declare.
    has_effects: ClassVar[bool] = True

    def gmm(self, a, b, group_sizes):
        return ragged(a, b.astype(a.dtype), group_sizes, self.fwd, False)

    def gmm_t(self, a, b, group_sizes):
        b = b.astype(a.dtype)
        if not self.transpose_in_kernel:
            b = jnp.swapaxes(b, 1, 2)
        return ragged(a, b, group_sizes, self.dlhs, self.transpose_in_kernel)

    def tgmm(self, a, d, group_sizes):
        return transposed_ragged(a, d, group_sizes, self.drhs).astype(jnp.float32)

    def backward(self, a, b, group_sizes, d_out, want):
        d_a = self.gmm_t(d_out, b, group_sizes) if want[0] else None
        d_b = self.tgmm(a, d_out, group_sizes) if want[1] else None
        return d_a, d_b


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
    already padded to the tiles; differentiable with respect to `lhs` and `rhs` to
    every order.
    """
    return functools.partial(gmm, _MosaicProducts(fwd, dlhs, drhs, transpose_in_kernel))
