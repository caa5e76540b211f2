"""`MoELayer.with_config`'s rebuild: a layer's arrays grafted onto the stages a new
config describes, after checking that they fit. Each function takes the layer's
class from the layer it is given (no import of the layer)."""

import dataclasses
import functools as ft

import equinox as eqx
import jax
import jax.random as jr

from ._config import MoEConfig
from ._quant import QuantizedArray
from ._router import Router


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


@ft.lru_cache(maxsize=64)
def _described(layer_class, cfg: MoEConfig):
    """The stages `cfg` describes (their settings; arrays as shapes only)."""
    return eqx.filter_eval_shape(layer_class, cfg, key=jr.key(0))


def _disagreements(name: str, have, want) -> list[str]:
    if have is None or want is None:  # the arrays' presence is the stage's own
        return []
    return [
        f"`{name}.{f.name}` is {getattr(have, f.name)!r}, the config describes "
        f"{getattr(want, f.name)!r}"
        for f in dataclasses.fields(have)
        if f.metadata.get("static", False)
        and getattr(have, f.name) != getattr(want, f.name)
    ]


def check_settings(layer) -> None:
    """A `ValueError` naming each static setting on which `layer.config` and the
    built-in stages that compute with it disagree (a config swapped in with
    `eqx.tree_at`, or a stage's setting changed alone): the layer would silently
    compute with the stage's. Static, so checked whenever a call is traced, which
    any change of them forces. Which optional arrays a stage has (a selection bias,
    a shared gate, an output bias) is the stage's own: it computes with them
    whatever the config says. A router of the user's own (any class but `Router`)
    is its own authority and is not compared."""
    cfg = layer.config
    try:
        described = _described(type(layer), cfg)
    except TypeError:  # an unhashable setting of a user's own
        described = _described.__wrapped__(type(layer), cfg)
    found = []
    for name in ("router", "experts", "shared_experts"):
        have = getattr(layer, name)
        if name == "router" and type(have) is not Router:
            continue
        found += _disagreements(name, have, getattr(described, name))
    if found:
        raise ValueError(
            "The layer's stages disagree with `layer.config`: "
            + "; ".join(found)
            + ". Change a setting with `layer.with_config(...)`, which rebuilds the "
            "stages it describes, not in one place alone."
        )
