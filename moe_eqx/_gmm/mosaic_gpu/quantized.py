"""The grouped matmul on a weight kept quantized: a Mosaic GPU kernel that loads the
quantized bytes and their scales tile by tile and dequantizes each tile in the kernel,
so no float `[G, K, N]` copy of the weight exists.

The kernel is jax's `ragged_dot_mgpu.ragged_dot` (its grid, group walk and row-exact
stores) with a third pipelined input, the scales, and one more step per tile: the
quantized tile is read from shared memory into registers, converted to float32,
multiplied by its scales, cast to the activations' dtype and written to a shared-memory
tile that the tensor cores read. Each weight element is thus `(float32(q) * scale)` cast
once to the activations' dtype, the value `QuantizedArray.dequantize` gives, and the
products are those of the float kernel on the dequantized weight.

Formats: `"float8_e4m3fn"` (any `parts`) and `"int8"`. The scales reach the kernel as
one float32 row per scale block of `K` rows and one column per weight column
(`[G, ceil(K / 128), N]` for FP8's 128 x 128 blocks, `[G, 1, N]` for int8's per-column
scales): each weight tile then needs one scale row, which is broadcast over its rows.
That needs the tile's `K` extent inside one scale block, so the FP8 kernels use a
`K`-tile that divides 128 (the forward's `block_k`, the transposed `d_lhs` kernel's
`block_n`). `"mxfp4"` (two 4-bit codes per byte along `K`) goes to the backend's fallback
(`tiled`), which dequantizes one expert at a time.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..._quant import FP8_BLOCK, QuantizedArray
from .kernels import mask_rows, pad_axis
from .tiling import SMEM_BYTES, MosaicTileConfig, round_up

IN_KERNEL_FORMATS = ("float8_e4m3fn", "int8")


def dequantizes_in_kernel(w) -> bool:
    """Whether `w` is a `QuantizedArray` in a format the kernel dequantizes."""
    return isinstance(w, QuantizedArray) and w.fmt in IN_KERNEL_FORMATS


def scale_rows(w: QuantizedArray, k: int) -> int:
    """Rows of `K` that share one scale row: FP8's block, or all `k` (padded) rows
    for int8's per-column scales."""
    return FP8_BLOCK[0] if w.fmt == "float8_e4m3fn" else k


def kernel_operands(
    w: QuantizedArray, k: int, n: int
) -> tuple[Array, Float[Array, "groups scale_rows n_dim"]]:
    """The kernel's view of `w`: its values as `[G, k, n]` (zero-padded, FP8 as
    `float8_e4m3fn`) and its scales as float32 `[G, R, n]`, one row per scale block
    of `K` and one column per weight column.

    **Arguments:**

    - `w`: an FP8 or int8 `QuantizedArray` `[G, K, N]`.
    - `k`, `n`: the padded sizes, `k >= K`, `n >= N`.

    **Returns:**

    `(values, scales)`.
    """
    values = w.values
    scales = jax.lax.bitcast_convert_type(w.scales, jnp.float32)
    if w.fmt == "float8_e4m3fn":
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
        # One column per weight column, each part blocked from its own first column.
        width = w.shape[-1] // w.parts
        scales = jnp.concatenate(
            [
                jnp.repeat(part, FP8_BLOCK[1], axis=-1)[..., :width]
                for part in jnp.split(scales, w.parts, axis=-1)
            ],
            axis=-1,
        )
    values = pad_axis(pad_axis(values, 1, k), 2, n)
    # Zero scales on padded columns: their values are zero too, and 0 * 0 stays 0.
    return values, pad_axis(scales, 2, n)


def fit_to_scales(
    config: MosaicTileConfig, rows_per_scale: int, transpose_rhs: bool
) -> MosaicTileConfig:
    """`config` with its weight tile's `K` extent (`block_k`, or `block_n` for the
    transposed kernel) narrowed to 64 when it does not divide `rows_per_scale`, and
    fewer pipeline stages while the quantized tiles and the dequantized tile do not
    fit in shared memory."""
    field = "block_n" if transpose_rhs else "block_k"
    if rows_per_scale % getattr(config, field):
        config = dataclasses.replace(config, **{field: 64})
    while quantized_smem_bytes(config) > SMEM_BYTES and config.max_concurrent_steps > 2:
        config = dataclasses.replace(
            config, max_concurrent_steps=config.max_concurrent_steps - 1
        )
    return config


def quantized_smem_bytes(config: MosaicTileConfig) -> int:
    """Shared memory of one block of the quantized kernel: per stage a 16-bit `lhs`
    tile, a one-byte weight tile and a float32 scale row; the dequantized 16-bit tile;
    the 16-bit output tile."""
    c = config
    stage = (
        c.block_m * c.block_k * 2
        + c.block_k * c.block_n
        + 4 * max(c.block_k, c.block_n)
    )
    tiles = c.block_k * c.block_n * 2 + c.block_m * c.block_n * 2
    return c.max_concurrent_steps * stage + tiles


def _transposed(ref):
    # `Ref.transpose` replaced `plgpu.transpose_ref` (deprecated in jax 0.12).
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.transpose_ref(ref, (1, 0))


def quantized_ragged(
    lhs: Float[Array, "rows contracting"],
    values: Array,
    scales: Float[Array, "groups scale_rows weight_cols"],
    group_sizes: Int[Array, " groups"],
    config: MosaicTileConfig,
    transpose_rhs: bool,
    rows_per_scale: int,
) -> Float[Array, "rows cols"]:
    """`lhs_i @ w[g(i)]` (`w[g(i)]^T` when `transpose_rhs`) with the weight `w`
    dequantized tile by tile in the kernel; rows past the groups are zero.

    **Arguments:**

    - `lhs`: `[M, C]`, bfloat16 or float16; `C` a multiple of `block_k`.
    - `values`: the quantized weight `[G, K, N]` (`float8_e4m3fn` or `int8`); `C` is
        `K` (`N` when `transpose_rhs`).
    - `scales`: float32 `[G, R, N]`: the scale of weight element `(r, n)` is
        `scales[g, r // rows_per_scale, n]`.
    - `group_sizes`: `[G]` int32.
    - `config`: the tiling; its weight tile's `K` extent must divide `rows_per_scale`.
    - `transpose_rhs`: contract `N` (the `d_lhs` product) instead of `K`.
    - `rows_per_scale`: rows of `K` per scale row.

    **Returns:**

    `[M, N]` (`[M, K]` when `transpose_rhs`) in `lhs.dtype`.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import GroupInfo

    m0 = lhs.shape[0]
    c = config
    lhs = pad_axis(lhs, 0, round_up(m0, c.block_m))
    m, contracting = lhs.shape
    g, k_w, n_w = values.shape
    n = k_w if transpose_rhs else n_w
    if contracting != (n_w if transpose_rhs else k_w) or contracting % c.block_k:
        raise ValueError(
            f"`lhs` of width {contracting} does not match the weight {values.shape} "
            f"or is not a multiple of block_k={c.block_k}."
        )
    k_extent = c.block_n if transpose_rhs else c.block_k
    if rows_per_scale % k_extent:
        raise ValueError(
            f"The weight tile's K extent {k_extent} must divide the {rows_per_scale} "
            "rows of one scale block."
        )
    tile = (c.block_n, c.block_k) if transpose_rhs else (c.block_k, c.block_n)
    scale_width = tile[1]

    def body(sizes_gmem, lhs_gmem, w_gmem, s_gmem, o_gmem):
        grid_m = pl.cdiv(m, c.block_m) + g - 1
        grid_n = pl.cdiv(n, c.block_n)

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def mn_loop(loop_info):
            mi, ni = plgpu.planar_snake(
                loop_info.index[0], (grid_m, grid_n), 1, c.grid_block_n
            )
            info = GroupInfo.create(sizes_gmem, c.block_m, mi)
            if transpose_rhs:
                w_index = lambda kk: (ni, kk)  # noqa: E731
                s_index = lambda kk: (ni * c.block_n // rows_per_scale, kk)  # noqa: E731
            else:
                w_index = lambda kk: (kk, ni)  # noqa: E731
                s_index = lambda kk: (kk * c.block_k // rows_per_scale, ni)  # noqa: E731

            def acc_scope(acc_ref):
                # The interpreter cannot scope registers and shared memory together.
                pl.run_scoped(
                    lambda w_smem: pipeline(acc_ref, w_smem),
                    plgpu.SMEM(
                        tile, lhs.dtype, transforms=_transforms(plgpu, tile, lhs.dtype)
                    ),
                )
                return acc_ref[...]

            def pipeline(acc_ref, w_smem):
                def step(_, lhs_smem, q_smem, s_smem):
                    w = _dequantized(q_smem, s_smem)
                    w_smem[...] = w.astype(w_smem.dtype)
                    # The tensor cores read `w_smem` through the async proxy.
                    plgpu.commit_smem()
                    rhs = _transposed(w_smem) if transpose_rhs else w_smem
                    plgpu.wgmma(acc_ref, lhs_smem, rhs)
                    # `w_smem` is rewritten by the next step.
                    plgpu.wgmma_wait(0)

                plgpu.emit_pipeline(
                    step,
                    grid=(contracting // c.block_k,),
                    in_specs=[
                        plgpu.BlockSpec(
                            (c.block_m, c.block_k),
                            lambda kk: (info.block, kk),
                            transforms=_transforms(
                                plgpu, (c.block_m, c.block_k), lhs.dtype
                            ),
                        ),
                        plgpu.BlockSpec(
                            tile,
                            w_index,
                            transforms=_transforms(plgpu, tile, values.dtype),
                        ),
                        plgpu.BlockSpec((1, scale_width), s_index),
                    ],
                    max_concurrent_steps=c.max_concurrent_steps,
                )(lhs_gmem, w_gmem.at[info.group_id], s_gmem.at[info.group_id])

            acc = pl.run_scoped(acc_scope, plgpu.ACC((c.block_m, c.block_n)))
            _store_rows(pl, plgpu, acc, o_gmem, info, ni, c.block_m, c.block_n, m)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid=(132,),  # streaming multiprocessors of an H100/H200
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
    )
    out = kernel(group_sizes, lhs, values, scales)
    return mask_rows(out[:m0], jnp.sum(group_sizes))


def _transforms(plgpu, shape, dtype):
    """The tiling and swizzle of a shared-memory tile of `shape` and `dtype` (the
    widest swizzle its rows allow). Stated, not inferred: Mosaic GPU's layout
    inference finds none for a tile written from registers and read by WGMMA."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[1] * bits)
    return (
        plgpu.TilingTransform((8, swizzle * 8 // bits)),
        plgpu.SwizzleTransform(swizzle),
    )


def _dequantized(q_smem, s_smem):
    """The quantized tile in `q_smem` times its scale row `s_smem`, float32."""
    q = q_smem[...].astype(jnp.float32)
    return q * jax.lax.broadcast_in_dim(s_smem[0], q.shape, (1,))


def _store_rows(pl, plgpu, acc, o_gmem, info, ni, block_m, block_n, m):
    """Stores the rows of `acc` that belong to the block's group, as
    `ragged_dot_mgpu.ragged_dot` does: TMA descriptors have static sizes, so the
    `actual_size` rows go out as a ladder of power-of-two copies."""

    def copy_rows(o_smem, start, rows):
        plgpu.copy_smem_to_gmem(
            o_smem.at[pl.ds(start, rows)],
            o_gmem.at[
                pl.ds(info.block_start + start, rows), pl.ds(ni * block_n, block_n)
            ],
        )

    def store_scope(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        start = info.start_within_block
        remaining = min(block_m, m)
        while remaining > 0:
            rows = 1 << int(math.log2(remaining))
            remaining //= 2

            copy = functools.partial(copy_rows, o_smem, start, rows)
            pl.when(info.actual_size & rows != 0)(copy)
            start += info.actual_size & rows
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(store_scope, plgpu.SMEM((block_m, block_n), o_gmem.dtype))
