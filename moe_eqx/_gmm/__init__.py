"""Grouped matmul (`me.gmm`), the expert FFN built on it, and their interchangeable
backends."""

import jax
from jaxtyping import Array, Float, Int

from .._checks import check_array, check_group_sizes
from ._base import (
    AbstractGMMBackend as AbstractGMMBackend,
    GradAcc as GradAcc,
    gmm_ffn as gmm_ffn,
)
from .dense import DenseGMM as DenseGMM
from .megablox import MegabloxGMM as MegabloxGMM
from .mosaic_gpu import (
    MosaicGPUGMM as MosaicGPUGMM,
    MosaicTileConfig as MosaicTileConfig,
    autotune_gmm as autotune_gmm,
    mosaic_gpu_available as mosaic_gpu_available,
)
from .pallas_tpu import PallasTPUGMM as PallasTPUGMM
from .ragged_dot import RaggedDotGMM as RaggedDotGMM
from .tiled import TiledGMM as TiledGMM

_BACKENDS = {
    "tiled": TiledGMM,
    "ragged_dot": RaggedDotGMM,
    "dense": DenseGMM,
    "mosaic_gpu": MosaicGPUGMM,
    "pallas_tpu": PallasTPUGMM,
    "megablox": MegabloxGMM,
}


def auto_backend_name(platform: str | None = None) -> str:
    """The backend `"auto"` resolves to on `platform` (default: the default backend).

    TPU: `"pallas_tpu"` (its decode kernel for few rows, `lax.ragged_dot` for
    more). Hopper GPU (compute capability 9.x) with the
    Mosaic GPU kernels importable: `"mosaic_gpu"`. Anything else: `"tiled"`. Never
    `"ragged_dot"` on CPU or GPU, where it lowers to a dense masked product.
    """
    platform = jax.default_backend() if platform is None else platform
    if platform == "tpu":
        return "pallas_tpu"
    if platform in ("gpu", "cuda") and mosaic_gpu_available():
        return "mosaic_gpu"
    return "tiled"


def resolve_backend(
    name: "str | AbstractGMMBackend", platform: str | None = None
) -> AbstractGMMBackend:
    """Returns the backend instance for `name` (`"auto"` picks by `platform`).

    **Arguments:**

    - `name`: `"auto"`, `"tiled"`, `"ragged_dot"`, `"dense"`, `"mosaic_gpu"`,
        `"pallas_tpu"`, or an
        `AbstractGMMBackend` instance (returned as is).
    - `platform`: for `"auto"`; default: the default backend.

    **Returns:**

    An `AbstractGMMBackend`. Raises `ValueError` for any other name.
    """
    if isinstance(name, AbstractGMMBackend):
        return name
    if name == "auto":
        name = auto_backend_name(platform)
    try:
        return _BACKENDS[name]()
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown `gmm_backend` {name!r}; expected one of {('auto', *_BACKENDS)}."
        ) from None


def gmm(
    lhs: Float[Array, "rows k_dim"],
    rhs: Float[Array, "groups k_dim n_dim"],
    group_sizes: Int[Array, " groups"],
    *,
    backend: str | AbstractGMMBackend = "auto",
) -> Float[Array, "rows n_dim"]:
    """Grouped matmul: row `i` of `lhs` (rows sorted by group) times `rhs[g(i)]`.

    **Arguments:**

    - `lhs`: `[M, K]`.
    - `rhs`: `[G, K, N]`, same dtype as `lhs`.
    - `group_sizes`: `[G]` int32, `sum(group_sizes) <= M`; may be traced.
    - `backend`: a backend name or an `AbstractGMMBackend` instance. `"auto"` picks the
        fastest available backend for the current platform (`resolve_backend`), never
        `lax.ragged_dot` on CPU or GPU.

    **Returns:**

    `[M, N]` in `lhs.dtype` (float32 accumulation); rows at or beyond
    `sum(group_sizes)` are zero. Differentiable with respect to `lhs` and `rhs`, in
    forward and reverse mode.
    """
    check_array("lhs", lhs, ndim=2, kind="float", where="gmm")
    check_array("rhs", rhs, ndim=3, kind="float", where="gmm")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"gmm: contracting dims differ: lhs {lhs.shape} vs rhs {rhs.shape}."
        )
    check_group_sizes("group_sizes", group_sizes, rhs.shape[0], lhs.shape[0], "gmm")
    if lhs.dtype != rhs.dtype:
        raise ValueError(
            f"gmm: `lhs` ({lhs.dtype}) and `rhs` ({rhs.dtype}) must have the same "
            "dtype."
        )
    impl = resolve_backend(backend)
    with jax.named_scope("moe_eqx.gmm"):
        return impl(lhs, rhs, group_sizes)
