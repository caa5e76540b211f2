"""Grouped matmuls for many rows on TPUs (Pallas), of the library's own: megablox's
grids with the work they waste on partial tiles skipped.

`out[i] = lhs[i] @ rhs[g(i)]` for rows sorted by group. Like megablox's `gmm`, the
grid is `(N tiles, visits, K tiles)`: a visit is one `tm`-row tile of `lhs` with one
group that has rows in it, so a tile where a group ends and the next begins is
visited once per group, each visit storing its own group's rows. megablox multiplies
the whole tile at each visit and masks the store; on fine-grained MoEs (many groups
of a few hundred rows) that is up to twice the products. Here a visit multiplies only
the `chunk`-row pieces of the tile that hold its group's rows.

Also unlike megablox, tiles past the last group's rows are visited (once, with no
group): they are zeroed in the kernel, so rows past `sum(group_sizes)` come out zero
without a pass over the whole output afterwards.

Quantized weights (`moe_eqx._gmm.quantized_tpu`: int8, FP8, MXFP4) are read by
`grouped_matmul` as stored, in either orientation of its product: each visit's
weight tile is dequantized into VMEM once per group and output tile (a group's
visits follow each other, so the next reuses it), exactly as `QuantizedArray.dequantize` does, and multiplied as a float tile:
prefill reads a quarter to a half of the float weights' bytes and makes no float
copy of them.

`grouped_weight_gradient` is the third product, `lhs[rows of g]^T @ d[rows of g]`
for each group (the weights' gradient): the grid is `(K tiles, N tiles, visits)`,
each group's visits accumulating into its output block, an empty group visited once
to write its zeros; a visit masks and multiplies only the chunks its group has rows
in. Each group's finished block is copied to the output by the kernel's own DMA,
which runs while the next groups' products are computed (`write_behind`): the
pipeline's own write of an output block held up the visit after it.

`_GroupedProducts` makes them the three products of `moe_eqx._gmm._products`, which
`PallasTPUGMM` (`gmm_backend="auto"` on a TPU) takes for many rows.
`benchmarks/tpu_gmm.py` measures them against megablox and `lax.ragged_dot`;
`tests/test_grouped_tpu.py` and `tests/test_grouped_tpu_quantized.py` test them
in Pallas' interpreter, values and derivatives of every order, every stored byte of
each quantized format.

Scoped VMEM: each call asks Mosaic for the room its double-buffered tiles take
(Mosaic's default scoped limit stops tiles past about `(512, 2048, 768)`), up to a
cap; tiles that would need more (float32, very wide experts) are made smaller.
"""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from .._quant import FP8_BLOCK, MXFP4_BLOCK, QuantizedArray, as_float, is_quantized
from ._products import AbstractProducts
from .megablox import _mb  # megablox's visit schedule (`make_group_metadata`)
from .quantized_tpu import (
    KERNEL_FORMATS,
    bfloat16_pairs,
    column_scales,
    dequantize_rows,
    fp4_pair,
    in_kernel,
    mxfp4_half_scales,
    mxfp4_operands,
)


def _row_tile(dtype) -> int:
    return 16 if jnp.dtype(dtype).itemsize == 2 else 8


def _product(a, b, contract: tuple[int, int]):
    """`a` and `b` contracted over the given axes in a kernel, float32 accumulation,
    at an explicit precision: `jax_default_matmul_precision` must not reach the
    kernel (Mosaic rejects a float32 contract precision on 16-bit operands)."""
    wide = a.dtype == jnp.float32
    return jax.lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=jax.lax.Precision.HIGHEST if wide else jax.lax.Precision.DEFAULT,
        preferred_element_type=jnp.float32,
    )


def _divisor(t: int, axis: int) -> int:
    """The largest multiple of 128 at most `t` that divides `axis` (the whole axis
    where `t` covers it or none does)."""
    for c in range(t - t % 128, 0, -128) if t < axis else ():
        if axis % c == 0:
            return c
    return axis


# The default tiles `(tm, tk, tn)` of the two `gmm` products and of the weights'
# gradient, and the rows a visit multiplies at a time: the fastest measured on a v5e
# (`benchmarks/tpu_gmm.py`, Qwen3-like experts).
GMM_TILES = (512, 4096, 1536)
TGMM_TILES = (512, 4096, 768)
CHUNK = 128

# The most scoped VMEM a call asks Mosaic for (below a v5e core's whole VMEM).
_VMEM_CAP = 100 << 20


def _vmem_need(blocks, scratches: int = 1) -> int:
    """Bytes of VMEM for the double-buffered `blocks` (`(shape, dtype)`, the
    `scratches` last, single) with room for the product's temporaries."""
    sizes = [jnp.dtype(dt).itemsize * math.prod(shape) for shape, dt in blocks]
    buffered, scratch = sizes[:-scratches], sizes[-scratches:]
    return 2 * sum(buffered) + 2 * sum(scratch) + (8 << 20)


def _fit(
    tiles,
    chunk,
    m: int,
    k: int,
    n: int,
    dtype,
    blocks,
    partial_n: bool = False,
    scratches: int = 1,
    whole_k: bool = False,
    whole_n: bool = False,
):
    """`(tm, tk, tn, chunk, padded rows)`: the rows cut down to a multiple of the
    dtype's row tile, `tk` and `tn` to the largest multiple of 128 that divides
    their axis (or the whole axis; always the whole `k` with `whole_k`, the whole
    `n` with `whole_n`); then,
    while the VMEM of `blocks(tm, tk, tn)` (the last `scratches` of them single)
    is more than a call may ask for, the largest of the three made smaller (to the
    next dividing multiple of 128; the rows halved). The chunk is the whole row
    tile unless it divides it."""
    tm, tk, tn = tiles
    rt = _row_tile(dtype)
    tm = min(tm, -(-m // rt) * rt)
    if partial_n:  # any multiple of 128 (the last tile may overhang), or all
        tn = n if tn >= n or tn < 128 else tn - tn % 128
        tk = _divisor(tk, k)
    else:
        tk, tn = _divisor(tk, k), _divisor(tn, n)
    if whole_k:
        tk = k
    if whole_n:
        tn = n
    while _vmem_need(blocks(tm, tk, tn), scratches) > _VMEM_CAP:
        smaller = {  # each tile's next smaller size, where it has one
            "tn": (max(128, (tn - 1) // 128 * 128) if tn > 128 else tn)
            if partial_n
            else tn
            if whole_n
            else _divisor(tn - 128, n),
            "tk": tk if whole_k else _divisor(tk - 128, k),
            "tm": max(rt, tm // 2 // rt * rt),
        }
        now = {"tn": tn, "tk": tk, "tm": tm}
        can = [t for t in now if smaller[t] < now[t]]
        if not can:
            break  # the smallest tiles: Mosaic says what does not fit
        cut = max(can, key=lambda t: now[t])  # the largest first
        tn, tk, tm = (smaller[t] if t == cut else now[t] for t in ("tn", "tk", "tm"))
    ch = tm if chunk is None or chunk >= tm or tm % chunk else chunk
    return tm, tk, tn, ch, -(-max(m, 1) // tm) * tm


def _params(semantics, need: int):
    """Compiler parameters asking for `need` bytes of scoped VMEM (at least 32
    MiB; Mosaic's default limit stops tiles past about `(512, 2048, 768)`)."""
    return pltpu.CompilerParams(
        dimension_semantics=semantics,
        vmem_limit_bytes=min(max(need, 32 << 20), _VMEM_CAP),
    )


def _rows(offsets, group, tile, tm: int):
    """The first and past-the-last rows of `group` within row tile `tile`, clipped
    to the tile (equal where it has none)."""
    lo = jnp.clip(offsets[group] - tile * tm, 0, tm)
    return lo, jnp.clip(offsets[group + 1] - tile * tm, 0, tm)


def _metadata(group_sizes, m: int, tm: int, visit_empty_groups: bool):
    """megablox's `make_group_metadata` for all the groups (its index arithmetic
    mixes booleans and integers: standard promotion)."""
    with jax.numpy_dtype_promotion("standard"):
        return _mb.make_group_metadata(
            group_sizes=group_sizes,
            m=m,
            tm=tm,
            start_group=jnp.zeros((), jnp.int32),
            num_nonzero_groups=group_sizes.shape[0],
            visit_empty_groups=visit_empty_groups,
        )


def _mxfp4_tile(values: Array, scales: Array, kn: bool, first: int = 0) -> Array:
    """Part of an MXFP4 weight dequantized to bfloat16, `[K, c]` columns from their
    rows of stored bytes `values` `[c, K / 2]` and scale bytes `scales`
    `[c, K / 32]`; or (`kn`, the transposed orientation) rows `2 first :
    2 (first + r)`, `[2 r, c]`, from the bytes `values` `[r, c]` (rows
    `first : first + r` of `[K / 2, c]`) and all of the columns' scale bytes
    `scales` `[K / 32, c]` (normal scales: `[2, 254]`).

    Each value is a code of two significant bits times a power of two, exact in
    bfloat16 (infinite where it overflows, as in float32), so its bfloat16 bits are
    the top half of its float32 bits. A byte's two values (rows `2 j` and
    `2 j + 1` of the weight) go into the two halves of one 32-bit word, the words
    are laid along the weight's rows (transposed to `[K / 2, c]`, unless `kn`: the
    bytes already lie that way), and a bitcast to bfloat16 unpacks each word into
    two consecutive rows: the weight in its own row order, so that the rows it
    multiplies are read as they are (no even / odd split of them)."""
    scale = mxfp4_half_scales(
        scales,
        values.shape[0 if kn else 1],
        lambda a, b: _product(a, b, (1, 0)),
        rows_first=kn,
        first=first,
    )
    low, high = fp4_pair(values.astype(jnp.int32), scale)
    words = bfloat16_pairs(low, high)
    return pltpu.bitcast(words if kn else words.T, jnp.bfloat16)


def _schedule(group_sizes, m: int, tm: int):
    """`(offsets, groups, tiles, visits)`: each visit's group and row tile, in
    order, then one visit with no group (group `G`) for each tile past the groups'
    rows; `offsets` `[G + 2]` the groups' first rows (the no-group's range empty)."""
    num_groups = group_sizes.shape[0]
    tiles_m = m // tm
    (offsets, groups, tiles), visited = _metadata(
        group_sizes, m, tm, visit_empty_groups=False
    )
    length = 2 * tiles_m + num_groups
    i = jnp.arange(length, dtype=jnp.int32)
    groups = jnp.pad(groups, (0, length - groups.shape[0]))
    tiles = jnp.pad(tiles, (0, length - tiles.shape[0]))
    last = jnp.where(visited > 0, tiles[jnp.maximum(visited - 1, 0)], -1)
    past = i >= visited
    groups = jnp.where(past, num_groups, groups).astype(jnp.int32)
    tiles = jnp.where(past, last + 1 + i - visited, tiles).astype(jnp.int32)
    total = offsets[-1]
    offsets = jnp.concatenate([offsets, total[None]]).astype(jnp.int32)
    visits = visited + tiles_m - 1 - last
    return offsets, groups, tiles, visits


def grouped_matmul(
    lhs: Float[Array, "rows k_dim"],
    rhs: Float[Array, "groups _ _"] | QuantizedArray,  # [G, K, N] ([G, N, K]^T)
    group_sizes: Int[Array, " groups"],
    *,
    tiles: tuple[int, int, int] = GMM_TILES,
    chunk: int | None = CHUNK,
    transpose_rhs: bool = False,
    overhang_rows: bool = True,
    interpret: bool = False,
) -> Float[Array, "rows n_dim"]:
    """`lhs[i] @ rhs[g(i)]` (see the module).

    **Arguments:**

    - `lhs`: `[M, K]` rows sorted by group.
    - `rhs`: `[G, K, N]`, or `[G, N, K]` with `transpose_rhs`; or a
        [`moe_eqx.QuantizedArray`][] (its logical shape as a float `rhs`'s) in a
        format of `KERNEL_FORMATS` (int8, FP8, MXFP4): its stored bytes are read,
        each visit's tile dequantized in VMEM to `lhs.dtype` exactly as
        `QuantizedArray.dequantize` does, once per group and output tile (the
        visits of one group follow each other); MXFP4 takes the weight's whole
        `K` a tile (the contraction, or the output columns with `transpose_rhs`)
        and its scale bytes in `[2, 254]` (the caller's check).
    - `group_sizes`: `[G]` int32, `sum <= M`.
    - `tiles`: `(tm, tk, tn)`, each cut down to its axis; `tk` and `tn` to the
        largest multiple of 128 that divides `K` and `N` (else the whole axis),
        and all three made smaller where their VMEM would pass the cap.
    - `chunk`: the rows a visit multiplies at a time, skipping the pieces its
        group has no row in (`None`: the whole tile, as megablox).
    - `transpose_rhs`: multiply by `rhs[g]^T` (the input's gradient).
    - `overhang_rows`: where `M` is not a multiple of the row tile (and at least
        one tile), the last row tile overhangs `lhs` and the output (its rows past
        `M` neither stored nor read into a stored row) instead of `lhs` padded to a
        multiple and the output sliced back: two copies fewer. (`False`: padded,
        as megablox does.)
    - `interpret`: run in Pallas' interpreter (any platform).

    **Returns:**

    `[M, N]` in `lhs.dtype`, accumulated in float32; rows past `sum(group_sizes)`
    are zero.
    """
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    dtype = lhs.dtype
    fmt = rhs.fmt if is_quantized(rhs) else None
    if fmt is not None and not in_kernel(rhs):
        raise ValueError(
            "A quantized `rhs` is read in the kernel only in the formats "
            f"{KERNEL_FORMATS} (got {fmt!r}): dequantize it first."
        )

    def weight_tile(tk, tn):
        """The rows and columns of the weight's own `[K, N]` in a visit's tile."""
        return (tn, tk) if transpose_rhs else (tk, tn)

    # The kernel's operands: the rows, the weights as stored, and the VMEM tiles
    # each visit multiplies (a quantized weight's dequantized there).
    kn = False
    if fmt == "mxfp4":  # `[G, N, K / 2]` and `[G, N, K / 32]`, or swapped (`kn`)
        values, kn = mxfp4_operands(rhs)
        mx_scales = jnp.swapaxes(rhs.scales, 1, 2) if kn else rhs.scales
        weights = [values, mx_scales]
    elif fmt is not None:  # values `[G, K, N]`, float32 scales `[G, R, N]`
        scales = column_scales(rhs, *rhs.shape[1:])
        weights = [rhs.values, scales]
    else:
        weights = [rhs]

    def blocks(tm, tk, tn):  # the rows, the weights, out, the accumulator, tile
        if fmt is None:
            stored = [((tk, tn), rhs.dtype)]
        elif fmt == "mxfp4":
            wk, wn = weight_tile(tk, tn)
            pair = [(wk // 2, wn), (wk // MXFP4_BLOCK, wn)]
            if not kn:
                pair = [shape[::-1] for shape in pair]
            stored = [(shape, jnp.int8) for shape in pair]
        else:
            wk, wn = weight_tile(tk, tn)
            stored = [((wk, wn), jnp.int8), ((scales.shape[1], wn), jnp.float32)]
        tile = [] if fmt is None else [(weight_tile(tk, tn), dtype)]
        return [
            ((tm, tk), dtype),
            *stored,
            ((tm, tn), dtype),
            ((tm, tn), jnp.float32),
            *tile,
        ]

    scratches = 1 if fmt is None else 2
    tm, tk, tn, ch, mp = _fit(
        tiles,
        chunk,
        m,
        k,
        n,
        dtype,
        blocks,
        scratches=scratches,
        # (MXFP4: each weight row's bytes and scale bytes whole.)
        whole_k=fmt == "mxfp4" and not transpose_rhs,
        whole_n=fmt == "mxfp4" and transpose_rhs,
    )
    overhang = overhang_rows and m >= tm
    if not overhang:
        lhs = jnp.pad(lhs, ((0, mp - m), (0, 0)))
    offsets, groups, row_tiles, visits = _schedule(
        group_sizes.astype(jnp.int32), mp, tm
    )
    num_k = k // tk
    contract = (1, 1 if transpose_rhs else 0)

    def dequantize(j, kk, w_refs, tile):
        """The visit's weight tile into `tile` (`[wk, wn]` of the weight's own
        `[K, N]`), 128 rows (MXFP4: 128 columns, or 256 rows where it is stored
        transposed) at a time: the temporaries of a block stay small."""
        v, sc = w_refs
        wk, wn = weight_tile(tk, tn)
        if kn:
            for r0 in range(0, wk // 2, 128):
                size = min(128, wk // 2 - r0)
                rows = _mxfp4_tile(v[pl.ds(r0, size), :], sc[...], True, r0)
                tile[pl.ds(2 * r0, 2 * size), :] = rows.astype(dtype)
            return
        if fmt == "mxfp4":
            for c0 in range(0, wn, 128):
                cols = pl.ds(c0, min(128, wn - c0))
                columns = _mxfp4_tile(v[cols, :], sc[cols, :], False)
                tile[:, cols] = columns.astype(dtype)
            return
        first = j if transpose_rhs else kk  # the tile's first row of `K`, in tiles
        for r0 in range(0, wk, FP8_BLOCK[0]):
            rows = pl.ds(r0, min(FP8_BLOCK[0], wk - r0))
            if fmt == "int8":
                scale = sc[...]
            else:  # the columns' scales in this 128-row block of `K`
                block = first * (wk // FP8_BLOCK[0]) + r0 // FP8_BLOCK[0]
                scale = sc[pl.ds(block, 1), :]
            tile[rows, :] = dequantize_rows(fmt, dtype, v[rows, :], scale)

    def kernel(offsets, groups, row_tiles, lhs, *refs):
        w_refs, (out, acc, *tile_refs) = refs[: len(weights)], refs[len(weights) :]
        j, v, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        group, tile = groups[v], row_tiles[v]
        lo, hi = _rows(offsets, group, tile, tm)
        first = (v == 0) | (row_tiles[jnp.maximum(v - 1, 0)] != tile)

        @pl.when((kk == 0) & first)
        def _():
            out[...] = jnp.zeros(out.shape, out.dtype)

        if fmt is None:
            (tile_now,) = w_refs
        else:
            # Dequantized once per group and output tile: consecutive visits of
            # one group (its row tiles, in order) reuse the tile. `held` is the
            # group whose tile is in VMEM (none at an output tile's first visit).
            tile_now, held = tile_refs

            @pl.when((v == 0) & (kk == 0))
            def _():
                held[0] = -1

            stale = held[0] != group
            if num_k > 1:  # a tile of `K` per step: each step's own
                stale = True

            @pl.when((hi > lo) & stale)
            def _():
                dequantize(j, kk, w_refs, tile_now)
                held[0] = group

        last = kk == pl.num_programs(2) - 1

        def piece(c0, size):  # rows c0 : c0 + size of the tile
            rows = pl.ds(c0, size)

            @pl.when(kk == 0)
            def _():
                acc[rows, :] = jnp.zeros((size, tn), jnp.float32)

            acc[rows, :] += _product(lhs[rows, :], tile_now[...], contract)
            whole = (lo <= c0) & (hi >= c0 + size)  # every row the group's

            @pl.when(last & whole)
            def _():
                out[rows, :] = acc[rows, :].astype(out.dtype)

            @pl.when(last & ~whole)
            def _():
                row = jax.lax.broadcasted_iota(jnp.int32, (size, tn), 0) + c0
                mine = (row >= lo) & (row < hi)
                out[rows, :] = jnp.where(
                    mine, acc[rows, :].astype(out.dtype), out[rows, :]
                )

        # A tile all of whose rows are the group's is one product; a shared one is
        # multiplied a chunk at a time, the chunks with none of its rows skipped.
        full = (lo == 0) & (hi == tm)
        pl.when(full | ((ch == tm) & (hi > lo)))(lambda: piece(0, tm))
        for c0 in range(0, tm, ch) if ch < tm else ():
            some = (lo < c0 + ch) & (hi > c0)
            pl.when(~full & some)(lambda c0=c0: piece(c0, ch))

    def lhs_map(j, v, kk, offsets, groups, row_tiles):
        return row_tiles[v], kk

    def weight_map(transposed):
        def index(j, v, kk, offsets, groups, row_tiles):
            group = jnp.minimum(groups[v], g - 1)  # the no-group visits: the last
            return (group, j, kk) if transposed else (group, kk, j)

        return index

    def scale_map(j, v, kk, offsets, groups, row_tiles):  # int8's and FP8's
        return jnp.minimum(groups[v], g - 1), 0, kk if transpose_rhs else j

    def out_map(j, v, kk, offsets, groups, row_tiles):
        return row_tiles[v], j

    shapes = blocks(tm, tk, tn)
    if fmt == "mxfp4":
        # (The weight's `K` is whole: its block index is 0, the grid axis of its
        # `N` the other one.)
        weight_specs = [
            pl.BlockSpec((None, *shape), weight_map((not kn) != transpose_rhs))
            for shape, _ in shapes[1:3]
        ]
    elif fmt is not None:
        weight_specs = [
            pl.BlockSpec((None, *shapes[1][0]), weight_map(transpose_rhs)),
            pl.BlockSpec((None, *shapes[2][0]), scale_map),
        ]
    else:
        rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
        weight_specs = [pl.BlockSpec(rhs_block, weight_map(transpose_rhs))]
    scratch = [pltpu.VMEM((tm, tn), jnp.float32)]
    if fmt is not None:
        scratch += [pltpu.VMEM(weight_tile(tk, tn), dtype), pltpu.SMEM((1,), jnp.int32)]
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m if overhang else mp, n), dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(n // tn, visits, num_k),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), *weight_specs],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=scratch,
        ),
        compiler_params=_params(
            ("parallel", "arbitrary", "arbitrary"), _vmem_need(shapes, scratches)
        ),
        interpret=interpret,
    )
    out = call(offsets, groups, row_tiles, lhs, *weights)
    return out if overhang else out[:m]


def grouped_weight_gradient(
    lhs: Float[Array, "rows k_dim"],
    d: Float[Array, "rows n_dim"],
    group_sizes: Int[Array, " groups"],
    *,
    tiles: tuple[int, int, int] = TGMM_TILES,
    chunk: int | None = CHUNK,
    out_dtype=None,
    partial_columns: bool | None = None,
    overhang_rows: bool = True,
    write_behind: bool = True,
    interpret: bool | pltpu.InterpretParams = False,
) -> Float[Array, "groups k_dim n_dim"]:
    """`lhs[rows of g]^T @ d[rows of g]` for each group `g` (see the module).

    **Arguments:**

    - `lhs`: `[M, K]`, `d`: `[M, N]`, rows sorted by group.
    - `group_sizes`: `[G]` int32, `sum <= M` (rows past it belong to no group).
    - `tiles`: `(tm, tk, tn)`, as `grouped_matmul`'s.
    - `chunk`: the rows a visit multiplies at a time (`None`: the whole tile).
    - `out_dtype`: the result's dtype (default `lhs.dtype`), accumulated in float32.
    - `partial_columns`: `tn` need not divide `N`: the last column tile overhangs
        the output (its columns past `N` are neither read into a result nor
        stored), instead of `tn` cut to a divisor of `N`. Default (`None`): where
        the largest dividing tile is under half of `tn` (`N = 2816`, a DeepSeek-V2-
        Lite-like gate+up: 256 columns a tile instead of 768).
    - `overhang_rows`: as `grouped_matmul`'s (rows past `M` are masked out of
        every product, as rows of no group are).
    - `write_behind`: each group's result is copied out by a DMA of the kernel's
        own, started as its last visit ends and waited for two groups later (two
        staging buffers), so that it runs while the next groups' products are
        computed. `False`: the pipeline's own write of the output block, which
        the next visit waits for.
    - `interpret`: run in Pallas' interpreter (`True`, or a
        `pltpu.InterpretParams` for its TPU interpreter, which models the DMAs).

    **Returns:**

    `[G, K, N]`; an empty group's is zero.
    """
    m, k = lhs.shape
    n = d.shape[1]
    if partial_columns is None:
        want = min(tiles[2], n)
        partial_columns = _divisor(want, n) < want // 2
    g = group_sizes.shape[0]
    out_dtype = lhs.dtype if out_dtype is None else out_dtype

    def blocks(tm, tk, tn):  # lhs, d, out, the accumulator
        return [
            ((tm, tk), lhs.dtype),
            ((tm, tn), d.dtype),
            ((tk, tn), out_dtype),
            ((tk, tn), jnp.float32),
        ]

    tm, tk, tn, ch, mp = _fit(
        tiles, chunk, m, k, n, lhs.dtype, blocks, partial_n=partial_columns
    )
    if not (overhang_rows and m >= tm):
        lhs = jnp.pad(lhs, ((0, mp - m), (0, 0)))
        d = jnp.pad(d, ((0, mp - m), (0, 0)))
    (offsets, groups, row_tiles), visits = _metadata(
        group_sizes.astype(jnp.int32), mp, tm, visit_empty_groups=True
    )

    def kernel(offsets, groups, row_tiles, lhs, d, out, acc, *staging):
        v, last = pl.program_id(2), pl.num_programs(2) - 1
        group, tile = groups[v], row_tiles[v]
        lo, hi = _rows(offsets, group, tile, tm)
        new = (v == 0) | (groups[jnp.maximum(v - 1, 0)] != group)
        done = (v == last) | (groups[jnp.minimum(v + 1, last)] != group)

        @pl.when(new)
        def _():
            acc[...] = jnp.zeros(acc.shape, acc.dtype)

        def piece(c0, size, masked):  # rows c0 : c0 + size of the tile
            rows = pl.ds(c0, size)
            a, b = lhs[rows, :], d[rows, :]
            if masked:  # both: another group's rows (or none's) may hold NaN
                row = jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0) + c0
                mine = (row >= lo) & (row < hi)
                a = jnp.where(mine, a, jnp.zeros((), a.dtype))
                b = jnp.where(mine, b, jnp.zeros((), b.dtype))
            acc[...] += _product(a, b, (0, 0))

        # As in `grouped_matmul`: a tile of the group's rows only is one product,
        # unmasked; a shared one a chunk at a time, masked where the chunk is shared.
        full = (lo == 0) & (hi == tm)
        pl.when(full)(lambda: piece(0, tm, False))
        for c0 in range(0, tm, ch):
            some = (lo < c0 + ch) & (hi > c0)
            whole = (lo <= c0) & (hi >= c0 + ch)
            pl.when(~full & whole)(lambda c0=c0: piece(c0, ch, False))
            pl.when(~full & some & ~whole)(lambda c0=c0: piece(c0, ch, True))

        if write_behind:
            _write_behind(out, acc, *staging, group, done, v == last, tk, tn, n, g)
        else:

            @pl.when(done)
            def _():
                out[...] = acc[...].astype(out.dtype)

    def lhs_map(i, j, v, offsets, groups, row_tiles):
        return row_tiles[v], i

    def d_map(i, j, v, offsets, groups, row_tiles):
        return row_tiles[v], j

    def out_map(i, j, v, offsets, groups, row_tiles):
        return groups[v], i, j

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(k // tk, -(-n // tn), visits),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), d_map)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY)
            if write_behind
            else pl.BlockSpec((None, tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)]
            + (
                [pltpu.VMEM((2, tk, tn), out_dtype), pltpu.SemaphoreType.DMA((2,))]
                if write_behind
                else []
            ),
        ),
        compiler_params=_params(
            ("parallel", "parallel", "arbitrary"), _vmem_need(blocks(tm, tk, tn))
        ),
        interpret=interpret,
    )
    return call(offsets, groups, row_tiles, lhs, d)


def _write_behind(out, acc, stage, sems, group, done, end, tk, tn, n, num_groups):
    """`grouped_weight_gradient`'s `write_behind`: at a group's last visit, its
    accumulator into staging buffer `group % 2` and a DMA of it to `out[group]`
    (in HBM) started; first the wait for the copy that buffer held (group
    `group - 2`'s), and at the column tile's last visit the waits for the copies
    still running. Every group is visited, in order, in each column tile's sweep.
    The last column tile may overhang `n`: its copies take its columns below `n`
    (their static width under a branch)."""
    i, j = pl.program_id(0), pl.program_id(1)
    last_j, rest = divmod(n, tn)

    def copy(grp, slot, width):
        return pltpu.make_async_copy(
            stage.at[slot] if width == tn else stage.at[slot, :, pl.ds(0, width)],
            out.at[grp, pl.ds(i * tk, tk), pl.ds(j * tn, width)],
            sems.at[slot],
        )

    def each_width(fn):  # fn(width of this column tile's copies)
        if not rest:
            fn(tn)
        else:
            pl.when(j == last_j)(lambda: fn(rest))
            pl.when(j != last_j)(lambda: fn(tn))

    slot = jax.lax.rem(group, 2)

    @pl.when(done)
    def _():
        @pl.when(group >= 2)
        def _():
            each_width(lambda w: copy(group - 2, slot, w).wait())

        stage[slot] = acc[...].astype(stage.dtype)
        each_width(lambda w: copy(group, slot, w).start())

    @pl.when(end)
    def _():
        each_width(lambda w: copy(group, slot, w).wait())
        if num_groups > 1:
            each_width(lambda w: copy(group - 1, 1 - slot, w).wait())


class _GroupedProducts(AbstractProducts):
    """The three products of `moe_eqx._gmm._products` on these kernels, at `tiles`
    (`(tm, tk, tn)` for `gmm` and `gmm_t`, and for `tgmm`), `chunk` rows a visit;
    `tgmm_partial` and `tgmm_write_behind` are `grouped_weight_gradient`'s
    `partial_columns` and `write_behind`, and `overhang_rows` both kernels'."""

    tiles: tuple[int, int, int] = eqx.field(static=True, default=GMM_TILES)
    tgmm_tiles: tuple[int, int, int] = eqx.field(static=True, default=TGMM_TILES)
    chunk: int | None = eqx.field(static=True, default=CHUNK)
    tgmm_partial: bool | None = eqx.field(static=True, default=None)
    overhang_rows: bool = eqx.field(static=True, default=True)
    tgmm_write_behind: bool = eqx.field(static=True, default=True)
    interpret: bool = eqx.field(static=True, default=False)
    has_effects: ClassVar[bool] = False

    def _gmm(self, a, b, group_sizes, transpose):
        if is_quantized(b) and not in_kernel(b):
            b = as_float(b, a.dtype)
        return grouped_matmul(
            a,
            b if is_quantized(b) else b.astype(a.dtype),
            group_sizes,
            tiles=self.tiles,
            chunk=self.chunk,
            transpose_rhs=transpose,
            overhang_rows=self.overhang_rows,
            interpret=self.interpret,
        )

    def gmm(self, a, b, group_sizes):
        return self._gmm(a, b, group_sizes, False)

    def gmm_t(self, a, b, group_sizes):
        return self._gmm(a, b, group_sizes, True)

    def tgmm(self, a, d, group_sizes, out=jnp.float32):
        return grouped_weight_gradient(
            a,
            d.astype(a.dtype),
            group_sizes,
            tiles=self.tgmm_tiles,
            chunk=self.chunk,
            out_dtype=out,
            partial_columns=self.tgmm_partial,
            overhang_rows=self.overhang_rows,
            write_behind=self.tgmm_write_behind,
            interpret=self.interpret,
        )

    def backward(self, a, b, group_sizes, d_out, want):
        d_a = self.gmm_t(d_out, b, group_sizes) if want[0] else None
        # The weights' gradient written in their dtype from the float32 accumulator.
        d_b = self.tgmm(a, d_out, group_sizes, b.dtype) if want[1] else None
        return d_a, d_b
