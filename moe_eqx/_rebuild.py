"""A layer's config and its stages: the config the stages describe
(`layer_config`, which `MoELayer.config` reads), and `MoELayer.with_config`'s
rebuild, the layer's arrays grafted onto the stages a new config describes after
checking that they fit. Each function takes the layer's class from the layer it is
given (no import of the layer)."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from ._activation import ACTIVATIONS
from ._combine import OutputTransform
from ._config import MoEConfig
from ._experts import ExpertOptions, SharedCombination, weight_sizes
from ._hash_router import HashRouter
from ._quant import QuantizedArray
from ._router import Router
from ._scoring import SCORES


def _is_weight(a) -> bool:
    return a is None or isinstance(a, QuantizedArray)


def graft(skeleton, old, cfg: MoEConfig):
    """`skeleton`'s statics (built from `cfg`) with `old`'s arrays at the same places
    (checked by `check_arrays_fit`; a quantized weight counts as one). An array the
    new config has and `old` lacks (a bias the change turns on) gets the value the
    constructor gives it (zeros, or ones for a norm's weight); one the new config
    lacks is dropped."""
    flat, structure = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=_is_weight)
    old_leaves = jax.tree_util.tree_leaves(old, is_leaf=_is_weight)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    missing = {
        paths[i]
        for i, ((_, s), o) in enumerate(zip(flat, old_leaves, strict=True))
        if s is not None and o is None
    }
    fresh = _initial_arrays(type(old), cfg, frozenset(missing)) if missing else {}
    leaves = [
        None if s is None else fresh[path] if o is None else o
        for path, (_, s), o in zip(paths, flat, old_leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(structure, leaves)


def _initial_arrays(layer_class, cfg: MoEConfig, paths: frozenset) -> dict:
    """The arrays at `paths` of a layer built from `cfg`, as its constructor makes
    them; the others are not computed (compiled away)."""

    def build(key):
        layer = layer_class(cfg, key=key)
        flat = jax.tree_util.tree_flatten_with_path(layer, is_leaf=_is_weight)[0]
        return {
            jax.tree_util.keystr(p): a
            for p, a in flat
            if jax.tree_util.keystr(p) in paths
        }

    return jax.jit(build)(jr.key(0))


def check_arrays_fit(layer, cfg: MoEConfig) -> None:
    """A layer built from `cfg` has `layer`'s arrays (same places; same trailing
    shapes, leading axes of stacked layers aside), else a `ValueError`. `layer` may
    also be a tree of the layer's structure with other leaves (`PartitionSpec`s,
    `None` where filtered out), whose places alone are compared."""
    skeleton = eqx.filter_eval_shape(type(layer), cfg, key=jr.key(0))
    if not isinstance(layer.router, Router):  # a router of the user's own
        skeleton = eqx.tree_at(lambda l: l.router, skeleton, layer.router)

    def leaves(tree):
        # A quantized weight counts as one array of its logical shape.
        flat = jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda a: a is None or isinstance(a, QuantizedArray)
        )
        return {jax.tree_util.keystr(p): getattr(a, "shape", None) for p, a in flat}

    want, have = leaves(skeleton), leaves(layer)
    bad = sorted(
        name
        for name in set(want) | set(have)
        if name not in want
        or name not in have
        or (
            want[name] is not None
            and have[name] is not None
            and tuple(have[name][len(have[name]) - len(want[name]) :])
            != tuple(want[name])
        )
    )
    if bad:
        raise ValueError(
            f"The layer's arrays {bad} do not fit the new config ("
            + ", ".join(
                f"{n}: {have.get(n, 'absent')} for {want.get(n, 'absent')}" for n in bad
            )
            + "): build a new layer for it."
        )


def layer_config(layer) -> MoEConfig:
    """The [`moe_eqx.MoEConfig`][] a layer's stages describe: every model setting
    read from the one stage that holds it (the router's routing settings, the
    experts' activation and options, the shared experts' combination, the output
    stage's scale, bias and norm), the sizes from the arrays' shapes, and how it
    runs from `layer.execution`. A router of the user's own declares its `top_k`,
    `num_experts`, `num_identity` and `num_shared` as attributes, or they are read
    from the shapes of the `Routing` it returns (traced once, not run); its other
    settings are its own business (the config's defaults stand for them). The sizes
    are the stages' `sizes`, of the whole weights, so the config is the same inside
    `shard_map` and for trees of the layer's structure with other leaves."""
    experts, shared = layer.experts, layer.shared_experts
    if experts.sizes is None or (shared is not None and shared.sizes is None):
        raise ValueError(
            "The layer's experts record no sizes (built from arrays without "
            "shapes): build them from their weights."
        )
    num_experts, d_model, d_ff = experts.sizes
    key = (
        _settings_of(layer.router, d_model),
        d_model,
        d_ff,
        num_experts,
        experts.activation,
        experts.b_gate_up is not None,
        experts.weight_on_input,
        None
        if shared is None
        else (
            shared.sizes[1],
            shared.gate is not None,
            shared.scale,
            shared.activation,
        ),
        layer.output.routed_scale,
        layer.output.bias is not None,
        layer.output.norm_eps,
        layer.execution,
    )
    try:
        return _config_of(*key)
    except TypeError:  # a setting of the user's own that cannot be hashed
        return _config_of.__wrapped__(*key)


def _named(value, names: dict):
    """`value`'s shorthand name where it is one of `names`' objects, else itself."""
    for name, obj in names.items():
        if type(obj) is type(value) and obj == value:
            return name
    return value


def _settings_of(router, d_model: int) -> tuple:
    """The `MoEConfig` routing keywords that `router` holds, as `(name, value)`
    pairs (hashable); those a router of the user's own does not hold are left to
    the config's defaults."""
    if isinstance(router, HashRouter):  # its scorer's settings
        router = router.scorer
    if isinstance(router, Router):
        return (
            ("top_k", router.top_k),
            ("num_experts", router.num_experts),
            ("num_identity_experts", router.num_identity),
            ("num_shared", router.num_shared),
            ("score_func", _named(router.score, SCORES)),
            ("norm_topk", router.norm_topk),
            ("num_groups", router.num_groups),
            ("top_groups", router.top_groups),
            ("use_router_bias", router.bias is not None),
            ("selection", router.selection),
            ("weighting", router.weighting),
        )
    names = ("top_k", "num_experts", "num_identity", "num_shared")
    if all(isinstance(getattr(router, n, None), int) for n in names):
        declared = tuple(getattr(router, n) for n in names)
    else:
        # Traced once per kind of router: its structure (static fields included),
        # its arrays' shapes and its other leaves' values.
        leaves, structure = jax.tree.flatten(router)
        kind = tuple((a.shape, a.dtype) if eqx.is_array(a) else a for a in leaves)
        try:
            declared = _ROUTING_SHAPES.get((structure, kind, d_model))
        except TypeError:  # a part of the router that cannot be hashed
            kind = None
            declared = None
        if declared is None:
            declared = _routing_shape(router, d_model)
            if kind is not None:
                _ROUTING_SHAPES[(structure, kind, d_model)] = declared
    top_k, num_experts, num_identity, num_shared = declared
    return (
        ("top_k", top_k),
        ("num_experts", num_experts),
        ("num_identity_experts", num_identity),
        ("num_shared", num_shared),
        # Per-expert scores where the router scores shared experts (a config with
        # softmax scores cannot have them); the router computes its own.
        ("score_func", "sigmoid" if num_shared else "softmax"),
    )


# `_routing_shape` of each kind of user's router seen (see `_settings_of`).
_ROUTING_SHAPES: dict = {}


def _routing_shape(router, d_model: int) -> tuple[int, int, int, int]:
    """`(top_k, num_experts, num_identity, num_shared)` from the shapes of the
    `Routing` the router returns for two tokens (traced, not run)."""
    x = jax.ShapeDtypeStruct((2, d_model), jnp.float32)
    try:
        routing = eqx.filter_eval_shape(router, x)
        weights = routing.shared_weights
        return (
            routing.experts.shape[-1],
            routing.counts.shape[-1],
            routing.identity_counts.shape[-1],
            0 if weights is None else weights.shape[-1],
        )
    except Exception as e:
        raise ValueError(
            f"The layer's router {type(router).__name__} could not be traced on "
            f"`[2, {d_model}]` tokens to read its `top_k` and expert counts from the "
            f"`Routing` it returns ({type(e).__name__}: {e}); declare them as its "
            "attributes `top_k`, `num_experts`, `num_identity` and `num_shared`."
        ) from e


@ft.lru_cache(maxsize=256)
def _config_of(
    routing,
    d_model,
    d_ff,
    num_experts,
    activation,
    expert_bias,
    weight_on_input,
    shared,
    routed_scale,
    output_bias,
    norm_eps,
    execution,
) -> MoEConfig:
    routing = dict(routing)
    router_experts, num_shared = routing.pop("num_experts"), routing.pop("num_shared")
    if router_experts != num_experts:
        raise ValueError(
            f"The layer's router routes to {router_experts} experts, but it holds "
            f"{num_experts} (`experts`, `expert_ids`)."
        )
    activation_name = _named(activation, ACTIVATIONS)
    if shared is None:
        shared_d_ff, shared_gate, combination = 0, False, SharedCombination()
        if num_shared:
            raise ValueError(
                f"The layer's router scores {num_shared} shared experts, but the "
                "layer has none (`shared_experts` is None)."
            )
    else:
        shared_d_ff, shared_gate, scale, shared_activation = shared
        own = None if shared_activation == activation else shared_activation
        combination = SharedCombination(
            scale=scale, activation=_named(own, ACTIVATIONS), scored=num_shared
        )
    return MoEConfig(
        d_model=d_model,
        d_ff=d_ff,
        num_experts=num_experts,
        **routing,
        routed_scaling_factor=routed_scale,
        shared_d_ff=shared_d_ff,
        shared_gate=shared_gate,
        activation=activation_name,
        shared=combination,
        output=OutputTransform(bias=output_bias, norm_eps=norm_eps),
        expert_options=ExpertOptions(bias=expert_bias, weight_on_input=weight_on_input),
        execution=execution,
    )


def check_sizes(layer) -> None:
    """The layer's expert weights have the sizes their stages record (whole
    weights, outside `shard_map`), else a `ValueError`: an array swapped in with
    `eqx.tree_at` that does not fit (build the stage anew for other sizes)."""
    for name in ("experts", "shared_experts"):
        stage = getattr(layer, name)
        if stage is None or stage.sizes is None:
            continue
        have = weight_sizes(stage.w_gate_up, stage.w_down, routed=name == "experts")
        if have is not None and have != tuple(stage.sizes):
            raise ValueError(
                f"`{name}`'s weights have sizes {have}, but the stage records "
                f"{tuple(stage.sizes)} (`{name}.sizes`): an array of other sizes was "
                "swapped in. Build the stage from its arrays instead "
                "(`dataclasses.replace` or its constructor)."
            )
