"""Tile configurations of the Mosaic GPU kernels: what they are, which ones a kernel
accepts, and the heuristic used when nothing is tuned.

Kernel constraints, read from their source (jax 0.10; the same call signatures and
tiling rules in 0.11 and 0.12): the contracting dim a multiple of `block_k`; the output
columns a multiple of `block_n` (the stores are whole `block_n` tiles); the transposed
kernel also needs its output rows (`K`) a multiple of `block_m`. So `K` and `N` are
zero-padded to multiples of `DIM_ALIGN` (a no-op for usual model widths) and rows to a
multiple of the row tile.
"""

import dataclasses
from typing import Literal

Kernel = Literal["fwd", "dlhs", "drhs"]
KERNELS: tuple[Kernel, ...] = ("fwd", "dlhs", "drhs")

# H100/H200: 227 KiB of shared memory per block (opt-in maximum).
SMEM_BYTES = 227 * 1024
DIM_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class MosaicTileConfig:
    """Tiling parameters of one Mosaic GPU ragged-dot kernel call.

    **Arguments:** (as in `ragged_dot_mgpu.ragged_dot` / `transposed_ragged_dot`)

    - `block_m`, `block_n`, `block_k`: output-row, output-column and contracting tile.
    - `max_concurrent_steps`: pipeline depth (shared-memory stages).
    - `grid_block_n`: width (in `block_n` tiles) of the snake-order column bands.
    """

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int

    def as_dict(self) -> dict[str, int]:
        """The fields as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `x`."""
    return -(-x // multiple) * multiple


def padded_dims(k: int, n: int) -> tuple[int, int]:
    """`(K, N)` zero-padded to multiples of `DIM_ALIGN`, as the kernels see them."""
    return round_up(k, DIM_ALIGN), round_up(n, DIM_ALIGN)


def smem_bytes(kernel: Kernel, config: MosaicTileConfig, itemsize: int) -> int:
    """Shared memory one block of `kernel` uses: the pipelined input tiles plus the
    output tile."""
    c = config
    stages = c.max_concurrent_steps * (c.block_m * c.block_k + c.block_k * c.block_n)
    return (stages + c.block_m * c.block_n) * itemsize


def _kernel_dims(kernel: Kernel, m: int, k: int, n: int) -> tuple[int, int, int]:
    """(rows, contracting, cols) of the kernel for a gmm of `[m, k] @ [g, k, n]`."""
    if kernel == "fwd":
        return m, k, n
    if kernel == "dlhs":
        return m, n, k
    return k, m, n  # drhs: out [g, k, n], contracting over the m token rows.


def config_is_valid(
    kernel: Kernel, config: MosaicTileConfig, m: int, k: int, n: int, itemsize: int = 2
) -> bool:
    """Whether `config` satisfies the kernel's static constraints for this gmm.

    **Arguments:**

    - `kernel`: `"fwd"`, `"dlhs"` or `"drhs"`.
    - `config`: the candidate tiling.
    - `m`, `k`, `n`: the gmm sizes (`lhs [m, k]`, `rhs [g, k, n]`), after padding `k`
        and `n` to multiples of 64.
    - `itemsize`: bytes per input element.

    **Returns:**

    `True` when the divisibility, register and shared-memory limits hold.
    """
    rows, contracting, cols = _kernel_dims(kernel, m, k, n)
    c = config
    if min(c.block_m, c.block_n, c.block_k, c.max_concurrent_steps, c.grid_block_n) < 1:
        return False
    if c.block_m % 64 or c.block_n % 8 or c.block_k % 64:
        return False
    # One warpgroup holds the float32 accumulator in registers.
    if c.block_m * c.block_n > 128 * 256:
        return False
    if smem_bytes(kernel, c, itemsize) > SMEM_BYTES:
        return False
    if cols % c.block_n:
        return False
    if kernel == "drhs":
        return rows % c.block_m == 0 and c.block_m <= 128 and c.block_n <= 128
    # `ragged_dot` pipelines with `delay_release=1`, which `emit_pipeline` accepts
    # only with at least two stages.
    return contracting % c.block_k == 0 and c.max_concurrent_steps >= 2


def default_tile_config(
    kernel: Kernel, m: int, k: int, n: int, g: int, itemsize: int = 2
) -> MosaicTileConfig:
    """A heuristic tiling for one kernel; see `autotune_gmm` for measured ones.

    Starting points for H100/H200 (132 SMs, 227 KiB shared memory): 128-row tiles when
    groups average at least 256 rows (a tile straddling a group boundary is computed
    once per group, so small groups favour 64), the widest of 192/128/64 columns that
    divides the output (at most 128 with 128 rows, to bound accumulator registers),
    `block_k = 64` (128-byte swizzle for 16-bit types), as many pipeline stages (up
    to 4) as fit in shared memory, and column bands of up to 8
    tiles for L2 reuse of the weights. Not tuned on hardware.

    **Arguments:**

    - `kernel`: `"fwd"`, `"dlhs"` or `"drhs"`.
    - `m`, `k`, `n`, `g`: gmm sizes, `k` and `n` already multiples of 64.
    - `itemsize`: bytes per input element.

    **Returns:**

    A `MosaicTileConfig` valid for these sizes.
    """
    rows, contracting, cols = _kernel_dims(kernel, m, k, n)
    if kernel == "drhs":
        block_m = 128 if rows % 128 == 0 else 64
        block_n = 128 if cols % 128 == 0 else 64
    else:
        block_m = 128 if m >= 256 * max(g, 1) else 64
        block_n = next(b for b in (192, 128, 64) if cols % b == 0)
        # 128x192 float32 accumulators need ~192 registers per thread: risky.
        if block_m * block_n > 128 * 128:
            block_n = 128 if cols % 128 == 0 else 64
    grid_n = cols // block_n
    grid_block_n = next(w for w in (8, 4, 2, 1) if grid_n >= 2 * w or w == 1)
    for steps in (4, 3, 2, 1):
        config = MosaicTileConfig(block_m, block_n, 64, steps, grid_block_n)
        if config_is_valid(kernel, config, m, k, n, itemsize):
            return config
    raise ValueError(  # pragma: no cover - 64x64x64 always fits
        f"No Mosaic GPU tiling for {kernel} with m={m}, k={k}, n={n}."
    )
