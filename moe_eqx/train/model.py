"""The demo's model: a decoder-only transformer whose feed-forward networks are
[`moe_eqx.MoELayer`][]s.

The model: token embedding, pre-norm transformer blocks (causal self-attention, then a
`moe_eqx.MoELayer` as the FFN), a tied (or separate) output head.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._config import MoEConfig
from .._layer import MoELayer
from .._stats import MoEStats


def rms_norm(
    x: Float[Array, "*batch d_model"], scale: Float[Array, " d_model"]
) -> Float[Array, "*batch d_model"]:
    """RMSNorm over the last axis.

    **Arguments:**

    - `x`: activations `[..., d_model]`.
    - `scale`: `[d_model]` learnt gain.

    **Returns:**

    `x / rms(x) * scale`, same shape as `x`.
    """
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    gain = scale.reshape((1,) * (x.ndim - 1) + scale.shape)
    return x * jax.lax.rsqrt(var + jnp.asarray(1e-6, x.dtype)) * gain


class Attention(eqx.Module):
    """Causal multi-head self-attention without biases.

    **Fields:**

    - `w_qkv`: `[d_model, 3 d_model]` fused query/key/value projection.
    - `w_out`: `[d_model, d_model]` output projection.
    - `num_heads`: number of heads (divides `d_model`).
    """

    w_qkv: Float[Array, "d_model three_d_model"]
    w_out: Float[Array, "d_model d_model"]
    num_heads: int = eqx.field(static=True)

    def __init__(self, d_model: int, num_heads: int, *, key: PRNGKeyArray):
        qkv_key, out_key = jr.split(key)
        scale = 1.0 / math.sqrt(d_model)
        self.w_qkv = scale * jr.normal(qkv_key, (d_model, 3 * d_model), jnp.float32)
        self.w_out = scale * jr.normal(out_key, (d_model, d_model), jnp.float32)
        self.num_heads = num_heads

    def __call__(
        self, x: Float[Array, "batch seq d_model"]
    ) -> Float[Array, "batch seq d_model"]:
        """Attends each position to itself and the positions before it.

        **Arguments:**

        - `x`: `[batch, seq, d_model]`.

        **Returns:**

        `[batch, seq, d_model]`.
        """
        b, s, d = x.shape
        h = self.num_heads
        qkv = (x @ self.w_qkv).reshape(b, s, 3, h, d // h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.asarray(
            math.sqrt(d // h), x.dtype
        )
        causal = jnp.tril(jnp.ones((1, 1, s, s), bool))
        logits = jnp.where(causal, logits, jnp.asarray(-1e30, logits.dtype))
        attn = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhc->bqhc", attn, v).reshape(b, s, d)
        return out @ self.w_out


class Block(eqx.Module):
    """Pre-norm transformer block: `x + attn(norm(x))`, then `x + moe(norm(x))`.

    **Fields:**

    - `attn_norm`, `moe_norm`: `[d_model]` RMSNorm gains.
    - `attn`: the [`moe_eqx.train.model.Attention`][].
    - `moe`: the [`moe_eqx.MoELayer`][] used as the feed-forward network.
    """

    attn_norm: Float[Array, " d_model"]
    attn: Attention
    moe_norm: Float[Array, " d_model"]
    moe: MoELayer

    def __init__(self, config: MoEConfig, num_heads: int, *, key: PRNGKeyArray):
        attn_key, moe_key = jr.split(key)
        d = config.d_model
        self.attn_norm = jnp.ones((d,), jnp.float32)
        self.attn = Attention(d, num_heads, key=attn_key)
        self.moe_norm = jnp.ones((d,), jnp.float32)
        self.moe = MoELayer(config, key=moe_key)

    def __call__(
        self, x: Float[Array, "batch seq d_model"], *, mesh: Mesh | None
    ) -> tuple[Float[Array, "batch seq d_model"], MoEStats]:
        """Applies the block; the MoE layer sees the `batch * seq` tokens flattened.

        **Arguments:**

        - `x`: `[batch, seq, d_model]`.
        - `mesh`: `None` (one device) or the expert-parallel mesh.

        **Returns:**

        `(x, stats)`: `[batch, seq, d_model]` and the layer's [`moe_eqx.MoEStats`][].
        """
        b, s, d = x.shape
        x = x + self.attn(rms_norm(x, self.attn_norm))
        h = rms_norm(x, self.moe_norm).reshape(b * s, d)
        y, stats = self.moe(h, mesh=mesh)
        return x + y.reshape(b, s, d), stats


class MoELM(eqx.Module):
    """A decoder-only MoE language model: embedding, scanned `Block`s, final norm,
    tied or separate output head.

    **Fields:**

    - `embed`: `[vocab, d_model]` token embedding.
    - `blocks`: one [`moe_eqx.train.model.Block`][] whose arrays have a leading
        `layers` axis (applied with `lax.scan`, so compile time does not grow with
        depth).
    - `final_norm`: `[d_model]` RMSNorm gain.
    - `head`: `[d_model, vocab]`, or `None` for a head tied to `embed`.
    - `dropout`: embedding dropout rate.
    """

    embed: Float[Array, "vocab d_model"]
    blocks: Block
    final_norm: Float[Array, " d_model"]
    head: Float[Array, "d_model vocab"] | None
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        config: MoEConfig,
        *,
        vocab: int,
        num_layers: int,
        num_heads: int,
        tied_head: bool,
        dropout: float,
        key: PRNGKeyArray,
    ):
        embed_key, blocks_key, head_key = jr.split(key, 3)
        d = config.d_model
        self.embed = jr.normal(embed_key, (vocab, d), jnp.float32)
        block_keys = jr.split(blocks_key, num_layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(config, num_heads, key=k))(
            block_keys
        )
        self.final_norm = jnp.ones((d,), jnp.float32)
        self.head = (
            None
            if tied_head
            else jr.normal(head_key, (d, vocab), jnp.float32) / math.sqrt(d)
        )
        self.dropout = dropout

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mesh: Mesh | None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], MoEStats]:
        """Next-token logits.

        **Arguments:**

        - `tokens`: `[batch, seq]` token ids.
        - `mesh`: `None` (one device) or the expert-parallel mesh.
        - `key`: for dropout; `None` disables it.

        **Returns:**

        `(logits, stats)`: `[batch, seq, vocab]` and the MoE stats of every layer,
        stacked along a leading `layers` axis.
        """
        x = self.embed[tokens]
        if self.dropout > 0 and key is not None:
            keep = jr.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), 0.0)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x, block_arrays):
            block = eqx.combine(block_arrays, static)
            return block(x, mesh=mesh)

        if self.blocks.moe.config.fsdp_axes:
            # Experts split over the data axes: each block is recomputed in the
            # backward pass, which gathers its experts again, so that one block's
            # gathered experts are alive at a time rather than every block's.
            layer = jax.checkpoint(layer)
        x, stats = jax.lax.scan(layer, x, dynamic)
        x = rms_norm(x, self.final_norm)
        if self.head is None:
            # The embedding rows have unit scale; 1/sqrt(d) keeps tied logits O(1).
            logits = x @ self.embed.T / jnp.asarray(math.sqrt(x.shape[-1]), x.dtype)
        else:
            logits = x @ self.head
        return logits, stats


def model_from_args(args, config: MoEConfig, *, key: PRNGKeyArray) -> MoELM:
    """The demo's model from its command-line flags (`moe_eqx.train.cli`) and the MoE
    layers' config."""
    return MoELM(
        config,
        vocab=args.vocab,
        num_layers=args.layers,
        num_heads=args.heads,
        tied_head=not args.untied_head,
        dropout=args.dropout,
        key=key,
    )
