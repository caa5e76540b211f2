"""`MegabloxGMM`: the grouped products as JAX's own Pallas TPU kernels
(`jax.experimental.pallas.ops.tpu.megablox`: `gmm`, and `tgmm` for the weights'
gradient), with tiles chosen per shape from a table measured on the chip.

`lax.ragged_dot` on a TPU reaches about half the chip's dense rate at the shapes of
fine-grained MoEs (`docs/measured.md`, "TPU"); the same kernels with tiles fitted to the
shape reach most of it. The three products of `moe_eqx._gmm._products`:

- `gmm(a, b)`: `megablox.gmm(a, b)`;
- `gmm_t(a, b)`: `megablox.gmm(a, b, transpose_rhs=True)`;
- `tgmm(a, d)`: `megablox.tgmm(a^T, d)` (one transposed copy of `a`).

The kernels need the rows to be a multiple of the row tile: other row counts are
padded with zero rows (which belong to no group). Rows past `sum(group_sizes)` come
out zero, as every backend's do. Products are in `a.dtype` with float32 accumulation;
a quantized weight is dequantized whole first (as `RaggedDotGMM` does).
"""

import contextlib
import functools as ft
import importlib
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._quant import as_float
from .._rules import match_varying
from ._base import AbstractGMMBackend, zero_past_groups
from ._products import AbstractProducts, gmm
from .activation_tpu import gated_vjp

# The kernels' module (the package's own `gmm` attribute is the differentiable op).
_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

Tiles = tuple[int, int, int]

# Tiles (rows, contraction, output columns) measured on one TPU v5e chip
# (`benchmarks/tpu_gmm.py --sweep`, bfloat16, balanced groups), keyed by (product,
# contraction, output columns): "gmm" `[M, K] x [G, K, N]` (K, N), "gmm_t"
# `[M, N] x [G, K, N]^T` (N, K: its own contraction and output), "tgmm"
# `[M, K]^T x [M, N]` (K, N). The row tile is used where it divides the rows.
TUNED: dict[tuple[str, int, int], Tiles] = {
    # Qwen3-30B-A3B-like experts (d_model 2048, d_ff 768), 65536 rows. The two
    # derivative products tuned on Zipf-skewed groups, as routing is; the forward
    # on balanced groups. Their times are in docs/measured.md ("TPU").
    ("gmm", 2048, 1536): (512, 2048, 768),
    ("gmm_t", 1536, 2048): (256, 1536, 1024),
    ("tgmm", 2048, 1536): (256, 2048, 512),
    ("gmm", 768, 2048): (256, 768, 2048),
    ("gmm_t", 2048, 768): (128, 2048, 768),
    ("tgmm", 768, 2048): (512, 768, 1024),
}


def _fit(size: int, cap: int) -> int:
    """The largest multiple of 128 that divides `size` and is at most `cap`; `size`
    itself when it is at most `cap`; else `cap` (a ragged last tile, masked)."""
    if size <= cap:
        return size
    for t in range(cap - cap % 128, 127, -128):
        if size % t == 0:
            return t
    return cap


def default_tiles(
    kind: str, contraction: int, out_cols: int, itemsize: int = 2
) -> Tiles:
    """Tiles for a shape missing from `TUNED` (each compiled within the default scoped
    VMEM at the measured shapes): rows 256; contraction up to 2048 and
    output columns up to 1024 (`tgmm`, whose float32 output tile is double-buffered:
    512) at bfloat16, half of each at float32."""
    wide = 2 if itemsize >= 4 else 1
    cols = 512 if kind == "tgmm" else 1024
    return 256, _fit(contraction, 2048 // wide), _fit(out_cols, cols // wide)


def tiles_for(kind: str, contraction: int, out_cols: int, rows: int, dtype) -> Tiles:
    """`TUNED[kind, contraction, out_cols]` for 16-bit operands, else
    `default_tiles`; the row tile halved (down to 128) until it divides `rows`."""
    itemsize = jnp.dtype(dtype).itemsize
    found = TUNED.get((kind, contraction, out_cols)) if itemsize <= 2 else None
    tm, tk, tn = found or default_tiles(kind, contraction, out_cols, itemsize)
    while tm > 128 and rows % tm:
        tm //= 2
    return tm, tk, tn


def _padded(a: Array, rows: int) -> Array:
    extra = -a.shape[0] % rows
    return a if not extra else jnp.pad(a, ((0, extra), (0, 0)))


@contextlib.contextmanager
def _kernel_context(dtype):
    """The settings the kernels are traced under, whatever the user's: standard
    dtype promotion (their index arithmetic mixes booleans and integers, which
    `jax_numpy_dtype_promotion="strict"` rejects), and for 16-bit operands the
    default matmul precision (Mosaic rejects the float32 contract precision a
    global `jax_default_matmul_precision="highest"` asks for)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.numpy_dtype_promotion("standard"))
        if jnp.dtype(dtype).itemsize < 4:
            stack.enter_context(jax.default_matmul_precision("default"))
        yield


class _MegabloxProducts(AbstractProducts):
    tiles: Tiles | None = eqx.field(static=True)
    interpret: bool = eqx.field(static=True)
    has_effects: ClassVar[bool] = False

    def _tiles(self, kind, contraction, out_cols, a):
        if self.tiles is not None:
            return self.tiles
        return tiles_for(kind, contraction, out_cols, a.shape[0], a.dtype)

    def _gmm(self, a, b, group_sizes, transpose):
        k = a.shape[1]
        n = b.shape[1] if transpose else b.shape[2]
        tm, tk, tn = self._tiles("gmm_t" if transpose else "gmm", k, n, a)
        with _kernel_context(a.dtype):
            out = _mb.gmm(
                _padded(a, tm),
                b.astype(a.dtype),
                group_sizes,
                preferred_element_type=a.dtype,
                tiling=(tm, tk, tn),
                transpose_rhs=transpose,
                interpret=self.interpret,
            )
        # The kernel leaves rows past the last group unwritten.
        return zero_past_groups(out[: a.shape[0]], group_sizes)

    def gmm(self, a, b, group_sizes):
        return self._gmm(a, b, group_sizes, transpose=False)

    def gmm_t(self, a, b, group_sizes):
        return self._gmm(a, b, group_sizes, transpose=True)

    def tgmm(self, a, d, group_sizes, out=jnp.float32):
        tm, tk, tn = self._tiles("tgmm", a.shape[1], d.shape[1], a)
        # Zero rows past the groups: the kernel visits every row tile up to the end of
        # the last group, masking by group, so those rows are never read; padding to
        # the row tile adds rows of no group.
        with _kernel_context(a.dtype):
            return _mb.tgmm(
                _padded(a, tm).T,
                _padded(d.astype(a.dtype), tm),
                group_sizes,
                preferred_element_type=out,
                tiling=(tm, tk, tn),
                interpret=self.interpret,
            )

    def backward(self, a, b, group_sizes, d_out, want):
        d_a = self.gmm_t(d_out, b, group_sizes) if want[0] else None
        # The weights' gradient written in their dtype from the float32
        # accumulator (a float32 copy of it costs as much memory traffic as a
        # product at training shapes).
        d_b = self.tgmm(a, d_out, group_sizes, b.dtype) if want[1] else None
        return d_a, d_b


class MegabloxGMM(AbstractGMMBackend):
    """Grouped matmul through JAX's Pallas TPU grouped-matmul kernels (megablox's
    `gmm` and `tgmm`), tiled per shape from a table measured on a TPU v5e
    (`moe_eqx._gmm.megablox.TUNED`; a heuristic for other shapes). TPU only (or
    `interpret=True`, Pallas' interpreter, anywhere); float32 and bfloat16.

    **Arguments:**

    - `tiles`: `(rows, contraction, output columns)` for every product, overriding the
        table (for tuning: `benchmarks/tpu_gmm.py --sweep`).
    - `interpret`: run the kernels in Pallas' interpreter (tests off the TPU).
    """

    tiles: Tiles | None = eqx.field(static=True, default=None)
    interpret: bool = eqx.field(static=True, default=False)

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        rhs = as_float(rhs, lhs.dtype)
        with jax.named_scope("moe_eqx.gmm.megablox"):
            lhs, rhs, sizes = match_varying(lhs, rhs, group_sizes.astype(jnp.int32))
            products = _MegabloxProducts(self.tiles, self.interpret)
            return gmm(products, lhs, rhs, sizes)

    def hidden_vjp(self, activation, rows: int):
        """The library's gated activations' backward in one Pallas pass
        (`moe_eqx._gmm.activation_tpu`), as `PallasTPUGMM` takes it."""
        return ft.partial(gated_vjp, interpret=self.interpret)
