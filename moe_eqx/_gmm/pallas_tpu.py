"""`PallasTPUGMM`: the TPU's grouped matmul. For many rows (training, prefill)
the library's own grouped kernels (`moe_eqx._gmm.grouped_tpu`, `_TrainingProducts`;
quantized weights read as stored, forward and the input's gradient);
for few rows (decode steps) a Pallas TPU kernel of its own,
which reads each touched expert's weight once, quantized weights as they are stored
(the rest of this module).

A decode step is bound by reading expert weights. `lax.ragged_dot` (and any whole
dequantization) reads every expert's matrix however few rows there are; this kernel
reads only the experts that have rows, and a quantized expert's stored bytes only,
dequantized tile by tile in VMEM.

The grid is `(N tiles, touched experts)`. The touched experts' ids (at most
`min(G, M)`, padded by repeating the last, so that a padded step's weight block is
the one already loaded and no copy is made) are prefetched to scalar memory and
select each step's weight block. All `M` rows (a few dozen) stay in VMEM; each step
multiplies all of them by its expert's tile and keeps the rows of that expert, so an
expert's weight passes through the matrix unit once. Each format's tile is
dequantized exactly as [`moe_eqx.QuantizedArray.dequantize`][] does (float32
arithmetic, one rounding to the activations' dtype; MXFP4 where its tile is whole
words: the same values' bfloat16 bits built by integer operations on whole words,
`quantized_tpu.fp4_bfloat16_words`), then multiplied with float32 accumulation: the
same computation as dequantizing first.

Derivatives: the kernel is the forward product of `moe_eqx._gmm._products`; its
transposes (`d_lhs`, `d_rhs`) are `lax.ragged_dot` products on the same weights
(dequantized whole for a quantized weight, which is a constant for autodiff).
"""

import dataclasses
import functools as ft
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from .._activation import SWIGLU, AbstractActivation
from .._quant import (
    FP8_BLOCK,
    NORMAL_SCALE_BYTES,
    QuantizedArray,
    QuantizedWeight,
    as_float,
    is_quantized,
)
from .._rules import match_varying
from ._base import AbstractGMMBackend, GradAcc, gmm_ffn, group_ids, two_products
from ._products import AbstractProducts, gmm
from .activation_tpu import gated_vjp as _hidden_vjp
from .gathered import GatheredGMM, _expert_matrix
from .grouped_tpu import _GroupedProducts, _product, _row_tile
from .quantized_tpu import (
    DECODE_SCALE_BYTES,
    column_scales,
    dequantize_rows,
    fp4_bfloat16_words,
    fp4_pair,
    in_kernel,
    mxfp4_half_scales,
    mxfp4_operands,
    spread_matrix,
)
from .ragged_dot import _RaggedDotProducts

# VMEM a weight tile may take with its dequantizing temporaries (int32 codes, float32
# values, the cast copy, the double-buffered input), under the default scoped limit.
_TILE_BUDGET = 8 * 2**20
# A weight block's leading entry where its array is indexed by touched slot.
SLOT = "slot"


def _tile_n(n: int, k: int, fmt: str | None, itemsize: int) -> int:
    """The output columns of one grid step: the largest of 512, 256, 128 (the output
    block's lanes) that divides `n` and keeps the `[K, tn]` tile's work within
    `_TILE_BUDGET`; else the smallest that divides; else all `n`."""
    per_value = 3 * itemsize if fmt is None else 10  # bytes of VMEM per weight value
    fits = [t for t in (512, 256, 128) if t < n and n % t == 0]
    for t in fits:
        if k * t * per_value <= _TILE_BUDGET:
            return t
    return fits[-1] if fits else n


def _dot(a, b, transpose_b=False):
    return _product(a, b, (1, 1 if transpose_b else 0))


def _tile_product(fmt, dtype, k, j, x_refs, w_refs):
    """All rows times one expert's `[K, tn]` tile (MXFP4 stored `[N, K / 2]`: its
    `[tn, K]` transpose), dequantized in VMEM exactly as
    [`moe_eqx.QuantizedArray.dequantize`][] does (float32 values times float32
    scales, one rounding to `dtype`): `[rows, tn]` float32."""
    if fmt is None:
        (x,), (w,) = x_refs, w_refs
        return _dot(x[...], w[...].astype(dtype))
    if fmt == "int8":
        (x,), (v, s) = x_refs, w_refs
        return _dot(x[...], dequantize_rows(fmt, dtype, v[...], s[...]))
    if fmt in ("fp8_blocks", "float8_e4m3fn"):
        (x,), (v, s) = x_refs, w_refs
        if fmt == "fp8_blocks":  # `s`: this expert's `[column blocks, row blocks]`
            groups = v.shape[1] // FP8_BLOCK[1]  # the step's column blocks

            def scale_row(b):  # the step's columns' scales in row block `b`
                pieces = [
                    jnp.broadcast_to(
                        s[pl.ds(j * groups + c, 1), b : b + 1], (1, FP8_BLOCK[1])
                    )
                    for c in range(groups)
                ]
                return jnp.concatenate(pieces, axis=1)

        else:  # `s`: a float32 scale per column, `[row blocks, tn]`

            def scale_row(b):
                return s[b : b + 1, :]

        part = None
        for b in range(-(-k // FP8_BLOCK[0])):
            lo, hi = b * FP8_BLOCK[0], min(k, (b + 1) * FP8_BLOCK[0])
            tile = dequantize_rows("float8_e4m3fn", dtype, v[lo:hi, :], scale_row(b))
            term = _dot(x[:, lo:hi], tile)
            part = term if part is None else part + term
        return part
    if fmt.endswith("_words"):
        return _fp4_words_product(fmt, dtype, x_refs, w_refs)
    # MXFP4 (the word kernel's shapes aside): `v` holds the weight's bytes
    # (byte `j` of a column: rows `2 j` and `2 j + 1`), `[K / 2, tn]` ("mxfp4_kn")
    # or `W^T`'s `[tn, K / 2]`, `s` its scale bytes in the same orientation; the
    # rows' even and odd columns come apart (`x_refs`), so each half of a byte
    # meets its own.
    (x_even, x_odd), (v, s) = x_refs, w_refs
    kn = fmt == "mxfp4_kn"
    width = v.shape[0 if kn else 1]
    scale = mxfp4_half_scales(s[...], width, _dot, rows_first=kn)
    low, high = fp4_pair(v[...].astype(jnp.int32), scale)
    return _dot(x_even[...], low.astype(dtype), not kn) + _dot(
        x_odd[...], high.astype(dtype), not kn
    )


def _fp4_words_product(fmt, dtype, x_refs, w_refs):
    """MXFP4 tiles as whole words (`fp4_bfloat16_words`): the bytes' int32 words
    (`pltpu.bitcast`, four bytes of consecutive rows each) give four bfloat16
    matrices, each of a fixed subset of the codes, and the rows' matching columns
    (`x_refs`) meet them. The scale bytes `c` are the touched experts' as
    gathered, in the values' orientation; `(byte - 1)` times a power of two is
    spread over each block's values by one matrix product with a 0/1 matrix
    (exact: a value of eight bits times a power of two, summed with zeros).

    - `"mxfp4_kn_words"`: `v` `[K / 2, tn]`, words `[K / 8, tn]` (a word: rows
      `8 i` to `8 i + 7` of a column, one 32-row block); matrix `s` holds weight
      rows `s::4`, against `x[:, s::4]`. `c` `[K / 32, tn]`: `(byte - 1) * 2 ** 7`
      spread over each block's four words.
    - `"mxfp4_words"`: `v` `[tn, K / 2]` (`W^T`), words `[tn / 4, K / 2]` (a word:
      the bytes of columns `4 i` to `4 i + 3` at two rows); matrix `2 p + h` holds
      columns `p::2` at rows `h::2`, against `x[:, h::2]`, giving the step's
      columns `p::2` (two parts, interleaved outside the kernel). `c` `[tn, K /
      32]`, whose words (`pltpu.bitcast`) hold the same four columns' scale bytes
      as the values' words do their values. For each `p` the low half's byte
      (column `4 i + p`) times `2 ** 7` and the high half's (`4 i + 2 + p`) times
      `2 ** 23`, spread over each block's 16 bytes and summed (the halves' bits
      do not overlap and fit float32's 24).

    Returns `[rows, tn]` (`"mxfp4_kn_words"`) or the step's two parts, each `[rows,
    tn / 2]` (a tuple), float32."""
    v, c = w_refs
    words = pltpu.bitcast(v[...], jnp.int32)

    def weight(bits):
        return pltpu.bitcast(bits, jnp.bfloat16).astype(dtype)

    def less(byte, times):  # `(byte - 1) * times`, exact in bfloat16
        value = ((byte.astype(jnp.int32) & 0xFF) - 1).astype(jnp.float32)
        return (value * times).astype(jnp.bfloat16)

    if fmt == "mxfp4_kn_words":
        spread = spread_matrix((words.shape[0], c.shape[0]), 0, 2)
        scale = _dot(spread, less(c[...], 2.0**7)).astype(jnp.int32)
        parts = fp4_bfloat16_words(words, [scale] * 4, halves=False)
        terms = [_dot(x[...], weight(b)) for x, b in zip(x_refs, parts, strict=True)]
        return terms[0] + terms[1] + terms[2] + terms[3]
    x_even, x_odd = x_refs
    # For `p` in 0, 1: the low half's column `4 i + p` times `2 ** 7`, the high
    # half's `4 i + 2 + p` times `2 ** 23`, stacked: `q` in 0, 2, 1, 3 (byte `q`
    # of scale word `i` is column `4 i + q`'s).
    quarter = words.shape[0]
    scale_words = pltpu.bitcast(c[...], jnp.int32)
    srl = jax.lax.shift_right_logical
    stacked = jnp.concatenate(
        [
            less(srl(scale_words, 8 * q), 2.0 ** (23 if q >= 2 else 7))
            for q in (0, 2, 1, 3)
        ],
        axis=0,
    )
    spread = _dot(stacked, spread_matrix((stacked.shape[1], words.shape[1]), 1, 4))
    scales = [
        (
            spread[2 * p * quarter : (2 * p + 1) * quarter]
            + spread[(2 * p + 1) * quarter : (2 * p + 2) * quarter]
        ).astype(jnp.int32)
        for p in (0, 1)
    ]
    parts = fp4_bfloat16_words(words, [scales[s // 2] for s in range(4)], halves=True)
    return tuple(
        _dot(x_even[...], weight(parts[2 * p]), True)
        + _dot(x_odd[...], weight(parts[2 * p + 1]), True)
        for p in (0, 1)
    )


def _kernel(fmt, dtype, k, num_x, ids, count, *refs):
    x_refs, gid = refs[:num_x], refs[num_x]
    w_refs, (out, acc) = refs[num_x + 1 : -2], refs[-2:]
    # (Read here: Pallas' interpreter has no grid position inside `pl.when`.)
    j, u = pl.program_id(0), pl.program_id(1)

    @pl.when(u == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, acc.dtype)

    @pl.when(u < count[0])
    def _():
        parts = _tile_product(fmt, dtype, k, j, x_refs, w_refs)
        for p, part in enumerate(parts if isinstance(parts, tuple) else (parts,)):
            acc[p] += jnp.where(gid[...] == ids[u], part, 0.0)

    @pl.when(u == pl.num_programs(1) - 1)
    def _():
        out[...] = acc[...].astype(out.dtype)


def _touched(group_sizes: Array, rows: int) -> tuple[Array, Array]:
    """The ids of the groups with rows among `rows` rows, in order, padded to
    `min(G, rows)` slots (the most there can be) by repeating the last one; and
    how many there are."""
    slots = min(group_sizes.shape[0], rows)
    if slots == 0:  # no rows: no group is touched
        return jnp.zeros((0,), jnp.int32), jnp.zeros((1,), jnp.int32)
    nonempty = group_sizes > 0
    order = jnp.argsort(~nonempty, stable=True)[:slots].astype(jnp.int32)
    count = jnp.minimum(jnp.sum(nonempty.astype(jnp.int32)), slots)
    last = order[jnp.maximum(count - 1, 0)]
    ids = jnp.where(jnp.arange(slots) < count, order, last)
    return ids, count.reshape(1)


def _touched_scales(w: QuantizedArray, ids: Array) -> Array:
    """The scale bytes of an MXFP4 weight's touched experts (`ids`, `_touched`),
    `[slots, N, K / 32]`: what the kernel reads of them, and what the layer's
    check of the scale bytes covers. Gathered, not whole: a TPU lays the whole
    array out unlike the kernel reads it (`[64, 2816, 64]` with `N`
    minor-most, `[64, 2048, 44]` with `K / 32` major), so it would be copied
    into the kernel's layout in every step (docs/measured.md, "TPU")."""
    return jnp.take(w.scales, ids, axis=0, mode="clip")


def _weight_operands(w, k: int, n: int, tn: int, ids: Array):
    """`(fmt, arrays, blocks)` of the kernel's weight inputs: each array's leading
    axis is the group (or, in a block whose first entry is `SLOT`, the touched
    group's slot: MXFP4's scales, gathered by `ids`); in each block shape the
    first `None` is the group's, a second the `tn` output columns of a grid step,
    and a size the whole axis."""
    if not is_quantized(w):
        return None, (w,), ((None, k, None),)
    # The stored bytes as they are, `int8` (a bitcast, even of `uint8` to `int8`,
    # is a copy of the whole weight on a TPU when it feeds a kernel).
    if w.fmt == "mxfp4":  # `[G, N, K / 2]` and `[slots, N, K / 32]`, or swapped
        values, kn = mxfp4_operands(w)
        scales = _touched_scales(w, ids)
        if kn:
            scales = jnp.swapaxes(scales, 1, 2)
            blocks = ((None, k // 2, None), (SLOT, k // 32, None))
            # The word kernel where its words are whole 32-bit sublane tiles
            # (`K / 8` a multiple of 8).
            words = "_words" if k % 64 == 0 else ""
            return "mxfp4_kn" + words, (values, scales), blocks
        blocks = ((None, None, k // 2), (SLOT, None, k // 32))
        # The word kernel where its scales' rows per word make whole bfloat16
        # sublane tiles (`tn / 4` a multiple of 16) and each half of the step's
        # columns is whole lane tiles or the whole axis.
        if not (tn % 64 == 0 and (tn % 256 == 0 or tn == n)):
            return "mxfp4", (values, scales), blocks
        return "mxfp4_words", (values, scales), blocks
    block = FP8_BLOCK[1]
    if w.fmt == "float8_e4m3fn" and tn % block == 0 and (n // w.parts) % block == 0:
        # Each expert's block scales whole, `[G, column blocks, row blocks]` (the
        # kernel spreads a step's own over its columns; column `c`'s block is
        # `c // 128`, parts or not, when each part is whole blocks): no float32
        # scale per column of every expert is built each call.
        scales = jnp.swapaxes(jax.lax.bitcast_convert_type(w.scales, jnp.float32), 1, 2)
        return (
            "fp8_blocks",
            (w.values, scales),
            ((None, k, None), (None, *scales.shape[1:])),
        )
    scales = column_scales(w, k, n)  # [G, rows of K, N] float32
    return w.fmt, (w.values, scales), ((None, k, None), (None, scales.shape[1], None))


def decode_gmm(
    lhs: Float[Array, "rows k_dim"],
    rhs: Float[Array, "groups k_dim n_dim"] | QuantizedArray,
    group_sizes: Int[Array, " groups"],
    *,
    block_n: int | None = None,
    interpret: bool = False,
) -> Float[Array, "rows n_dim"]:
    """`lhs[i] @ rhs[g(i)]` reading each group that has rows once (see the module).

    **Arguments:**

    - `lhs`: `[M, K]` rows sorted by group.
    - `rhs`: `[G, K, N]` float, or a [`moe_eqx.QuantizedArray`][] (FP8, MXFP4, int8)
        dequantized tile by tile to `lhs.dtype`.
    - `group_sizes`: `[G]` int32, `sum <= M`.
    - `block_n`: output columns per grid step (default: `_tile_n`).
    - `interpret`: run the kernel in Pallas' interpreter (any platform).

    **Returns:**

    `[M, N]` in `lhs.dtype`, accumulated in float32; rows past `sum(group_sizes)`
    are zero.
    """
    m, k = lhs.shape
    g, _, n = rhs.shape
    dtype = lhs.dtype
    if m == 0:  # no grid step to run
        return jnp.zeros((0, n), dtype)
    fmt = rhs.fmt if is_quantized(rhs) else None
    tn = _tile_n(n, k, fmt, jnp.dtype(dtype).itemsize) if block_n is None else block_n
    if n % tn:
        raise ValueError(f"`block_n` ({tn}) must divide the {n} output columns.")
    rt = _row_tile(dtype)
    mp = -(-m // rt) * rt
    lhs = jnp.pad(lhs, ((0, mp - m), (0, 0)))
    gid = jnp.pad(group_ids(group_sizes, m), (0, mp - m), constant_values=g)
    ids, count = _touched(group_sizes, m)
    slots = ids.shape[0]
    fmt, arrays, blocks = _weight_operands(rhs, k, n, tn, ids)
    if fmt == "mxfp4_kn_words":
        xs = tuple(lhs[:, s::4] for s in range(4))
    elif fmt is not None and fmt.startswith("mxfp4"):
        xs = (lhs[:, 0::2], lhs[:, 1::2])
    else:
        xs = (lhs,)
    # The step's columns `p::parts`.
    parts = 2 if fmt == "mxfp4_words" else 1

    def whole(shape):
        return pl.BlockSpec(shape, lambda j, u, ids, count: (0, 0))

    def weight_spec(block):
        lead, *rest = block
        shape = (None, *(tn if d is None else d for d in rest))
        tiled = tuple(d is None for d in rest)

        def index(j, u, ids, count):
            # A padded step's slot is the last touched one's: no new block read.
            last = jnp.maximum(count[0] - 1, 0)
            group = jnp.minimum(u, last) if lead == SLOT else ids[u]
            return (group, *(j if t else 0 for t in tiled))

        return pl.BlockSpec(shape, index)

    in_specs = [whole(x.shape) for x in xs] + [whole((mp, 1))]
    in_specs += [weight_spec(block) for block in blocks]
    call = pl.pallas_call(
        ft.partial(_kernel, fmt, dtype, k, len(xs)),
        out_shape=jax.ShapeDtypeStruct((parts, mp, n // parts), dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n // tn, slots),
            in_specs=in_specs,
            out_specs=pl.BlockSpec(
                (parts, mp, tn // parts), lambda j, u, ids, count: (0, 0, j)
            ),
            scratch_shapes=[pltpu.VMEM((parts, mp, tn // parts), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")
        ),
        interpret=interpret,
    )
    out = call(ids, count, *xs, gid[:, None], *arrays)
    # Column `j tn + parts r + p` is part `p`'s column `j tn / parts + r`.
    return jnp.moveaxis(out, 0, -1).reshape(mp, n)[:m]


class _DecodeProducts(AbstractProducts):
    """The kernel as the forward product; `lax.ragged_dot` for its transposes."""

    block_n: int | None = eqx.field(static=True)
    interpret: bool = eqx.field(static=True)
    has_effects: ClassVar[bool] = False

    def gmm(self, a, b, group_sizes):
        return decode_gmm(
            a, b, group_sizes, block_n=self.block_n, interpret=self.interpret
        )

    def gmm_t(self, a, b, group_sizes):
        return _RaggedDotProducts().gmm_t(a, _float(b, a.dtype), group_sizes)

    def tgmm(self, a, d, group_sizes):
        return _RaggedDotProducts().tgmm(a, d, group_sizes)

    def backward(self, a, b, group_sizes, d_out, want):
        return _RaggedDotProducts().backward(
            a, _float(b, a.dtype), group_sizes, d_out, want
        )


@jax.custom_jvp
def _cut_where(cut: Array, x: Array) -> Array:
    """`x`, whose tangent (and so cotangent) is zero where `cut`: no pass over `x`
    in the forward (a `where` on `x` itself would be one)."""
    return x


@_cut_where.defjvp
def _cut_where_jvp(primals, tangents):
    cut, x = primals
    return x, jnp.where(cut, jnp.zeros((), x.dtype), tangents[1])


def _by_expert(w, dtype) -> Array:
    """`w` in `dtype`, a quantized weight dequantized one expert at a time (its
    float32 intermediates are one expert's, not every expert's)."""
    if not is_quantized(w):
        return w.astype(dtype)
    return jax.lax.map(
        lambda g: _expert_matrix(w, g, dtype), jnp.arange(w.values.shape[0])
    )


def _float(w, dtype):
    return w.dequantize(dtype) if is_quantized(w) else w


class _TrainingProducts(AbstractProducts):
    """Many rows (training, prefill): the library's own grouped kernels
    (`moe_eqx._gmm.grouped_tpu`) for all three products, faster on a v5e than
    megablox and `lax.ragged_dot` at every product measured (`benchmarks/tpu_gmm.py`,
    docs/measured.md, "TPU"); float64 (off the TPU) by `lax.ragged_dot`."""

    interpret: bool = eqx.field(static=True)
    has_effects: ClassVar[bool] = False

    def _kernel(self, a):
        if a.dtype.itemsize > 4:
            return _RaggedDotProducts()
        return _GroupedProducts(interpret=self.interpret)

    def _weights(self, a, b):
        """`b` as the kernel takes it: quantized weights as stored where the own
        kernel reads them, dequantized whole for `lax.ragged_dot`."""
        if a.dtype.itemsize > 4:
            return _float(b, a.dtype)
        return b

    def gmm(self, a, b, group_sizes):
        return self._kernel(a).gmm(a, self._weights(a, b), group_sizes)

    def gmm_t(self, a, b, group_sizes):
        return self._kernel(a).gmm_t(a, self._weights(a, b), group_sizes)

    def tgmm(self, a, d, group_sizes):
        return self._kernel(a).tgmm(a, d, group_sizes)

    def backward(self, a, b, group_sizes, d_out, want):
        return self._kernel(a).backward(
            a, self._weights(a, b), group_sizes, d_out, want
        )


class PallasTPUGMM(AbstractGMMBackend):
    """Grouped matmul on TPUs: the decode kernel (see the module) for at most
    `max_rows` rows; for more, the library's own grouped kernels for all three
    products (`moe_eqx._gmm.grouped_tpu`), or `fallback` if given.

    The kernel reads only the experts that have rows, and quantized experts
    ([`moe_eqx.QuantizedArray`][]: FP8, MXFP4, int8) as stored, dequantizing each
    weight tile in VMEM: no float copy of the experts is made. For many rows the
    own grouped kernel reads them as stored too, in the forward and for the
    input's gradient (each tile dequantized once per group and output tile).
    MXFP4 weights with a scale byte outside `[2, 254]` (subnormal or
    infinite scales, in no trained checkpoint; for few rows `[2, 252]`, whose
    codes are all normal bfloat16 values) are dequantized exactly instead: by
    `GatheredGMM` (few rows) or one expert at a time before the many-row kernels;
    biased quantized experts and the chunked fallback's accumulating FFN take the
    products for many rows, dequantized whole (or `fallback`).

    **Arguments:**

    - `max_rows`: the most rows the kernel takes (each grid step multiplies all of
        them, so its work grows with rows times touched experts).
    - `block_n`: output columns per grid step (default: up to 512, by the shape and
        the VMEM its tile needs).
    - `interpret`: run the kernels in Pallas' interpreter (for tests off the TPU).
    - `fallback`: a backend for more rows instead (default: the products above).
    """

    max_rows: int = eqx.field(static=True, default=128)
    block_n: int | None = eqx.field(static=True, default=None)
    interpret: bool = eqx.field(static=True, default=False)
    fallback: AbstractGMMBackend | None = None

    def _products(self) -> _DecodeProducts:
        return _DecodeProducts(self.block_n, self.interpret)

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        many = lhs.shape[0] > self.max_rows
        if many and self.fallback is not None:
            return self.fallback(lhs, rhs, group_sizes)
        with jax.named_scope("moe_eqx.gmm.pallas_tpu"):
            if many:
                rhs = as_float(rhs, lhs.dtype)
                products = _TrainingProducts(self.interpret)
            else:
                products = self._products()
            lhs, rhs, sizes = match_varying(lhs, rhs, group_sizes.astype(jnp.int32))
            return gmm(products, lhs, rhs.astype(lhs.dtype), sizes)

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
        weights = (w_gate_up, w_down)
        many = x.shape[0] > self.max_rows
        # Quantized experts in a format the kernels read: each weight tile
        # dequantized in VMEM, by the decode kernel or (many rows) the own grouped
        # kernels (forward and the input's gradient); float experts for many rows:
        # two calls of this backend.
        own = grad_acc is None and all(in_kernel(w) for w in weights)
        quantized = any(is_quantized(w) for w in weights)
        if not own or (many and (self.fallback is not None or not quantized)):
            if self.fallback is not None:
                return self.fallback.ffn(
                    x, w_gate_up, w_down, group_sizes, grad_acc, activation=activation
                )
            many = dataclasses.replace(self, max_rows=0)  # the kernel for no rows only
            return gmm_ffn(
                many, x, w_gate_up, w_down, group_sizes, grad_acc, activation
            )
        products = _TrainingProducts(self.interpret) if many else self._products()
        mxfp4 = [w for w in weights if is_quantized(w) and w.fmt == "mxfp4"]
        if not mxfp4:
            return self._ffn(x, w_gate_up, w_down, group_sizes, activation, products)
        # Other scale bytes (in no trained checkpoint) need the exact integer
        # construction of `_quant`: below, one expert at a time (few rows: each
        # row's expert; many: each weight dequantized an expert at a time).
        # Checked: the bytes the kernels read (few rows: the touched experts',
        # as the decode kernel takes them; many: all).
        lo, hi = NORMAL_SCALE_BYTES if many else DECODE_SCALE_BYTES
        edge = jnp.zeros((), bool)
        if not many:
            ids, _ = _touched(group_sizes.astype(jnp.int32), x.shape[0])
        for w in mxfp4:
            scales = w.scales if many else _touched_scales(w, ids)
            byte = jax.lax.bitcast_convert_type(scales, jnp.uint8)
            edge = edge | jnp.any((byte < lo) | (byte > hi))

        # (Rematerialised: its residuals would be outputs of the `cond`, zeros
        # of the dequantized experts' and the rows' shapes built in every step
        # where it is not taken.)
        @jax.checkpoint
        def exact(fast, x, w_gate_up, w_down, group_sizes):
            if many:  # the kernels on each weight dequantized an expert at a time
                whole = dataclasses.replace(self, max_rows=0)

                def product(lhs, w, sizes):
                    return whole(lhs, _by_expert(w, lhs.dtype), sizes)

                vjp = whole.hidden_vjp(activation, x.shape[0])
                return two_products(
                    product, x, w_gate_up, w_down, group_sizes, activation, vjp
                )
            # One expert's float matrices at a time: no float copy of them all.
            return GatheredGMM().ffn(
                x, w_gate_up, w_down, group_sizes, activation=activation
            )

        def kernel(fast, x, w_gate_up, w_down, group_sizes):
            return fast

        # The kernel runs outside the `cond` (docs/measured.md, "TPU"), its result
        # unused where the exact branch is taken. There its pullback (a zero
        # cotangent through the other bytes' infinite or NaN products) would be
        # NaN: `_cut_where` zeroes it, in the derivatives only.
        fast = self._ffn(
            _cut_where(edge, x), w_gate_up, w_down, group_sizes, activation, products
        )
        args = (fast, x, w_gate_up, w_down, group_sizes)
        return jax.lax.cond(edge, exact, kernel, *args)

    def _ffn(self, x, w_gate_up, w_down, group_sizes, activation, products):
        def product(lhs, w, sizes):
            if not is_quantized(w):
                w = w.astype(lhs.dtype)
            return gmm(products, lhs, w, sizes)

        vjp = self.hidden_vjp(activation, x.shape[0])
        with jax.named_scope("moe_eqx.gmm.pallas_tpu"):
            x, w_gate_up, w_down, sizes = match_varying(
                x, w_gate_up, w_down, group_sizes.astype(jnp.int32)
            )
            return two_products(product, x, w_gate_up, w_down, sizes, activation, vjp)

    def hidden_vjp(self, activation: AbstractActivation, rows: int):
        """For many rows, the library's gated activations' backward as one Pallas
        pass (`moe_eqx._gmm.activation_tpu`); else JAX's own (or `fallback`'s)."""
        if rows <= self.max_rows:
            return None
        if self.fallback is not None:
            return self.fallback.hidden_vjp(activation, rows)
        return ft.partial(_hidden_vjp, interpret=self.interpret)
