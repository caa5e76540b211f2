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
from ._experts import ExpertOptions, SharedCombination
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
    """The routing settings of `router` that a config holds, as a tuple (hashable)."""
    if isinstance(router, HashRouter):  # its scorer's settings
        router = router.scorer
    if isinstance(router, Router):
        return (
            router.top_k,
            router.num_experts,
            router.num_identity,
            router.num_shared,
            _named(router.score, SCORES),
            router.norm_topk,
            router.num_groups,
            router.top_groups,
            router.bias is not None,
            router.selection,
            router.weighting,
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
            declared = _routing_shape_cache(structure, kind, _Unhashed(router), d_model)
        except TypeError:  # a part of the router that cannot be hashed
            declared = _routing_shape(router, d_model)
    top_k, num_experts, num_identity, num_shared = declared
    # Per-expert scores where the router scores shared experts (a config with
    # softmax scores cannot have them); the router computes its own.
    score = "sigmoid" if num_shared else "softmax"
    return (top_k, num_experts, num_identity, num_shared, score, True, 1, 1, False)


class _Unhashed:
    """A value carried past `lru_cache`'s key (equal to any other)."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Unhashed)


@ft.lru_cache(maxsize=64)
def _routing_shape_cache(structure, kind, router, d_model):
    return _routing_shape(router.value, d_model)


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
    top_k, router_experts, num_identity, num_shared, score, norm_topk = routing[:6]
    num_groups, top_groups, use_bias = routing[6:9]
    selection, weighting = (
        (routing[9], routing[10]) if len(routing) > 9 else (None,) * 2
    )
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
        top_k=top_k,
        score_func=score,
        norm_topk=norm_topk,
        num_groups=num_groups,
        top_groups=top_groups,
        use_router_bias=use_bias,
        routed_scaling_factor=routed_scale,
        shared_d_ff=shared_d_ff,
        shared_gate=shared_gate,
        num_identity_experts=num_identity,
        activation=activation_name,
        selection=selection,
        weighting=weighting,
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
        up = getattr(stage.w_gate_up, "shape", None)
        down = getattr(stage.w_down, "shape", None)
        if up is None or down is None:
            continue
        if name == "experts":
            have = (up[-3], up[-2], down[-2])
        else:
            have = (up[-2], down[-2])
        if tuple(have) != tuple(stage.sizes):
            raise ValueError(
                f"`{name}`'s weights have sizes {tuple(have)}, but the stage records "
                f"{tuple(stage.sizes)} (`{name}.sizes`): an array of other sizes was "
                "swapped in. Build the stage from its arrays instead "
                "(`dataclasses.replace` or its constructor)."
            )
