"""`autotune_gmm`: times candidate tilings of each kernel on the user's GPU and saves
the fastest per shape in the tuning table."""

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .kernels import mosaic_gpu_available, ragged, transposed_ragged
from .tiling import KERNELS, Kernel, MosaicTileConfig, config_is_valid, padded_dims
from .tuning import current_device_kind, save_tuning_entries, table_key, tuning_path


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


class _Operands(NamedTuple):
    """Random inputs of one tuned shape, `K` and `N` already padded."""

    lhs: Float[Array, "rows k_dim"]
    rhs: Float[Array, "groups k_dim n_dim"]
    d_out: Float[Array, "rows n_dim"]
    group_sizes: Int[Array, " groups"]


def _operands(keys, m: int, kp: int, np_: int, g: int, dtype) -> _Operands:
    # Uniform groups: the first `M mod G` groups get one extra row.
    sizes = np.full(g, m // g, np.int32)
    sizes[: m - int(sizes.sum())] += 1
    k1, k2, k3 = keys
    return _Operands(
        lhs=jax.random.normal(k1, (m, kp), dtype),
        rhs=jax.random.normal(k2, (g, kp, np_), dtype),
        d_out=jax.random.normal(k3, (m, np_), dtype),
        group_sizes=jnp.asarray(sizes),
    )


def _kernel_call(
    kernel: Kernel, config: MosaicTileConfig, ops: _Operands
) -> tuple[Callable, tuple]:
    """The jitted kernel call `kernel` makes in `MosaicGPUGMM`, and its arguments."""
    if kernel == "fwd":
        fn = functools.partial(ragged, config=config, transpose_rhs=False)
        return jax.jit(fn), (ops.lhs, ops.rhs, ops.group_sizes)
    if kernel == "dlhs":
        fn = functools.partial(ragged, config=config, transpose_rhs=True)
        return jax.jit(fn), (ops.d_out, ops.rhs, ops.group_sizes)
    fn = functools.partial(transposed_ragged, config=config)
    return jax.jit(fn), (ops.lhs, ops.d_out, ops.group_sizes)


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fastest(
    kernel: Kernel,
    candidates: Iterable[MosaicTileConfig],
    ops: _Operands,
    *,
    iters: int,
    verbose: bool,
) -> tuple[float, MosaicTileConfig] | None:
    """`(median seconds, config)` of the fastest valid candidate that compiles, or
    `None` when none does."""
    m, kp = ops.lhs.shape
    np_ = ops.rhs.shape[2]
    itemsize = ops.lhs.dtype.itemsize
    best = None
    for config in candidates:
        if not config_is_valid(kernel, config, m, kp, np_, itemsize):
            continue
        fn, args = _kernel_call(kernel, config, ops)
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
    return best


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
    the JSON table at `path`, which [`moe_eqx.MosaicGPUGMM`][] reads. Needs a Hopper
    GPU.

    **Arguments:**

    - `shapes`: iterable of `(M, K, N, G)`.
    - `dtype`: `jnp.bfloat16` or `jnp.float16`.
    - `kernels`: which of `"fwd"`, `"dlhs"`, `"drhs"` to tune.
    - `candidates`: tilings to try (default `candidate_configs(kernel, quick)`).
    - `quick`: use the smaller default candidate set.
    - `iters`: timed runs per candidate.
    - `path`: the table (default `tuning_path()`: `$MOE_EQX_GMM_TUNING`, else
        `~/.cache/moe_eqx/gmm_tuning.json`).
    - `seed`: data seed.
    - `verbose`: print progress.

    **Returns:**

    The new entries, `{key: {**config, "ms": best_ms}}`.
    """
    if not mosaic_gpu_available():
        raise RuntimeError("autotune_gmm needs a Hopper GPU (compute capability 9.x).")
    path = tuning_path() if path is None else path
    kind = current_device_kind()
    new: dict[str, dict] = {}
    rng = jax.random.key(seed)
    for shape in shapes:
        m, k, n, g = (int(s) for s in shape)
        kp, np_ = padded_dims(k, n)
        rng, *keys = jax.random.split(rng, 4)
        ops = _operands(keys, m, kp, np_, g, dtype)
        for kernel in kernels:
            tried = candidates or candidate_configs(kernel, quick)
            best = _fastest(kernel, tried, ops, iters=iters, verbose=verbose)
            if best is None:
                continue
            entry = table_key(kernel, kind, dtype, m, kp, np_, g)
            new[entry] = {**best[1].as_dict(), "ms": best[0] * 1e3}
            if verbose:
                print(f"{entry}: {best[1]} {best[0] * 1e3:.3f} ms")
    save_tuning_entries(path, new)
    return new
