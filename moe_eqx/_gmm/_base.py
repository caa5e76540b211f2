"""The grouped-matmul backend interface."""

import abc
import functools as ft

import equinox as eqx
import jax
import numpy as np
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


class AbstractAccumulatingGMMBackend(AbstractGMMBackend):
    """A GMM backend whose backward can add `d_rhs` into an existing buffer in place.

    Backends that are not of this kind get the same semantics from
    `generic_accumulating` (their own backward, then one add).
    """

    @abc.abstractmethod
    def accumulating(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
        rhs_grad_acc: Float[Array, "groups k_dim n_dim"],
    ) -> Float[Array, "rows n_dim"]:
        """The same product, with `rhs`'s gradient added into an accumulator.

        For gradient accumulation over chunks (the dropless fallback's backward) without
        a second weight-gradient buffer: under `jax.vjp`, the cotangent of
        `rhs_grad_acc` is `rhs_grad_acc + d_rhs` (in place where the backend can),
        `rhs` gets a zero cotangent and `lhs` its usual one. Do not differentiate
        `rhs` through this call.

        **Arguments:**

        - `lhs`, `rhs`, `group_sizes`: as for `__call__`.
        - `rhs_grad_acc`: `[G, K, N]`, the gradient of `rhs` so far (float32, or
            float64 for float64 inputs).

        **Returns:**

        The same `[M, N]` as `__call__`.
        """


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def generic_accumulating(backend, lhs, rhs, group_sizes, rhs_grad_acc):
    """`AbstractAccumulatingGMMBackend.accumulating` for any backend: its own
    backward, then one add (so one extra `[G, K, N]` buffer while the add runs)."""
    del rhs_grad_acc
    return backend(lhs, rhs, group_sizes)


def _generic_fwd(backend, lhs, rhs, group_sizes, rhs_grad_acc):
    # The backend's own vjp (a pytree of its residuals) is the residual: the backward
    # then never re-runs the forward product.
    out, vjp = jax.vjp(lambda a, b: backend(a, b, group_sizes), lhs, rhs)
    return out, (vjp, group_sizes, rhs_grad_acc)


def _generic_bwd(backend, res, d_out):
    vjp, group_sizes, acc = res
    d_lhs, d_rhs = vjp(d_out)
    d_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
    return d_lhs, None, d_sizes, acc + d_rhs.astype(acc.dtype)


generic_accumulating.defvjp(_generic_fwd, _generic_bwd)
