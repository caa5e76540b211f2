"""A grouped matmul that gathers each row's matrix: for fewer rows than groups.

The tiled loop visits every group and slices its weights, so its cost has a floor of
reading all `G` matrices however few rows there are. Gathering row `i`'s matrix
`rhs[g(i)]` reads `M` of them instead: cheaper whenever `M < G` (decode steps). The
products are plain JAX (a gather and a batched product), so JAX differentiates them
to every order.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._rules import acc_dtype, match_varying
from ._base import SWIGLU, AbstractGMMBackend, Activation, GradAcc, gmm_ffn
from .dense import group_ids


class GatheredGMM(AbstractGMMBackend):
    """Grouped matmul as one batched product of each row with its gathered matrix.

    Builds `[M, K, N]` (`rhs[g(i)]` for each row `i`): `M / G` times the weights'
    memory, so only for `M` at most a small multiple of `G`; `TiledGMM` uses it when
    `M < G`. Gradients come from JAX's autodiff (the weights' is a scatter-add into
    `[G, K, N]`).
    """

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        with jax.named_scope("moe_eqx.gmm.gathered"):
            lhs, rhs, group_sizes = match_varying(
                lhs, rhs, group_sizes.astype(jnp.int32)
            )
            num_groups = rhs.shape[0]
            gid = group_ids(group_sizes, lhs.shape[0])
            # Rows past `sum(group_sizes)` read the last group's matrix (any valid
            # index) and are zeroed below.
            weights = rhs[jnp.minimum(gid, num_groups - 1)]
            out = jnp.einsum(
                "mk,mkn->mn", lhs, weights, preferred_element_type=acc_dtype(lhs.dtype)
            )
            out = jnp.where((gid < num_groups)[:, None], out, jnp.zeros((), out.dtype))
            return out.astype(lhs.dtype)

    def ffn(
        self,
        x: Float[Array, "rows d_in"],
        w_gate_up: Float[Array, "groups d_in two_d_ff"],
        w_down: Float[Array, "groups d_ff d_model"],
        group_sizes: Int[Array, " groups"],
        grad_acc: GradAcc | None = None,
        *,
        activation: Activation = SWIGLU,
    ):
        return gmm_ffn(self, x, w_gate_up, w_down, group_sizes, grad_acc, activation)
