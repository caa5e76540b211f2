"""The dense oracle, `reference_moe`: every token through each of its experts with
plain matmuls, written from the parameter layout and the activations' fields, not
from the stages' code."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from ._activation import (
    GELU,
    ClampedSwiGLU,
    GeGLU,
    ReLU,
    ReLU2,
    SiLU,
    SoftcapSwiGLU,
    SwiGLU,
)
from ._layer import MoELayer, check_ids
from ._mesh import spec_axes
from ._quant import as_float
from ._rules import has_explicit_axes


def reference_moe(
    layer: MoELayer,
    x: Float[Array, "*batch d_model"],
    *,
    experts: Int[Array, "*batch k"] | None = None,
) -> Float[Array, "*batch d_model"]:
    """Dense oracle: every token through each of its top-k experts, no dispatch at all.

    Uses the layer's router (the built-in one or your own) for the routing decision
    and evaluates `y[t] = routed_scaling_factor * sum_j w[t, j] *
    expert_{e[t, j]}(x[t]) + scale * g(x[t]) * shared(x[t])` (with
    `ExpertOptions.weight_on_input`, `expert_{e[t, j]}(w[t, j] * x[t])` unweighted;
    with shared experts the router scores, each one's hidden units times its routing
    weight instead of `g`) with dense per-expert matmuls over all tokens (`O(T * E)`
    work: for tests and small sizes). The built-in activations are written out here
    from their fields, not taken from the experts' code; a user's own activation is
    called.

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][].
    - `x`: `[..., d_model]`.
    - `experts`: optional `[..., k]` forced expert ids (routing replay): the router's
        weights at these ids replace its top-k, as in the layer.

    **Returns:**

    The shape and dtype of `x`, and its sharding when `x` is split over `Explicit`
    mesh axes (the oracle itself computes on replicated arrays).
    """
    if experts is not None:
        check_ids(experts, x.shape[:-1], layer.config)
        experts = _replicate(experts).reshape(-1, layer.config.top_k)
    # Its dense scatters and einsums have no sharding rule for tokens or experts split
    # over `Explicit` axes: such arrays are replicated, and the result split as `x`.
    explicit = _explicit_sharding(x)
    layer = jax.tree.map(lambda a: _replicate(a) if eqx.is_array(a) else a, layer)
    y = _reference(layer, _replicate(x), experts)
    if explicit is not None:
        y = jax.sharding.reshard(y, explicit)
    return y


def _explicit_sharding(a):
    """`a`'s sharding (its type's, so also for a tracer) if it is split over some
    `Explicit` mesh axis, else `None`."""
    sharding = jax.typeof(a).sharding
    spec = getattr(sharding, "spec", None)
    if spec is None or not has_explicit_axes(sharding.mesh):
        return None
    explicit = {
        name
        for name, kind in zip(
            sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True
        )
        if kind == jax.sharding.AxisType.Explicit
    }
    return sharding if explicit & set(spec_axes(spec)) else None


def _replicate(a):
    if _explicit_sharding(a) is None:
        return a
    sharding = jax.typeof(a).sharding
    return jax.sharding.reshard(a, NamedSharding(sharding.mesh, P()))


def _reference(layer: MoELayer, x: Float[Array, "*batch d_model"], forced=None):
    batch_shape = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if forced is None:
        routing = layer.router(x)
    else:
        routing = layer.router(x, experts=forced)
    num_experts = layer.config.num_experts
    # Dense [T, E] combine weights: w[t, j] at column e[t, j].
    dense_w = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    real = routing.experts < num_experts  # else an identity expert: w x below
    dense_w = dense_w.at[
        jnp.arange(x.shape[0])[:, None], jnp.where(real, routing.experts, 0)
    ].add(jnp.where(real, routing.weights, 0.0))
    # Columns in physical order: the weights at position p are expert expert_ids[p].
    dense_w = dense_w[:, layer.expert_ids]
    xf = x.astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    w_gu = as_float(layer.experts.w_gate_up, jnp.float32)
    experts = layer.experts
    if experts.weight_on_input:  # expert e sees w[t, e] x[t] (Llama-4)
        xin = dense_w.T[:, :, None] * xf[None]
        gu = jnp.einsum("eth,ehf->etf", xin, w_gu, precision=hp)
    else:
        gu = jnp.einsum("th,ehf->etf", xf, w_gu, precision=hp)
    if experts.b_gate_up is not None:
        gu = gu + experts.b_gate_up.astype(jnp.float32)[:, None, :]
    act = _reference_activation(experts.activation, gu)
    out = jnp.einsum(
        "etf,efh->eth", act, as_float(experts.w_down, jnp.float32), precision=hp
    )
    if experts.b_down is not None:
        out = out + experts.b_down.astype(jnp.float32)[:, None, :]
    if experts.weight_on_input:
        y = jnp.sum(out, axis=0)
    else:
        y = jnp.einsum("te,eth->th", dense_w, out, precision=hp)
    identity = jnp.sum(jnp.where(real, 0.0, routing.weights), axis=1)
    y = y + identity[:, None] * xf
    y = y * jnp.float32(layer.output.routed_scale)
    shared = layer.shared_experts
    if shared is not None:
        gu = jnp.dot(xf, shared.w_gate_up.astype(jnp.float32), precision=hp)
        act = _reference_activation(shared.activation, gu)
        scored = routing.shared_weights
        if scored is not None:  # block s of hidden units times shared expert s's weight
            block = shared.w_down.shape[0] // scored.shape[1]
            act = act * jnp.repeat(routing.shared_weights, block, axis=1)
        s = jnp.dot(act, shared.w_down.astype(jnp.float32), precision=hp)
        if shared.gate is not None:
            gate = jnp.dot(xf, shared.gate.astype(jnp.float32), precision=hp)
            s = s * jax.nn.sigmoid(gate)[:, None]
        y = y + s * jnp.float32(shared.scale)
    out = layer.output
    if out.bias is not None:
        y = y + out.bias.astype(jnp.float32)[None, :]
    if out.norm is not None:
        rms = jnp.sqrt(jnp.mean(y * y, axis=-1, keepdims=True) + out.norm_eps)
        y = out.norm.astype(jnp.float32)[None, :] * (y / rms)
    return y.astype(x.dtype).reshape(*batch_shape, x.shape[-1])


def _reference_activation(activation, h: Array) -> Array:
    """The experts' activation written out here for the built-in ones (so the oracle
    does not share their code); a user's own activation is its own definition."""
    ungated = {
        ReLU: jax.nn.relu,
        ReLU2: lambda u: jax.nn.relu(u) ** 2,
        SiLU: jax.nn.silu,
        GELU: lambda u: jax.nn.gelu(u, approximate=activation.approximate),
    }
    if type(activation) in ungated:
        return ungated[type(activation)](h)
    if not isinstance(activation, SwiGLU | ClampedSwiGLU | SoftcapSwiGLU | GeGLU):
        return activation(h)
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    limit = getattr(activation, "limit", None)
    after = getattr(activation, "limit_after", False)
    if limit is not None:
        up = jnp.clip(up, -limit, limit)
        if not after:
            gate = jnp.minimum(gate, limit)
    if isinstance(activation, SwiGLU):
        silu = gate * jax.nn.sigmoid(gate)
        return (jnp.minimum(silu, limit) if after else silu) * up
    if isinstance(activation, ClampedSwiGLU):
        return gate * jax.nn.sigmoid(activation.alpha * gate) * (up + 1)
    if isinstance(activation, SoftcapSwiGLU):
        c_gate, c_up = activation.gate_cap, activation.up_cap
        linear = c_gate * jnp.tanh(gate / c_gate)
        return linear * jax.nn.sigmoid(gate) * (c_up * jnp.tanh(up / c_up))
    return jax.nn.gelu(gate, approximate=activation.approximate) * up
