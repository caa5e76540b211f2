"""A linear function with a custom transpose, for custom derivatives that keep every
JAX transformation.

`jax.custom_vjp` blocks forward-mode autodiff (`jax.jvp`, `jax.linearize`,
`jax.jacfwd`). The stages that need their own backward (the grouped matmul, the
exchange trips, the slot weights, the chunked fallback) instead define a
`jax.custom_jvp` whose tangent is a `custom_linear` call: a primitive, linear in its
`lin` arguments, that evaluates `fn(res, lin)` and transposes to `fn_t(res, ct)`.

- Forward mode and `jax.linearize` evaluate `fn`.
- Reverse mode transposes it: the backward is `fn_t`, the stage's own.
- Higher orders differentiate `fn_t` (and `fn`) with respect to the residuals by
  plain forward-mode autodiff, and reverse modes transpose that: so `fn` and `fn_t`
  must themselves be differentiable in both modes. A loop whose trip count is traced
  is not (JAX cannot transpose it): such a loop is wrapped in `fused`, which evaluates
  it and differentiates an equal composition of differentiable pieces instead.
- `vmap` makes a `custom_linear` of the `vmap`ped `fn` and `fn_t`, so `jax.jacfwd`,
  `jax.jacrev` and per-example gradients work too.
- A custom_jvp rule computes its primal through the custom_jvp function itself (not
  the raw computation), so that a higher order differentiates the primal by the
  same rule.

`fn` and `fn_t` must be pure functions of their arguments (no closed-over arrays):
every array they need travels in `res`.

`primal_and_tangent` lets a rule's forward mode compute the value and its tangent in
one pass (one loop), where they are otherwise two. Like the primitives' rules (on
`jax.interpreters.ad`, `batching`, `mlir`), it uses JAX's interpreter hooks: those of
partial evaluation, through `moe_eqx._compat`.
"""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad, batching, mlir

from ._compat import (
    filter_primitive_bind,
    filter_primitive_def,
    filter_primitive_jvp,
    is_unknown,
    missing_dynamic as _MISSING,
    partial_eval_as_call,
    register_partial_eval,
    varying_aval,
    varying_axes,
)
from ._quant import QuantizedArray


def _is_none(x) -> bool:
    return x is None


def _is_undefined(x) -> bool:
    return isinstance(x, ad.UndefinedPrimal)


def _struct(x):
    """`x` (an array, an aval or an undefined primal) as a `ShapeDtypeStruct`; other
    leaves unchanged."""
    if _is_undefined(x):
        x = x.aval
    if isinstance(x, jax.core.ShapedArray) or eqx.is_array(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def _is_traced(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _trace(fn, res, lin):
    """`fn`'s output as `ShapeDtypeStruct`s, and its side effects (a Pallas kernel in
    interpret mode has some: the primitive must declare them to be lowered)."""
    structs = jtu.tree_map(_struct, (res, lin), is_leaf=_is_undefined)
    # Only arrays are traced: other leaves (sizes, flags) stay Python values.
    dynamic, static = eqx.partition(structs, _is_traced)
    jaxpr, out = jax.make_jaxpr(
        lambda d: fn(*eqx.combine(d, static)), return_shape=True
    )(dynamic)
    return out, frozenset(jaxpr.effects)


def _zeros(struct):
    return jnp.zeros(struct.shape, struct.dtype)


def _impl(res, lin, fn, fn_t, out, out_t, effects):
    del fn_t, out, out_t, effects
    return fn(res, lin)


def _abstract_eval(res, lin, fn, fn_t, out, out_t, effects):
    del fn, fn_t, out_t, effects
    # Outputs vary over the union of the inputs' `shard_map` axes.
    avals = [a for a in jtu.tree_leaves((res, lin)) if varying_axes(a)]
    vma = frozenset().union(*map(varying_axes, avals))
    like = avals[0] if avals else None
    return jtu.tree_map(lambda s: varying_aval(s.shape, s.dtype, like, vma), out)


def _float0_or_zeros(primal, tangent):
    if tangent is not None or not eqx.is_array(primal):
        return tangent
    if jnp.issubdtype(primal.dtype, jnp.inexact):
        return jnp.zeros_like(primal)
    return np.zeros(primal.shape, jax.dtypes.float0)


def _jvp(primals, tangents):
    res, lin, fn, fn_t, out_structs, out_t, effects = primals
    t_res, t_lin = tangents[:2]
    # An effectful `fn` is traced again, to find its effects on these operands.
    out_structs = None if effects else out_structs
    out = custom_linear(fn, fn_t, res, lin, out_structs, out_t)
    terms = []
    if any(t is not None for t in jtu.tree_leaves(t_lin, is_leaf=_is_none)):
        t_lin = jtu.tree_map(
            lambda p, t: jnp.zeros_like(p) if t is None and eqx.is_array(p) else t,
            lin,
            t_lin,
            is_leaf=_is_none,
        )
        terms.append(custom_linear(fn, fn_t, res, t_lin, out_structs, out_t))
    if any(t is not None for t in jtu.tree_leaves(t_res, is_leaf=_is_none)):
        # `fn` is not linear in `res`: its derivative there is plain forward mode.
        dyn, static = eqx.partition(res, eqx.is_array)
        t_dyn = jtu.tree_map(_float0_or_zeros, dyn, t_res, is_leaf=_is_none)
        terms.append(
            jax.jvp(lambda d: fn(eqx.combine(d, static), lin), (dyn,), (t_dyn,))[1]
        )
    if not terms:
        return out, None
    return out, terms[0] if len(terms) == 1 else jtu.tree_map(jnp.add, *terms)


class _NoCotangent:
    """Marks an operand that gets no cotangent (a `None` would be an empty subtree)."""


def _transpose(cts, *dynamic, treedef, static, flatten):
    """The transpose rule, on the primitive's flat operands: `fn_t` of the output
    cotangents, each linear operand's cotangent put back at its operand's position.
    (Not `equinox.internal.filter_primitive_transpose`: that re-derives which
    operands are arrays from their values, and a residual that JAX has folded into a
    constant, e.g. a NumPy scalar, would no longer count as one.)"""
    treedef_out, _ = flatten.get()
    cts = [None if type(ct) is ad.Zero else ct for ct in cts]
    cts = jtu.tree_unflatten(treedef_out, cts)
    # Operand positions among all leaves (`static` holds the non-array leaves).
    dynamic_iter = iter(dynamic)
    leaves = [next(dynamic_iter) if _is_dynamic(x) else x for x in static]
    res, lin, fn, fn_t, out_structs, out_t, effects = jtu.tree_unflatten(
        treedef, leaves
    )
    # (`out_structs` has `None` where a transposed primitive's `fn_t` had no
    # cotangent: that linear operand stays `None`, a zero.)
    cts = jtu.tree_map(
        lambda s, c: _zeros(s) if c is None and s is not None else c,
        out_structs,
        cts,
        is_leaf=_is_none,
    )
    # The transpose of the transpose is `fn` again. (With effects, `fn_t` is traced
    # to find its own.)
    ct_lin = custom_linear(fn_t, fn, res, cts, None if effects else out_t, out_structs)
    # Cotangents for the linear operands being transposed; none for the rest.
    ct_lin = jtu.tree_map(
        lambda x, c: c if _is_undefined(x) and c is not None else _NoCotangent,
        lin,
        ct_lin,
        is_leaf=_is_undefined,
    )
    nothing = ft.partial(jtu.tree_map, lambda _: _NoCotangent)
    ct_all = (nothing(res), ct_lin, _NoCotangent, _NoCotangent, nothing(out_structs))
    ct_all = (*ct_all, nothing(out_t), _NoCotangent)
    flat = treedef.flatten_up_to(ct_all)
    return [
        None if ct is _NoCotangent else ct
        for ct, x in zip(flat, static, strict=True)
        if _is_dynamic(x)
    ]


def _is_dynamic(x) -> bool:
    return x is _MISSING


def _unflatten(dynamic, treedef, static):
    dynamic_iter = iter(dynamic)
    leaves = [next(dynamic_iter) if _is_dynamic(x) else x for x in static]
    return jtu.tree_unflatten(treedef, leaves)


def _with_axis(struct, axis, size):
    if struct is None:
        return None
    shape = list(struct.shape)
    shape.insert(0 if axis is None else axis, size)
    return jax.ShapeDtypeStruct(tuple(shape), struct.dtype)


def _batch(axis_size, axis_name, _, dynamic, batch_axes, *, treedef, static, flatten):
    """`vmap`: the same primitive of the `vmap`ped `fn` and `fn_t`. A linear operand
    that is not batched while others are is broadcast in `fn`, so its cotangent is
    summed over the batch in `fn_t`. (Not `equinox.internal.create_vprim`'s rule:
    its transpose cannot return a batched cotangent for an unbatched operand, which
    reverse over reverse mode meets under `jax.jacrev`.)"""
    params = dict(treedef=treedef, static=static, flatten=flatten)
    if all(b is None for b in batch_axes):
        out = _custom_linear_p.bind(*dynamic, **params)
        return out, [None] * len(out)
    res, lin, fn, fn_t, out, out_t, effects = _unflatten(dynamic, treedef, static)
    no_axes = [x if _is_dynamic(x) else None for x in static]
    res_axes, lin_axes = _unflatten(batch_axes, treedef, no_axes)[:2]
    vmap = ft.partial(jax.vmap, axis_size=axis_size, axis_name=axis_name)

    def fn_batched(res, lin):
        dyn, static_res = eqx.partition(res, eqx.is_array)

        def one(dyn, lin):
            return fn(eqx.combine(dyn, static_res), lin)

        return vmap(one, in_axes=(res_axes, lin_axes))(dyn, lin)

    def fn_t_batched(res, ct):
        dyn, static_res = eqx.partition(res, eqx.is_array)

        def one(dyn, ct):
            return fn_t(eqx.combine(dyn, static_res), ct)

        ct_lin = vmap(one, in_axes=(res_axes, 0))(dyn, ct)
        return jtu.tree_map(
            lambda c, a: (
                None if c is None else c.sum(0) if a is None else jnp.moveaxis(c, 0, a)
            ),
            ct_lin,
            lin_axes,
            is_leaf=_is_none,
        )

    out = jtu.tree_map(lambda s: _with_axis(s, 0, axis_size), out)
    out_t = jtu.tree_map(
        lambda s, a: _with_axis(s, a, axis_size) if a is not None else s,
        out_t,
        lin_axes,
        is_leaf=_is_none,
    )
    result = custom_linear(
        fn_batched, fn_t_batched, res, lin, None if effects else out, out_t
    )
    flat = flatten(result)
    return flat, [0] * len(flat)


_custom_linear_p = jax.extend.core.Primitive("moe_eqx_custom_linear")
_custom_linear_p.multiple_results = True
_custom_linear_p.def_impl(filter_primitive_def(_impl))
ad.primitive_jvps[_custom_linear_p] = filter_primitive_jvp(_jvp)
ad.primitive_transposes[_custom_linear_p] = _transpose
batching.axis_primitive_batchers[_custom_linear_p] = _batch
mlir.register_lowering(
    _custom_linear_p,
    mlir.lower_fun(filter_primitive_def(_impl), multiple_results=True),
)


def _effectful_abstract_eval(*dynamic, treedef, static, flatten):
    avals = filter_primitive_def(_abstract_eval)(
        *dynamic, treedef=treedef, static=static, flatten=flatten
    )
    dynamic_iter = iter(dynamic)
    leaves = [next(dynamic_iter) if _is_dynamic(x) else x for x in static]
    effects = jtu.tree_unflatten(treedef, leaves)[-1]
    return avals, set(effects)


# Declares `fn`'s effects (none for every stage of the layer; a Pallas kernel run by
# its interpreter has some), so that lowering threads their tokens.
_custom_linear_p.def_effectful_abstract_eval(_effectful_abstract_eval)


def _is_symbolic_zero(x) -> bool:
    return isinstance(x, SymbolicZero)


def _no_tangent(x) -> bool:
    # A quantized weight's leaves are integers: its tangent is always zero.
    return _is_symbolic_zero(x) or isinstance(x, QuantizedArray)


def symbolic_zeros_to_none(tangents: Any) -> Any:
    """The tangents a `custom_jvp` rule (`symbolic_zeros=True`) receives, with `None`
    for the symbolic zeros (and for a `QuantizedArray`'s, a constant's): the linear
    arguments `custom_linear` takes."""
    return jtu.tree_map(
        lambda t: None if _no_tangent(t) else t, tangents, is_leaf=_no_tangent
    )


@eqx.filter_custom_jvp
def _fused(args, *, fast, reference):
    return fast(*args)


@_fused.def_jvp
def _fused_jvp(primals, tangents, *, fast, reference):
    (args,) = primals
    (t_args,) = tangents
    out = _fused(args, fast=fast, reference=reference)
    # Only the arguments that have a tangent are differentiated.
    wanted = jtu.tree_map(lambda t: t is not None, t_args, is_leaf=_is_none)
    diff, rest = eqx.partition(args, wanted)
    t_diff = eqx.filter(t_args, wanted, is_leaf=_is_none)

    def of_diff(diff):
        return reference(*eqx.combine(diff, rest))

    return out, jax.jvp(of_diff, (diff,), (t_diff,))[1]


def fused(fast: Callable[..., Any], reference: Callable[..., Any], *args: Any) -> Any:
    """`fast(*args)`, differentiated as `reference(*args)`: the same function, once as
    a fused loop (typically with a traced trip count, which JAX can evaluate and
    differentiate in forward mode but never transpose) and once as a composition of
    pieces with their own derivatives (each a `jax.custom_jvp` whose tangent is a
    `custom_linear`, or plain JAX), so that every order of derivative is defined
    while each order's value still comes from the fused loop.

    **Arguments:**

    - `fast`, `reference`: `(*args) -> out`, equal as functions, with one precision
        policy; no closed-over arrays.
    - `args`: any PyTrees; non-array leaves are static.

    **Returns:**

    `fast(*args)`. Its derivatives (forward mode, and reverse mode through their
    transposes) are `reference`'s, in the arguments that have a tangent only.
    """
    return _fused(args, fast=fast, reference=reference)


def custom_linear(
    fn: Callable[[Any, Any], Any],
    fn_t: Callable[[Any, Any], Any],
    res: Any,
    lin: Any,
    out: Any = None,
    out_t: Any = None,
) -> Any:
    """`fn(res, lin)`, a function linear in `lin`, whose transpose is `fn_t`.

    **Arguments:**

    - `fn`: `(res, lin) -> out`, linear in `lin` (a pure function: no closed-over
        arrays).
    - `fn_t`: `(res, ct_out) -> ct_lin`, the transpose of `fn` in `lin`: its output
        has the structure, shapes and dtypes of `lin`.
    - `res`: residuals (any PyTree; non-array leaves are static).
    - `lin`: the linear arguments (a PyTree of arrays; `None` for a zero one: `fn`
        must treat it as zero and `fn_t` return `None` for it).
    - `out`: `fn`'s output as `jax.ShapeDtypeStruct`s, if known, and then `fn` must
        have no side effects. Else `fn` is traced once more to find its output and
        its effects (e.g. a Pallas kernel in interpret mode), which the primitive
        then declares; `fn_t` is then traced for its own when transposed.
    - `out_t`: `fn_t`'s output, if not shaped like `lin` (`fn_t` may return `None`, a
        zero cotangent, for some linear arguments).

    **Returns:**

    `fn(res, lin)`.
    """
    if out is None:
        out, effects = _trace(fn, res, lin)
    else:
        out, effects = jtu.tree_map(_struct, out), frozenset()
    if not jtu.tree_leaves(lin):
        return jtu.tree_map(_zeros, out)
    out_t = jtu.tree_map(_struct, lin if out_t is None else out_t)
    return filter_primitive_bind(
        _custom_linear_p, res, lin, fn, fn_t, out, out_t, effects
    )


# ---------------------------------------------------------------------------------
# A primal and its tangent in one pass where the tangent is evaluated.


class _Pair:
    """The static part of a `primal_and_tangent` call (compared by identity)."""

    def __init__(self, treedef, static, primal, joint, fn, fn_t, out_t, keep):
        self.treedef, self.static = treedef, static
        self.primal, self.joint, self.fn, self.fn_t = primal, joint, fn, fn_t
        self.keep = keep
        self.out_t = out_t
        self.split_jaxpr = self.out = None

    def args(self, dynamic):
        return _unflatten(dynamic, self.treedef, self.static)

    def split(self, *dynamic, policy=None):
        """`(primal(res), custom_linear(fn, fn_t, res, lin))`."""
        res, lin = self.args(dynamic)
        return _split(
            self.primal, self.keep, self.fn, self.fn_t, res, lin, self.out_t, policy
        )

    def split_flat(self, *dynamic, policy=None):
        return jtu.tree_leaves(self.split(*dynamic, policy=policy))


def _split(primal, keep, fn, fn_t, res, lin, out_t, policy=None):
    """`(primal(res), custom_linear(fn, fn_t, res, lin))`, or with `keep` the tangent
    on what `keep` returns with the primal (under a `jax.checkpoint` policy, what
    `keep(res, policy)` keeps)."""
    if keep is None:
        return primal(res), custom_linear(fn, fn_t, res, lin, out_t)
    out, res_t = keep(res) if policy is None else keep(res, policy)
    return out, custom_linear(fn, fn_t, res_t, lin, out_t)


# The `checkpoint_name` of what a `keep` function keeps under a `jax.checkpoint`
# policy: chosen by that policy already, so always saved.
KEPT = "moe_eqx_kept"


def _saving_kept(saveable):
    """`saveable`, the policy of a `jax.checkpoint`, also saving the arrays named
    `KEPT`."""

    def policy(prim, *avals, **params):
        if prim.name == "name" and params.get("name") == KEPT:
            return True
        return saveable(prim, *avals, **params)

    return policy


def _pair_impl(*dynamic, pair):
    return jtu.tree_leaves(pair.joint(*pair.args(dynamic)))


def _pair_abstract_eval(*avals, pair):
    return [v.aval for v in pair.split_jaxpr.jaxpr.outvars], pair.split_jaxpr.effects


def _pair_jvp(primals, tangents, *, pair):
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    return jax.jvp(pair.split_flat, tuple(primals), tangents)


def _pair_batch(axis_size, axis_name, _, dynamic, batch_axes, *, pair):
    """`vmap`: the two calls, the primal unbatched where `res` is (as `jax.jacfwd`
    needs)."""
    no_axes = [x if _is_dynamic(x) else None for x in pair.static]
    res_axes, lin_axes = _unflatten(batch_axes, pair.treedef, no_axes)
    res, lin = pair.args(dynamic)
    vmap = ft.partial(jax.vmap, axis_size=axis_size, axis_name=axis_name)
    dyn, static = eqx.partition(res, eqx.is_array)

    def primal(dyn):
        return pair.primal(eqx.combine(dyn, static))

    def tangent(dyn, lin):
        res = eqx.combine(dyn, static)
        return custom_linear(pair.fn, pair.fn_t, res, lin, pair.out_t)

    if any(a is not None for a in jtu.tree_leaves(res_axes)):
        primal_out, primal_axis = vmap(primal, in_axes=(res_axes,))(dyn), 0
    else:
        primal_out, primal_axis = primal(dyn), None
    primal_out = jtu.tree_leaves(primal_out)
    tangent_out = jtu.tree_leaves(vmap(tangent, in_axes=(res_axes, lin_axes))(dyn, lin))
    axes = [primal_axis] * len(primal_out) + [0] * len(tangent_out)
    return [*primal_out, *tangent_out], axes


def _pair_partial_eval(trace, *tracers, pair):
    """Partial evaluation (`jax.linearize`, reverse mode): the primal now, the linear
    tangent staged."""
    with jax.extend.core.set_current_trace(trace):
        return pair.split_flat(*tracers)


def _pair_partial_eval_jaxpr(saveable, unks_in, inst_in, eqn):
    """The same on a jaxpr (`jax.checkpoint`): the equation as a call of the split
    form (traced when the primitive was bound, where its axis names were known).

    With `keep`, the split form is traced again with the checkpoint's policy
    (inside `shard_map`, whose rule binds its axis names while it partially
    evaluates its body): `keep(res, saveable)` keeps what that policy saves, named
    `KEPT`, which the call's partial evaluation then saves rather than recomputing
    the primal that computed it."""
    pair = eqn.params["pair"]
    if pair.keep is None:
        return partial_eval_as_call(saveable, unks_in, inst_in, eqn, pair.split_jaxpr)
    avals = [v.aval for v in eqn.invars]
    split_jaxpr = jax.make_jaxpr(ft.partial(pair.split_flat, policy=saveable))(*avals)
    return partial_eval_as_call(
        _saving_kept(saveable), unks_in, inst_in, eqn, split_jaxpr
    )


_pair_p = jax.extend.core.Primitive("moe_eqx_primal_and_tangent")
_pair_p.multiple_results = True
_pair_p.def_impl(_pair_impl)
_pair_p.def_effectful_abstract_eval(_pair_abstract_eval)
ad.primitive_jvps[_pair_p] = _pair_jvp
batching.axis_primitive_batchers[_pair_p] = _pair_batch
register_partial_eval(_pair_p, _pair_partial_eval, _pair_partial_eval_jaxpr)
mlir.register_lowering(_pair_p, mlir.lower_fun(_pair_impl, multiple_results=True))


def primal_and_tangent(
    primal: Callable[[Any], Any],
    joint: Callable[[Any, Any], Any],
    fn: Callable[[Any, Any], Any],
    fn_t: Callable[[Any, Any], Any],
    res: Any,
    lin: Any,
    out_t: Any,
    keep: Callable[[Any], tuple[Any, Any]] | None = None,
) -> tuple[Any, Any]:
    """`(primal(res), custom_linear(fn, fn_t, res, lin))`, the outputs of a
    `jax.custom_jvp` rule, evaluated as `joint(res, lin)`, one pass for both (e.g. one
    loop carrying the value and its tangent), wherever the tangent is evaluated
    (forward mode). Under partial evaluation (`jax.linearize`, reverse mode,
    `jax.checkpoint`) it is split: `primal(res)` computed, the tangent staged for its
    transpose `fn_t`. Differentiated or `vmap`ped, it is the two calls.

    **Arguments:**

    - `primal`: `res -> primal_out`, calling the custom_jvp function itself (so that
        its own derivatives are its rule's).
    - `joint`: `(res, lin) -> (primal_out, tangent_out)`, equal to the two calls.
    - `fn`, `fn_t`, `res`, `lin`: as for `custom_linear` (`fn` the tangent).
    - `out_t`: `fn`'s output as `jax.ShapeDtypeStruct`s.
    - `keep`: optional `(res, policy=None) -> (primal_out, res_t)`, the primal
        computed together with what its transpose keeps from it, wherever the
        tangent is staged rather than evaluated (reverse mode): `fn` and `fn_t` then
        get `res_t` in place of `res`. It must equal `primal` in its first output,
        and be differentiable as it (see `fused`). Under `jax.checkpoint` it gets the
        checkpoint's `policy` (`saveable(prim, *avals, **params)`): it then keeps
        only what that policy saves (and recomputes the rest in `fn_t`), naming
        what it keeps `KEPT` with `jax.ad_checkpoint.checkpoint_name`.

    **Returns:**

    `(primal_out, tangent_out)`.
    """
    flat, treedef = jtu.tree_flatten((res, lin))
    if any(is_unknown(x) for x in flat):
        # Already being linearized: no pass evaluates the tangent.
        return _split(primal, keep, fn, fn_t, res, lin, out_t)
    dynamic = [x for x in flat if eqx.is_array(x)]
    static = tuple(_MISSING if eqx.is_array(x) else x for x in flat)
    out_t = jtu.tree_map(_struct, out_t)
    pair = _Pair(treedef, static, primal, joint, fn, fn_t, out_t, keep)
    pair.split_jaxpr, out = jax.make_jaxpr(pair.split, return_shape=True)(*dynamic)
    flat_out = _pair_p.bind(*dynamic, pair=pair)
    return jtu.tree_unflatten(jtu.tree_structure(out), flat_out)
