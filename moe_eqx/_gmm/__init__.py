"""Grouped matmul (`me.gmm`) and its interchangeable backends."""

import jax
from jaxtyping import Array, Float, Int

from ._base import (
    AbstractAccumulatingGMMBackend as AbstractAccumulatingGMMBackend,
    AbstractGMMBackend as AbstractGMMBackend,
    generic_accumulating,
)
from .dense import DenseGMM as DenseGMM
from .mosaic_gpu import (
    MosaicGPUGMM as MosaicGPUGMM,
    MosaicTileConfig as MosaicTileConfig,
    autotune_gmm as autotune_gmm,
    mosaic_gpu_available as mosaic_gpu_available,
)
from .ragged_dot import RaggedDotGMM as RaggedDotGMM
from .tiled import TiledGMM as TiledGMM

_BACKENDS = {
    "tiled": TiledGMM,
    "ragged_dot": RaggedDotGMM,
    "dense": DenseGMM,
    "mosaic_gpu": MosaicGPUGMM,
}


def auto_backend_name(platform: str | None = None) -> str:
    """The backend `"auto"` resolves to on `platform` (default: the default backend).

    TPU: `"ragged_dot"` (native there). Hopper GPU (compute capability 9.x) with the
    Mosaic GPU kernels importable: `"mosaic_gpu"`. Anything else: `"tiled"`. Never
    `"ragged_dot"` on CPU or GPU, where it lowers to a dense masked product.
    """
    platform = jax.default_backend() if platform is None else platform
    if platform == "tpu":
        return "ragged_dot"
    if platform == "gpu" and mosaic_gpu_available():
        return "mosaic_gpu"
    return "tiled"


def resolve_backend(name: str) -> AbstractGMMBackend:
    """Returns the backend instance for `name` (`"auto"` picks by platform).

    **Arguments:**

    - `name`: `"auto"`, `"tiled"`, `"ragged_dot"`, `"dense"` or `"mosaic_gpu"`.

    **Returns:**

    An `AbstractGMMBackend`. Raises `ValueError` for any other name.
    """
    if name == "auto":
        name = auto_backend_name()
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
    `sum(group_sizes)` are zero. Differentiable with respect to `lhs` and `rhs`.
    """
    impl = _checked_backend(lhs, rhs, group_sizes, backend)
    with jax.named_scope("moe_eqx.gmm"):
        return impl(lhs, rhs, group_sizes)


def accumulating_gmm(
    lhs: Float[Array, "rows k_dim"],
    rhs: Float[Array, "groups k_dim n_dim"],
    group_sizes: Int[Array, " groups"],
    rhs_grad_acc: Float[Array, "groups k_dim n_dim"],
    *,
    backend: str | AbstractGMMBackend = "auto",
) -> Float[Array, "rows n_dim"]:
    """`gmm` whose backward adds `rhs`'s gradient into `rhs_grad_acc`'s cotangent.

    See `AbstractAccumulatingGMMBackend.accumulating`: under `jax.vjp`, the cotangent
    of `rhs_grad_acc` is `rhs_grad_acc + d_rhs` and `rhs` gets none. Used by the
    dropless fallback's backward to sum weight gradients over chunks in one buffer:
    in place for accumulating backends (`tiled`), with one add for the others.

    **Arguments:**

    - `lhs`, `rhs`, `group_sizes`, `backend`: as for `gmm`.
    - `rhs_grad_acc`: `[G, K, N]` float accumulator.

    **Returns:**

    The same `[M, N]` as `gmm`.
    """
    impl = _checked_backend(lhs, rhs, group_sizes, backend)
    if rhs_grad_acc.shape != rhs.shape:
        raise ValueError(
            f"gmm: `rhs_grad_acc` has shape {rhs_grad_acc.shape}, expected {rhs.shape}."
        )
    with jax.named_scope("moe_eqx.gmm"):
        if isinstance(impl, AbstractAccumulatingGMMBackend):
            return impl.accumulating(lhs, rhs, group_sizes, rhs_grad_acc)
        return generic_accumulating(impl, lhs, rhs, group_sizes, rhs_grad_acc)


def _checked_backend(lhs, rhs, group_sizes, backend) -> AbstractGMMBackend:
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"gmm: contracting dims differ: lhs {lhs.shape} vs rhs {rhs.shape}."
        )
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"gmm: `group_sizes` has shape {group_sizes.shape}, expected "
            f"({rhs.shape[0]},)."
        )
    if lhs.dtype != rhs.dtype:
        raise ValueError(
            f"gmm: `lhs` ({lhs.dtype}) and `rhs` ({rhs.dtype}) must have the same "
            "dtype."
        )
    if isinstance(backend, AbstractGMMBackend):
        return backend
    return resolve_backend(backend)
