"""Hopper (sm_90) grouped matmul on the Pallas Mosaic GPU kernels shipped in jax.

Forward: `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`; backward
(the transpose of a `jax.custom_jvp`'s tangent): the same kernel for `d_lhs` and
`transposed_ragged_dot_mgpu.transposed_ragged_dot` for `d_rhs`. The kernels take equal
16-bit input dtypes (WGMMA; float32 would silently run as TF32, so float32 inputs use
the tiled backend instead).

Tile configurations come, in order, from: the backend's explicit fields, the tuning
table written by `autotune_gmm` (`$MOE_EQX_GMM_TUNING`, default
`~/.cache/moe_eqx/gmm_tuning.json`; exact shape, else the nearest `M` for the same
device, dtype, `K`, `N`, `G`), then `default_tile_config`.

Modules, one concern each: `tiling` (`MosaicTileConfig`, the kernels' constraints, the
heuristic), `tuning` (the tuning table file), `kernels` (the padded, masked kernel
calls and `mosaic_gpu_available`), `derivatives` (the `custom_jvp`), `backend`
(`MosaicGPUGMM`), `autotune` (`autotune_gmm`). `moe_eqx` re-exports only
`MosaicGPUGMM`, `MosaicTileConfig` (the type of its tiling fields),
`mosaic_gpu_available` and `autotune_gmm`; the tuning internals are reached here.
"""

from .autotune import (
    autotune_gmm as autotune_gmm,
    candidate_configs as candidate_configs,
)
from .backend import MosaicGPUGMM as MosaicGPUGMM
from .kernels import (
    TESTED_JAX as TESTED_JAX,
    mosaic_gpu_available as mosaic_gpu_available,
)
from .tiling import (
    KERNELS as KERNELS,
    Kernel as Kernel,
    MosaicTileConfig as MosaicTileConfig,
    config_is_valid as config_is_valid,
    default_tile_config as default_tile_config,
)
from .tuning import (
    load_tuning_table as load_tuning_table,
    lookup_tile_config as lookup_tile_config,
    tuning_path as tuning_path,
)
