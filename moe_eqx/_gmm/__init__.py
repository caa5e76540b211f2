"""Grouped matmul (`me.gmm`) and its interchangeable backends."""

import jax
from jaxtyping import Array, Float, Int

from ._base import AbstractGMMBackend as AbstractGMMBackend
from .ragged_dot import RaggedDotGMM as RaggedDotGMM

_BACKENDS = {
    "ragged_dot": RaggedDotGMM,
}


def resolve_backend(name: str) -> AbstractGMMBackend:
    """Returns the backend instance for `name` (`"auto"` picks by platform)."""
    if name == "auto":
        name = "ragged_dot"
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"Unknown `gmm_backend` {name!r}; expected one of "
            f"{('auto', *_BACKENDS)}."
        ) from None


def gmm(
    lhs: Float[Array, "rows k_dim"],
    rhs: Float[Array, "groups k_dim n_dim"],
    group_sizes: Int[Array, " groups"],
    *,
    backend: str | AbstractGMMBackend = "auto",
) -> Float[Array, "rows n_dim"]:
    """Grouped matrix multiply: row `i` of `lhs` (rows sorted by group) times `rhs[g(i)]`.

    **Arguments:**

    - `lhs`: `[M, K]`.
    - `rhs`: `[G, K, N]`.
    - `group_sizes`: `[G]` int32, `sum(group_sizes) <= M`.
    - `backend`: a backend name or an `AbstractGMMBackend` instance. `"auto"` picks the
        fastest available backend for the current platform, never `lax.ragged_dot` on
        CPU or GPU.

    **Returns:**

    `[M, N]`; rows at or beyond `sum(group_sizes)` are zero.
    """
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"gmm: contracting dims differ: lhs {lhs.shape} vs rhs {rhs.shape}."
        )
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"gmm: `group_sizes` has shape {group_sizes.shape}, expected "
            f"({rhs.shape[0]},)."
        )
    impl = backend if isinstance(backend, AbstractGMMBackend) else resolve_backend(backend)
    with jax.named_scope("moe_eqx.gmm"):
        return impl(lhs, rhs, group_sizes)
