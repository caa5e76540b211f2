"""Hopper (sm_90) grouped matmul on the Pallas Mosaic GPU kernels shipped in jax.

Forward: `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`. Backward
(`jax.custom_vjp`): `d_lhs` is the same kernel on `d_out` with `transpose_rhs=True`
(contracting `N` against `rhs [G, K, N]` without materialising `rhs^T`), and `d_rhs` is
`transposed_ragged_dot_mgpu.transposed_ragged_dot(lhs, d_out)`, `[G, K, N]`.

Kernel constraints, read from their source (jax 0.10; the same call signatures and
tiling rules in 0.11 and 0.12): equal 16-bit input dtypes (WGMMA;
float32 would silently run as TF32, so float32 inputs use the tiled backend instead);
the contracting dim a multiple of `block_k`; the output columns a multiple of `block_n`
(the stores are whole `block_n` tiles); the transposed kernel also needs its output
rows (`K`) a multiple of `block_m`. So `K` and `N` are zero-padded to multiples of 64
(a no-op for usual model widths) and rows to a multiple of the row tile.

The forward kernel never writes rows at or beyond `sum(group_sizes)` (they hold
uninitialised memory), so they are masked to zero here (one select, which XLA can fuse
into the consumer). The `d_rhs` kernel zero-initialises its accumulator, so empty
groups get exact zeros.

Tile configurations come, in order, from: the backend's explicit fields, the tuning
table written by `autotune_gmm` (`$MOE_EQX_GMM_TUNING`, default
`~/.cache/moe_eqx/gmm_tuning.json`; exact shape, else the nearest `M` for the same
device, dtype, `K`, `N`, `G`), then `default_tile_config`. The Pallas modules are
imported lazily, so importing moe_eqx never needs a GPU.
"""

import dataclasses
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._rules import match_varying
from ._base import AbstractGMMBackend
from .tiled import TiledGMM

Kernel = Literal["fwd", "dlhs", "drhs"]
KERNELS: tuple[Kernel, ...] = ("fwd", "dlhs", "drhs")

# H100/H200: 227 KiB of shared memory per block (opt-in maximum).
_SMEM_BYTES = 227 * 1024
_DIM_ALIGN = 64
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _smem_bytes(kernel: Kernel, c: MosaicTileConfig, itemsize: int) -> int:
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
    if _smem_bytes(kernel, c, itemsize) > _SMEM_BYTES:
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


# ---------------------------------------------------------------------------
# Tuning table.


def tuning_path() -> str:
    """Where the tuning table lives: `$MOE_EQX_GMM_TUNING`, else
    `~/.cache/moe_eqx/gmm_tuning.json`."""
    return os.environ.get(
        "MOE_EQX_GMM_TUNING",
        os.path.join(os.path.expanduser("~"), ".cache", "moe_eqx", "gmm_tuning.json"),
    )


def _table_key(kernel, device_kind, dtype, m, k, n, g) -> str:
    return f"{kernel}|{device_kind}|{jnp.dtype(dtype).name}|{m}|{k}|{n}|{g}"


_TABLE_CACHE: dict[str, tuple[float, dict]] = {}


def load_tuning_table(path: str | None = None) -> dict:
    """The tuning table's entries (`{}` if there is no file); re-read when it changes.

    **Arguments:**

    - `path`: the JSON file (default `tuning_path()`).

    **Returns:**

    A dict from keys `"kernel|device|dtype|M|K|N|G"` to config dicts.
    """
    path = tuning_path() if path is None else path
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return {}
    cached = _TABLE_CACHE.get(path)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    with open(path) as f:
        entries = json.load(f).get("entries", {})
    _TABLE_CACHE[path] = (mtime, entries)
    return entries


def _device_kind() -> str:
    try:
        return jax.devices()[0].device_kind
    except RuntimeError:  # pragma: no cover - no devices at all
        return "unknown"


def lookup_tile_config(
    kernel: Kernel,
    m: int,
    k: int,
    n: int,
    g: int,
    dtype,
    device_kind: str | None = None,
) -> MosaicTileConfig:
    """The tuned tiling for this shape if the table has one, else the heuristic.

    **Arguments:**

    - `kernel`: `"fwd"`, `"dlhs"` or `"drhs"`.
    - `m`, `k`, `n`, `g`: gmm sizes (`k`, `n` multiples of 64).
    - `dtype`: input dtype.
    - `device_kind`: defaults to the first device's `device_kind`.

    **Returns:**

    A valid `MosaicTileConfig`.
    """
    itemsize = jnp.dtype(dtype).itemsize
    kind = _device_kind() if device_kind is None else device_kind
    table = load_tuning_table()
    entry = table.get(_table_key(kernel, kind, dtype, m, k, n, g))
    if entry is None:
        # The row count (buffer size) varies with the batch; reuse the nearest.
        prefix = [kernel, kind, jnp.dtype(dtype).name]
        best = None
        for key, value in table.items():
            parts = key.split("|")
            if parts[:3] != prefix or parts[4:] != [str(k), str(n), str(g)]:
                continue
            dist = abs(math.log(int(parts[3]) / m))
            if best is None or dist < best[0]:
                best = (dist, value)
        entry = None if best is None else best[1]
    if entry is not None:
        fields = {
            f.name: int(entry[f.name]) for f in dataclasses.fields(MosaicTileConfig)
        }
        config = MosaicTileConfig(**fields)
        if config_is_valid(kernel, config, m, k, n, itemsize):
            return config
    return default_tile_config(kernel, m, k, n, g, itemsize)


# ---------------------------------------------------------------------------
# Kernel calls.


def _modules():
    # Lazy: these import Pallas/Mosaic GPU machinery that is useless off Hopper.
    from jax.experimental.pallas.ops.gpu import (
        ragged_dot_mgpu,
        transposed_ragged_dot_mgpu,
    )

    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


# The Pallas kernels this backend calls are internal to jax and change between
# releases: their signatures and tiling rules were checked on these versions (the
# interpreter tests run on 0.10 and 0.12). `auto` does not pick the backend outside
# them; `pyproject.toml`'s `cuda` extra has the same bounds.
TESTED_JAX = ((0, 10), (0, 12))


def _jax_version() -> tuple[int, int]:
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def mosaic_gpu_available() -> bool:
    """Whether the default device is a Hopper (compute capability 9.x) NVIDIA GPU, the
    Mosaic GPU ragged-dot kernels import, and jax is a version they were tested with
    (`TESTED_JAX`, inclusive)."""
    if not TESTED_JAX[0] <= _jax_version() <= TESTED_JAX[1]:
        return False
    try:
        device = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return False
    if device.platform != "gpu":
        return False
    capability = str(getattr(device, "compute_capability", ""))
    if not capability.startswith("9."):
        return False
    try:
        _modules()
    except Exception:  # pragma: no cover - depends on the jax build
        return False
    return True


def _pad_axis(x, axis: int, size: int):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _mask_rows(x, total):
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < total, x, jnp.zeros((), x.dtype))


def _ragged(lhs, rhs, group_sizes, config: MosaicTileConfig, transpose_rhs: bool):
    """`ragged_dot_mgpu.ragged_dot` with rows padded to `block_m`; rows past the groups
    are zero. `rhs` is `[G, K, N]` (`[G, N, K]`-contracted when `transpose_rhs`)."""
    ragged_dot_mgpu, _ = _modules()
    m = lhs.shape[0]
    lhs_p = _pad_axis(lhs, 0, _round_up(m, config.block_m))
    out = ragged_dot_mgpu.ragged_dot(
        lhs_p,
        rhs,
        group_sizes=group_sizes,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        max_concurrent_steps=config.max_concurrent_steps,
        grid_block_n=config.grid_block_n,
        transpose_rhs=transpose_rhs,
    )
    return _mask_rows(out[:m], jnp.sum(group_sizes))


def _transposed_ragged(lhs, d_out, group_sizes, config: MosaicTileConfig):
    """`d_rhs[g] = lhs_g^T @ d_out_g` with token rows padded to `block_k`."""
    _, transposed_ragged_dot_mgpu = _modules()
    rows = _round_up(lhs.shape[0], config.block_k)
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        _pad_axis(lhs, 0, rows),
        _pad_axis(d_out, 0, rows),
        group_sizes=group_sizes,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        max_concurrent_steps=config.max_concurrent_steps,
        grid_block_n=config.grid_block_n,
    )


@functools.cache
def _make_mosaic_gmm(
    fwd: MosaicTileConfig,
    dlhs: MosaicTileConfig,
    drhs: MosaicTileConfig,
    transpose_in_kernel: bool,
):
    @jax.custom_vjp
    def mosaic(lhs, rhs, group_sizes):
        return _ragged(lhs, rhs, group_sizes, fwd, False)

    def mosaic_fwd(lhs, rhs, group_sizes):
        return mosaic(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def mosaic_bwd(res, d_out):
        lhs, rhs, group_sizes = res
        d_out = d_out.astype(lhs.dtype)
        if transpose_in_kernel:
            d_lhs = _ragged(d_out, rhs, group_sizes, dlhs, True)
        else:
            d_lhs = _ragged(d_out, jnp.swapaxes(rhs, 1, 2), group_sizes, dlhs, False)
        d_rhs = _transposed_ragged(lhs, d_out, group_sizes, drhs).astype(rhs.dtype)
        d_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
        return d_lhs, d_rhs, d_sizes

    mosaic.defvjp(mosaic_fwd, mosaic_bwd)
    return mosaic


class MosaicGPUGMM(AbstractGMMBackend):
    """Grouped matmul on Hopper GPUs with the Pallas Mosaic GPU ragged-dot kernels.

    Pads `K` and `N` to multiples of 64 and the rows to the row tile when needed, masks
    rows past `sum(group_sizes)` to zero, and has its own backward. Inputs that are not
    bfloat16/float16 go to `fallback` (default `TiledGMM()`), since WGMMA would run
    float32 as TF32.

    **Arguments:**

    - `fwd_config`, `dlhs_config`, `drhs_config`: explicit tilings of the forward,
        `d_lhs` and `d_rhs` kernels; `None` looks them up (tuning table, then the
        heuristic `default_tile_config`).
    - `transpose_in_kernel`: compute `d_lhs` with the kernel's `transpose_rhs` (no
        copy of `rhs`); `False` materialises `rhs^T` as `[G, N, K]` first.
    - `fallback`: the backend used for other dtypes.
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
        k, n = _round_up(k, _DIM_ALIGN), _round_up(n, _DIM_ALIGN)
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
            kp, np_ = _round_up(k, _DIM_ALIGN), _round_up(n, _DIM_ALIGN)
            fwd, dlhs, drhs = self.configs(m, k, n, g, lhs.dtype)
            fn = _make_mosaic_gmm(fwd, dlhs, drhs, self.transpose_in_kernel)
            # Zero padding of K and N changes no product; sliced off again below.
            lhs_p = _pad_axis(lhs, 1, kp)
            rhs_p = _pad_axis(_pad_axis(rhs, 1, kp), 2, np_)
            lhs_p, rhs_p, sizes = match_varying(
                lhs_p, rhs_p, group_sizes.astype(jnp.int32)
            )
            return fn(lhs_p, rhs_p, sizes)[:, :n]


# ---------------------------------------------------------------------------
# Autotuning.


def candidate_configs(kernel: Kernel, quick: bool = False) -> list[MosaicTileConfig]:
    """The tilings `autotune_gmm` tries (before the validity filter).

    **Arguments:**

    - `kernel`: `"fwd"`, `"dlhs"` or `"drhs"`.
    - `quick`: a smaller set (about a dozen per kernel).

    **Returns:**

    A list of `MosaicTileConfig`.
    """
    if kernel == "drhs":
        blocks_m = blocks_n = (64, 128)
        blocks_k = (64, 128)
    else:
        blocks_m = (64, 128) if quick else (64, 128, 192)
        blocks_n = (128, 192) if quick else (64, 128, 192, 256)
        blocks_k = (64,)
    steps = (2, 4) if quick else (2, 3, 4, 5, 6)
    bands = (1, 8) if quick else (1, 2, 4, 8)
    return [
        MosaicTileConfig(bm, bn, bk, s, w)
        for bm in blocks_m
        for bn in blocks_n
        for bk in blocks_k
        for s in steps
        for w in bands
    ]


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def autotune_gmm(
    shapes: Iterable[Sequence[int]],
    dtype=jnp.bfloat16,
    *,
    kernels: Sequence[Kernel] = KERNELS,
    candidates: Sequence[MosaicTileConfig] | None = None,
    quick: bool = False,
    iters: int = 5,
    path: str | None = None,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, dict]:
    """Times candidate tilings of the Mosaic GPU kernels and saves the best per shape.

    For each `(M, K, N, G)` (uniform group sizes, random data) and each kernel, every
    valid candidate is compiled and timed (median of `iters` runs); configurations that
    fail to compile (e.g. out of shared memory) are skipped. The winners are merged into
    the JSON table at `path`, which `MosaicGPUGMM` reads. Needs a Hopper GPU.

    **Arguments:**

    - `shapes`: iterable of `(M, K, N, G)`.
    - `dtype`: `jnp.bfloat16` or `jnp.float16`.
    - `kernels`: which of `"fwd"`, `"dlhs"`, `"drhs"` to tune.
    - `candidates`: tilings to try (default `candidate_configs(kernel, quick)`).
    - `quick`: use the smaller default candidate set.
    - `iters`: timed runs per candidate.
    - `path`: the table (default `tuning_path()`).
    - `seed`: data seed.
    - `verbose`: print progress.

    **Returns:**

    The new entries, `{key: {**config, "ms": best_ms}}`.
    """
    if not mosaic_gpu_available():
        raise RuntimeError("autotune_gmm needs a Hopper GPU (compute capability 9.x).")
    path = tuning_path() if path is None else path
    kind = _device_kind()
    itemsize = jnp.dtype(dtype).itemsize
    new: dict[str, dict] = {}
    rng = jax.random.key(seed)
    for shape in shapes:
        m, k, n, g = (int(s) for s in shape)
        kp, np_ = _round_up(k, _DIM_ALIGN), _round_up(n, _DIM_ALIGN)
        sizes = np.full(g, m // g, np.int32)
        sizes[: m - int(sizes.sum())] += 1
        group_sizes = jnp.asarray(sizes)
        rng, k1, k2, k3 = jax.random.split(rng, 4)
        lhs = jax.random.normal(k1, (m, kp), dtype)
        rhs = jax.random.normal(k2, (g, kp, np_), dtype)
        d_out = jax.random.normal(k3, (m, np_), dtype)
        for kernel in kernels:
            best = None
            for config in candidates or candidate_configs(kernel, quick):
                if not config_is_valid(kernel, config, m, kp, np_, itemsize):
                    continue
                if kernel == "fwd":
                    fn = jax.jit(
                        functools.partial(_ragged, config=config, transpose_rhs=False)
                    )
                    args = (lhs, rhs, group_sizes)
                elif kernel == "dlhs":
                    fn = jax.jit(
                        functools.partial(_ragged, config=config, transpose_rhs=True)
                    )
                    args = (d_out, rhs, group_sizes)
                else:
                    fn = jax.jit(functools.partial(_transposed_ragged, config=config))
                    args = (lhs, d_out, group_sizes)
                try:
                    seconds = _time(fn, *args, iters=iters)
                except Exception as e:  # compile failures: shared memory, layouts
                    if verbose:
                        print(f"  {kernel} {config}: failed ({type(e).__name__})")
                    continue
                if verbose:
                    print(f"  {kernel} {config}: {seconds * 1e3:.3f} ms")
                if best is None or seconds < best[0]:
                    best = (seconds, config)
            if best is None:
                continue
            entry = _table_key(kernel, kind, dtype, m, kp, np_, g)
            new[entry] = {**best[1].as_dict(), "ms": best[0] * 1e3}
            if verbose:
                print(f"{entry}: {best[1]} {best[0] * 1e3:.3f} ms")
    entries = dict(load_tuning_table(path))
    entries.update(new)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return new
