"""The private JAX and Equinox APIs the library uses, in one place.

Each is pinned by the version bounds of `jax` and `equinox` in `pyproject.toml` (the
versions the test suite runs), and each has a test in `tests/test_compat.py` that fails
loudly, naming it, when a release moves it; a new release is then fixed here alone.
Next to each: the public alternative, or why there is none.

Defining a primitive through `jax.extend.core.Primitive` and the rule tables of
`jax.interpreters.ad`, `batching` and `mlir` is JAX's documented way to write one
("How JAX primitives work"), so those stay where the primitives are defined
(`moe_eqx._autodiff`); so do uses of `jax.extend`, the extension API.
"""

import equinox.internal as eqxi
import jax
import jax.extend.core
from jax.interpreters import partial_eval as pe
from jax.sharding import Mesh

# The marker `equinox.internal.filter_primitive_*` put in place of each array of a
# primitive's arguments (`moe_eqx._autodiff` needs it to tell arrays from statics).
# No public alternative: Equinox's filtered primitives are its internal API.
missing_dynamic = eqxi._primitive._missing_dynamic

# Equinox's filtered primitives (PyTrees of arrays and static values as a primitive's
# arguments). No public alternative; `equinox.internal` is where Equinox keeps them.
filter_primitive_def = eqxi.filter_primitive_def
filter_primitive_jvp = eqxi.filter_primitive_jvp
filter_primitive_bind = eqxi.filter_primitive_bind


def concrete_mesh() -> Mesh | None:
    """The concrete mesh of `with jax.set_mesh(mesh):`, also under `jax.jit` (where the
    public `jax.sharding.get_mesh` refuses), or `None` outside of one."""
    from jax._src.mesh import get_concrete_mesh

    mesh = get_concrete_mesh()
    return None if mesh is None or mesh.empty else mesh


def abstract_mesh_platform() -> str | None:
    """The platform (`"cpu"`, `"gpu"`, `"tpu"`, ...) of the devices of the current
    abstract mesh: inside `shard_map` or `jax.set_mesh`, those the program runs on;
    `None` where it names none."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None)


def varying_axes(aval) -> frozenset:
    """The `shard_map` axes an abstract value varies over (empty outside one). The
    public `jax.typeof(x).vma` is not defined on every aval a primitive's rule sees."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset() if mat is None else frozenset(mat.varying)


def varying_aval(shape, dtype, like, axes: frozenset):
    """A `ShapedArray` varying over the `shard_map` axes `axes`, on the mesh of the aval
    `like` (a primitive's abstract evaluation must say so; no public constructor
    takes them)."""
    if not axes:
        return jax.core.ShapedArray(shape, dtype)
    sharding = jax.sharding.NamedSharding(
        like.sharding.mesh, jax.sharding.PartitionSpec()
    )
    mat = like.manual_axis_type.update(varying=axes)
    return jax.core.ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=mat)


def register_partial_eval(primitive, rule, jaxpr_rule) -> None:
    """Registers a primitive's partial evaluation: `rule(trace, *tracers, **params)`
    (`jax.linearize`, reverse mode) and `jaxpr_rule(saveable, unks_in, inst_in,
    eqn)` (on a jaxpr: `jax.checkpoint`). No public alternative: JAX exposes no way to
    evaluate part of a primitive now and stage the rest, which `primal_and_tangent`
    needs to compute a primal and its tangent in one pass only where the tangent is
    evaluated."""
    pe.custom_partial_eval_rules[primitive] = rule
    pe.partial_eval_jaxpr_custom_rules[primitive] = jaxpr_rule


def partial_eval_as_call(saveable, unks_in, inst_in, eqn, call_jaxpr):
    """A `jaxpr_rule` for `register_partial_eval`: the equation partially evaluated as
    a call of `call_jaxpr` (a `ClosedJaxpr` of the same inputs and outputs), by
    JAX's own rule for `closed_call`. No public alternative (see above)."""
    closed_call_p = jax.extend.core.primitives.closed_call_p
    call = eqn.replace(
        primitive=closed_call_p,
        params=dict(call_jaxpr=call_jaxpr),
        effects=call_jaxpr.effects,
    )
    rule = pe.partial_eval_jaxpr_custom_rules[closed_call_p]
    return rule(saveable, unks_in, inst_in, call)


def is_unknown(x) -> bool:
    """`x` is a value being staged by partial evaluation (the tangent under
    `jax.linearize` or reverse mode), not known now. No public alternative."""
    return isinstance(x, pe.JaxprTracer) and not x.pval.is_known()


def sub_jaxpr(eqn):
    """The jaxpr an equation calls (a `custom_jvp`, `pjit`, `closed_call`, ...), or
    `None`. Jaxpr equations' parameters are JAX's internal representation: no public
    alternative names the called jaxpr."""
    for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None
