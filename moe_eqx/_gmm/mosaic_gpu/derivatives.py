"""The backend's differentiable grouped matmul: the kernels as the raw grouped
products of `moe_eqx._gmm._products`, which makes them differentiable to every order
(reverse over reverse included), each value a kernel call.

`gmm` is the forward kernel; `gmm_t` (`d_lhs = d_out @ rhs[g]^T`) the forward kernel
with `transpose_rhs=True` (contracting `N` against `rhs [G, K, N]` without
materialising `rhs^T`), or on a materialised `[G, N, K]` transpose; `tgmm`
(`d_rhs[g] = lhs_g^T @ d_out_g`, `[G, K, N]`) the transposed kernel. The derivatives of
each are the others, with the same tilings (a derivative has the shapes of the
forward, `d_lhs` or `d_rhs` kernel call it transposes).

A quantized `rhs` (`QuantizedArray`, FP8 or int8) goes to the kernels of `quantized`,
which dequantize it tile by tile: `gmm` and `gmm_t` take it unpadded and pad it to the
`K` and `N` the operands are padded to. It is a constant: there is no `tgmm` of it.
"""

import functools
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from ..._quant import FP8_BLOCK, QuantizedArray
from .._products import AbstractProducts, gmm
from .kernels import pad_axis, ragged, transposed_ragged
from .quantized import fit_to_scales, kernel_operands, quantized_ragged, scale_rows
from .tiling import MosaicTileConfig, padded_dims


def _quantized(a, w: QuantizedArray, group_sizes, config, transpose_rhs):
    """`a @ w[g]` (`w[g]^T` when `transpose_rhs`) with `w` padded to the operands'
    `K` and `N` and dequantized in the kernel."""
    k, n = padded_dims(*w.shape[-2:])
    if w.fmt == "float8_e4m3fn":
        config = fit_to_scales(config, FP8_BLOCK[0], transpose_rhs)
    # Mosaic GPU's layout inference fails on the kernel when its pipeline has one
    # step: the contracting dim gets zero padding up to two `block_k` tiles.
    width = max(a.shape[1], 2 * config.block_k)
    if transpose_rhs:
        n = width
    else:
        k = width
    values, scales = kernel_operands(w, k, n)
    rows = scale_rows(w, k)
    return quantized_ragged(
        pad_axis(a, 1, width), values, scales, group_sizes, config, transpose_rhs, rows
    )


class _MosaicProducts(AbstractProducts):
    fwd: MosaicTileConfig = eqx.field(static=True)
    dlhs: MosaicTileConfig = eqx.field(static=True)
    drhs: MosaicTileConfig = eqx.field(static=True)
    transpose_in_kernel: bool = eqx.field(static=True)
    # In the Pallas interpreter the kernels have effects, which the custom derivative
    # rules must declare.
    has_effects: ClassVar[bool] = True

    def gmm(self, a, b, group_sizes):
        if isinstance(b, QuantizedArray):
            return _quantized(a, b, group_sizes, self.fwd, False)
        return ragged(a, b.astype(a.dtype), group_sizes, self.fwd, False)

    def gmm_t(self, a, b, group_sizes):
        if isinstance(b, QuantizedArray):
            # Always transposed in the kernel: `b^T` would be a copy of the weight.
            return _quantized(a, b, group_sizes, self.dlhs, True)
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
