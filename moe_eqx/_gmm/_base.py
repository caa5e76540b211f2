"""The grouped-matmul backend interface."""

import abc

import equinox as eqx
from jaxtyping import Array, Float, Int


class AbstractGMMBackend(eqx.Module):
    """A grouped matrix multiply: rows of `lhs` are split into consecutive groups, and
    group `g` is multiplied by `rhs[g]`."""

    @abc.abstractmethod
    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        """Computes `out[i] = lhs[i] @ rhs[g(i)]` where `g(i)` is the group of row `i`.

        **Arguments:**

        - `lhs`: `[M, K]` rows sorted by group.
        - `rhs`: `[G, K, N]` one matrix per group.
        - `group_sizes`: `[G]` non-negative int32 sizes with `sum(group_sizes) <= M`.

        **Returns:**

        `[M, N]` in `lhs.dtype` (accumulated in float32). Rows at or beyond
        `sum(group_sizes)` are exactly zero. Differentiable with respect to `lhs` and
        `rhs`; gradients of rows beyond `sum(group_sizes)` and of empty groups are zero.
        """
