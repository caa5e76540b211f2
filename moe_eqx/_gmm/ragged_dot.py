"""`lax.ragged_dot`: the TPU path and a reference everywhere else.

Off TPU it lowers to a dense masked product, `G` times the work (see
`docs/measured.md`), so `auto` never picks it there.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._base import SWIGLU, AbstractGMMBackend, Activation, GradAcc, gmm_ffn


class RaggedDotGMM(AbstractGMMBackend):
    """Grouped matmul through `jax.lax.ragged_dot`."""

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        out = jax.lax.ragged_dot(
            lhs,
            rhs,
            group_sizes.astype(jnp.int32),
            preferred_element_type=jnp.float32,
        )
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
