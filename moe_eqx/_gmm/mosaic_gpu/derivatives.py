"""The backend's differentiable grouped matmul: a `jax.custom_vjp` over the kernels.

Backward: `d_lhs` is the forward kernel on `d_out` with `transpose_rhs=True`
(contracting `N` against `rhs [G, K, N]` without materialising `rhs^T`), or on a
materialised `[G, N, K]` transpose; `d_rhs` is the transposed kernel,
`lhs_g^T @ d_out_g`, `[G, K, N]`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .kernels import ragged, transposed_ragged
from .tiling import MosaicTileConfig


@functools.cache
def mosaic_gmm(
    fwd: MosaicTileConfig,
    dlhs: MosaicTileConfig,
    drhs: MosaicTileConfig,
    transpose_in_kernel: bool,
):
    """The `custom_vjp` grouped matmul with these tilings (one function per tiling,
    cached, so that jit sees the same callable for the same configuration).

    **Arguments:**

    - `fwd`, `dlhs`, `drhs`: tilings of the forward, `d_lhs` and `d_rhs` kernels.
    - `transpose_in_kernel`: compute `d_lhs` with the kernel's `transpose_rhs` instead
        of materialising `rhs^T`.

    **Returns:**

    `f(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`, with `K` and `N`
    already padded to the tiles; differentiable with respect to `lhs` and `rhs`.
    """

    @jax.custom_vjp
    def mosaic(lhs, rhs, group_sizes):
        return ragged(lhs, rhs, group_sizes, fwd, False)

    def mosaic_fwd(lhs, rhs, group_sizes):
        return mosaic(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def mosaic_bwd(res, d_out):
        lhs, rhs, group_sizes = res
        d_out = d_out.astype(lhs.dtype)
        if transpose_in_kernel:
            d_lhs = ragged(d_out, rhs, group_sizes, dlhs, True)
        else:
            d_lhs = ragged(d_out, jnp.swapaxes(rhs, 1, 2), group_sizes, dlhs, False)
        d_rhs = transposed_ragged(lhs, d_out, group_sizes, drhs).astype(rhs.dtype)
        d_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
        return d_lhs, d_rhs, d_sizes

    mosaic.defvjp(mosaic_fwd, mosaic_bwd)
    return mosaic
