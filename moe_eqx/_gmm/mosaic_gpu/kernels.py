"""Calls of the Pallas Mosaic GPU kernels shipped in jax, and whether they can run.

`ragged` is `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (the forward,
and `d_lhs` with `transpose_rhs=True`); `transposed_ragged` is
`transposed_ragged_dot_mgpu.transposed_ragged_dot` (`d_rhs`). Both pad the token rows to
their tile. The forward kernel never writes rows at or beyond `sum(group_sizes)` (they
hold uninitialised memory), so `ragged` masks them to zero (one select, which XLA can
fuse into the consumer). The `d_rhs` kernel zero-initialises its accumulator, so empty
groups get exact zeros. The Pallas modules are imported lazily, so importing moe_eqx
never needs a GPU.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .tiling import MosaicTileConfig, round_up


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


def pad_axis(x: Array, axis: int, size: int) -> Array:
    """`x` zero-padded at the end of `axis` to `size` (itself when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def mask_rows(x, total):
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < total, x, jnp.zeros((), x.dtype))


def ragged(
    lhs: Float[Array, "rows contracting"],
    rhs: Float[Array, "groups _ _"],
    group_sizes: Int[Array, " groups"],
    config: MosaicTileConfig,
    transpose_rhs: bool,
) -> Float[Array, "rows cols"]:
    """`ragged_dot_mgpu.ragged_dot` with rows padded to `block_m`; rows past the groups
    are zero. `rhs` is `[G, K, N]` (`[G, N, K]`-contracted when `transpose_rhs`)."""
    ragged_dot_mgpu, _ = _modules()
    m = lhs.shape[0]
    lhs_p = pad_axis(lhs, 0, round_up(m, config.block_m))
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
    return mask_rows(out[:m], jnp.sum(group_sizes))


def transposed_ragged(
    lhs: Float[Array, "rows k_dim"],
    d_out: Float[Array, "rows n_dim"],
    group_sizes: Int[Array, " groups"],
    config: MosaicTileConfig,
) -> Float[Array, "groups k_dim n_dim"]:
    """`d_rhs[g] = lhs_g^T @ d_out_g` with token rows padded to `block_k`."""
    _, transposed_ragged_dot_mgpu = _modules()
    rows = round_up(lhs.shape[0], config.block_k)
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        pad_axis(lhs, 0, rows),
        pad_axis(d_out, 0, rows),
        group_sizes=group_sizes,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        max_concurrent_steps=config.max_concurrent_steps,
        grid_block_n=config.grid_block_n,
    )
