"""A one-hot reference grouped matmul: small sizes only, the oracle of the tests."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._rules import acc_dtype
from ._base import AbstractGMMBackend, group_ids


class DenseGMM(AbstractGMMBackend):
    """Grouped matmul as one dense product with a one-hot expanded `lhs`.

    Builds `[M, G, K]` (row `i`'s activations in slot `g(i)`, zeros elsewhere) and
    contracts it with `rhs` as `[G*K, N]`. Costs `G` times the FLOPs and memory of the
    grouped product: an independent oracle for tests, not a production path. Gradients
    come from JAX's autodiff.
    """

    def __call__(
        self,
        lhs: Float[Array, "rows k_dim"],
        rhs: Float[Array, "groups k_dim n_dim"],
        group_sizes: Int[Array, " groups"],
    ) -> Float[Array, "rows n_dim"]:
        with jax.named_scope("moe_eqx.gmm.dense"):
            num_groups = rhs.shape[0]
            gid = group_ids(group_sizes, lhs.shape[0])
            one_hot = gid[:, None] == jnp.arange(num_groups, dtype=jnp.int32)[None, :]
            expanded = jnp.where(
                one_hot[:, :, None], lhs[:, None, :], jnp.zeros((), lhs.dtype)
            )
            acc = acc_dtype(lhs.dtype)
            out = jnp.einsum("mgk,gkn->mn", expanded, rhs, preferred_element_type=acc)
            return out.astype(lhs.dtype)
