"""`MosaicGPUGMM`: the Equinox backend that picks tilings, pads and calls the
differentiable grouped matmul of `derivatives`."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..._activation import SWIGLU, AbstractActivation
from ..._quant import QuantizedArray, QuantizedWeight, is_quantized
from ..._rules import match_varying
from .._base import (
    AbstractGMMBackend,
    GradAcc,
    gmm_ffn,
    two_products,
)
from ..tiled import TiledGMM
from .derivatives import mosaic_gmm
from .kernels import pad_axis
from .quantized import dequantizes_in_kernel
from .tiling import KERNELS, MosaicTileConfig, config_is_valid, padded_dims
from .tuning import lookup_tile_config

# WGMMA takes 16-bit inputs; float32 would silently run as TF32.
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class MosaicGPUGMM(AbstractGMMBackend):
    """Grouped matmul on Hopper GPUs with the Pallas Mosaic GPU ragged-dot kernels.

    Pads `K` and `N` to multiples of 64 and the rows to the row tile when needed, masks
    rows past `sum(group_sizes)` to zero, and has its own backward. Inputs that are not
    bfloat16/float16 go to `fallback` (default `TiledGMM()`), since WGMMA would run
    float32 as TF32.

    FP8 and int8 [`moe_eqx.QuantizedArray`][] weights of `ffn` stay quantized: the
    kernels load their bytes and scales and dequantize each weight tile to the
    activations' dtype (no float copy of the weight), with the `d_lhs` kernel always
    transposing in the kernel. The FP8 kernels use weight tiles whose `K` extent
    divides the 128-row scale blocks (`block_k`, and the `d_lhs` kernel's `block_n`,
    narrowed to 64 where needed). Other quantized weights (MXFP4, or any with
    `grad_acc`) go to `fallback`, which dequantizes one expert at a time, so no float
    copy of all the experts exists on this path either.

    **Arguments:**

    - `fwd_config`, `dlhs_config`, `drhs_config`: explicit tilings of the forward,
        `d_lhs` and `d_rhs` kernels; `None` looks them up (tuning table, then the
        heuristic `default_tile_config`).
    - `transpose_in_kernel`: compute `d_lhs` with the kernel's `transpose_rhs` (no
        copy of `rhs`); `False` materialises `rhs^T` as `[G, N, K]` first.
    - `fallback`: the backend used for other dtypes, and for quantized weights the
        kernels do not dequantize.
    """

    fwd_config: MosaicTileConfig | None = eqx.field(static=True, default=None)
    dlhs_config: MosaicTileConfig | None = eqx.field(static=True, default=None)
    drhs_config: MosaicTileConfig | None = eqx.field(static=True, default=None)
    transpose_in_kernel: bool = eqx.field(static=True, default=True)
    fallback: AbstractGMMBackend = eqx.field(static=True, default=TiledGMM())

    def configs(
        self, m: int, k: int, n: int, g: int, dtype
    ) -> tuple[MosaicTileConfig, MosaicTileConfig, MosaicTileConfig]:
        """The (forward, `d_lhs`, `d_rhs`) tilings this backend uses for a gmm of
        `[m, k] @ [g, k, n]` (`k`, `n` rounded up to multiples of 64)."""
        k, n = padded_dims(k, n)
        explicit = (self.fwd_config, self.dlhs_config, self.drhs_config)
        out = []
        for kernel, config in zip(KERNELS, explicit, strict=True):
            if config is None:
                config = lookup_tile_config(kernel, m, k, n, g, dtype)
            elif not config_is_valid(
                kernel, config, m, k, n, jnp.dtype(dtype).itemsize
            ):
                raise ValueError(
                    f"`{kernel}_config` {config} does not fit m={m}, k={k}, n={n}."
                )
            out.append(config)
        return out[0], out[1], out[2]

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        if lhs.dtype not in _SUPPORTED_DTYPES or rhs.dtype != lhs.dtype:
            return self.fallback(lhs, rhs, group_sizes)
        with jax.named_scope("moe_eqx.gmm.mosaic_gpu"):
            m, k = lhs.shape
            g, _, n = rhs.shape
            kp, np_ = padded_dims(k, n)
            fwd, dlhs, drhs = self.configs(m, k, n, g, lhs.dtype)
            fn = mosaic_gmm(fwd, dlhs, drhs, self.transpose_in_kernel)
            # Zero padding of K and N changes no product; sliced off again below.
            lhs_p = pad_axis(lhs, 1, kp)
            rhs_p = pad_axis(pad_axis(rhs, 1, kp), 2, np_)
            lhs_p, rhs_p, sizes = match_varying(
                lhs_p, rhs_p, group_sizes.astype(jnp.int32)
            )
            return fn(lhs_p, rhs_p, sizes)[:, :n]

    def _quantized_gmm(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: QuantizedArray,
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        """`__call__` on a weight the kernels dequantize tile by tile."""
        with jax.named_scope("moe_eqx.gmm.mosaic_gpu"):
            m, k = lhs.shape
            g, _, n = rhs.shape
            kp, _ = padded_dims(k, n)
            fwd, dlhs, drhs = self.configs(m, k, n, g, lhs.dtype)
            fn = mosaic_gmm(fwd, dlhs, drhs, self.transpose_in_kernel)
            lhs_p, rhs, sizes = match_varying(
                pad_axis(lhs, 1, kp), rhs, group_sizes.astype(jnp.int32)
            )
            return fn(lhs_p, rhs, sizes)[:, :n]

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
        if x.dtype not in _SUPPORTED_DTYPES:
            return self.fallback.ffn(
                x, w_gate_up, w_down, group_sizes, grad_acc, activation=activation
            )
        weights = (w_gate_up, w_down)
        if any(is_quantized(w) for w in weights):
            if grad_acc is None and all(dequantizes_in_kernel(w) for w in weights):
                return two_products(
                    self._quantized_gmm, x, w_gate_up, w_down, group_sizes, activation
                )
            # Dequantizing the whole weight before the kernels would hold a float
            # copy of every expert; the fallback holds one expert's at a time.
            return self.fallback.ffn(
                x, w_gate_up, w_down, group_sizes, grad_acc, activation=activation
            )
        return gmm_ffn(self, x, w_gate_up, w_down, group_sizes, grad_acc, activation)
