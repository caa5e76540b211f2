"""A router whose experts are chosen by token id (DeepSeek-V4's hash layers)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._router import AbstractRouter, Router, Routing


class HashRouter(AbstractRouter):
    """Experts chosen by a fixed table of the token ids, weighted by a router's
    scores (DeepSeek-V4's first layers, `gate.tid2eid`).

    Token `t` with id `i` goes to experts `tid2eid[i]`, weighted by `scorer`'s scores
    at those experts, normalised as `scorer` normalises (DeepSeek-V4: renormalised,
    then `routed_scaling_factor`): the routing replay of [`moe_eqx.Router`][] with
    the table's ids, so the scorer's weight gets its gradient and the table none.

    The layer hands a router the tokens' activations, not their ids: the caller
    looks the ids up and passes them as forced experts,

    ```python
    y, stats = layer(x, experts=layer.router.experts_for(input_ids))
    ```

    (inside your own `shard_map`, `me.expert_parallel_shard(layer, x,
    experts=...)` with this shard's ids). Called without them it raises: a hash
    layer has no top-k of its own to fall back on.

    **Fields:**

    - `scorer`: the [`moe_eqx.Router`][] whose scores weight the chosen experts
        (`layer.router.scorer.weight [d_model, E]`).
    - `tid2eid`: `[vocab, k]` int32, the experts of each token id.
    """

    scorer: Router
    tid2eid: Int[Array, "vocab k"]

    def __check_init__(self):
        k = self.tid2eid.shape[-1]
        if self.tid2eid.ndim != 2 or k != self.scorer.top_k:
            raise ValueError(
                f"`tid2eid` must be [vocab, top_k={self.scorer.top_k}], got "
                f"{tuple(self.tid2eid.shape)}."
            )
        if not jnp.issubdtype(self.tid2eid.dtype, jnp.integer):
            raise ValueError(
                f"`tid2eid` must be integer expert ids, got {self.tid2eid.dtype}."
            )

    def experts_for(self, token_ids: Int[Array, "*batch"]) -> Int[Array, "*batch k"]:
        """The forced experts `[..., k]` of tokens with these ids (`[...]`, integers
        in `[0, vocab)`; an id outside is a `ValueError` where it is concrete)."""
        token_ids = jnp.asarray(token_ids)
        if not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise TypeError(
                f"`token_ids` must be integers, got dtype {token_ids.dtype}."
            )
        vocab = self.tid2eid.shape[0]
        if not isinstance(token_ids, jax.core.Tracer) and token_ids.size:
            concrete = np.asarray(token_ids)  # NumPy: not staged under a `jit`
            low, high = int(concrete.min()), int(concrete.max())
            if low < 0 or high >= vocab:
                raise ValueError(
                    f"`token_ids` must be in [0, {vocab}) (the table's vocabulary), "
                    f"got values in [{low}, {high}]."
                )
        return self.tid2eid[token_ids].astype(jnp.int32)

    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        valid: Bool[Array, " tokens"] | None = None,
        *,
        experts: Int[Array, "tokens k"] | None = None,
    ) -> Routing:
        if experts is None:
            raise ValueError(
                "A hash-routed layer chooses its experts by token id: call it with "
                "`experts=layer.router.experts_for(input_ids)`."
            )
        return self.scorer(x, valid, experts=experts)


def hash_layer(layer, tid2eid) -> eqx.Module:
    """`layer` with its router replaced by a [`moe_eqx.HashRouter`][] on the same
    router (its scorer) and the table `tid2eid [vocab, k]`."""
    router = HashRouter(scorer=layer.router, tid2eid=jnp.asarray(tid2eid, jnp.int32))
    return eqx.tree_at(lambda l: l.router, layer, router)
