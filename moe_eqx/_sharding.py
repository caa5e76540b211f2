"""Placing whole models (and their optimizer states) on a mesh: `shard_model`,
`shard_specs`. Above the layer: it finds the layers in any PyTree."""

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from ._compat import concrete_mesh
from ._fsdp import expert_specs, shared_specs
from ._layer import MoELayer
from ._mesh import check_mesh, place_tree


def shard_model(
    tree: PyTree, mesh: Mesh, *, fsdp_axes: str | tuple[str, ...] | None = None
) -> PyTree:
    """Places a whole model, or its optimizer state, for a mesh: in every
    [`moe_eqx.MoELayer`][] found in `tree` the experts are split over its
    `config.axis_name` (and over `config.fsdp_axes`, see below); every other array is
    replicated over the mesh.

    Training steps then compile once: the gradients and updated parameters of an
    expert-parallel model come back placed this way, and unplaced initial parameters
    (or an optimizer `count` created on one device) would make the first and second
    steps compile separately. Optimizer states mirror the model's structure (optax's
    moments hold `MoELayer`s of the same shapes), so the same call places them:

    ```python
    model = me.shard_model(model, mesh)
    opt_state = me.shard_model(opt.init(eqx.filter(model, eqx.is_inexact_array)), mesh)
    ```

    (Inexact arrays only: a layer's integer `expert_ids` is placement state, not a
    weight; it has no gradient and no optimizer state.)

    With data axes in `fsdp_axes` (FSDP / ZeRO-3) the experts, and with them their
    optimizer state, are split over those axes too, so no two devices hold the same
    expert weights; the layer gathers them when it runs and their gradients come
    back reduce-scattered (see `MoEConfig.fsdp_axes`). Layers stacked for `lax.scan`
    keep their layers' axis whole.

    **Arguments:**

    - `tree`: any PyTree (an Equinox model, an optax state, ...).
    - `mesh`: the mesh; the experts' axis must divide their number.
    - `fsdp_axes`: `None` (default): each layer's `config.fsdp_axes`. Else the data
        axes (a name or a tuple; `()` for none) to split every layer's experts over:
        the layers come back with their `config.fsdp_axes` set to them, so pass the
        same value for the model and for its optimizer state.

    **Returns:**

    `tree` with its arrays placed on `mesh` (non-array leaves unchanged).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`shard_model` needs a `jax.sharding.Mesh` to place the model on, got "
            f"{type(mesh).__name__} (e.g. `jax.make_mesh((8,), ('expert',))`)."
        )

    def put(a, spec):
        if not eqx.is_array(a):
            return a
        return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    def place(node):
        if not isinstance(node, MoELayer):
            return put(node, P())
        if fsdp_axes is not None:
            node = node.with_config(fsdp_axes=fsdp_axes)
        check_mesh(mesh, node.config)
        layer = jax.tree.map(lambda a: put(a, P()), node)
        specs = expert_specs(node.config, node.experts, mesh.shape)
        experts = place_tree(lambda a, _, s: put(a, s), node.experts, specs, mesh)
        layer = eqx.tree_at(lambda l: l.experts, layer, experts)
        if node.shared_experts is None:
            return layer
        specs = shared_specs(node.config, node.shared_experts, mesh.shape)
        shared = place_tree(lambda a, _, s: put(a, s), node.shared_experts, specs, mesh)
        return eqx.tree_at(lambda l: l.shared_experts, layer, shared)

    return jax.tree.map(place, tree, is_leaf=lambda n: isinstance(n, MoELayer))


def with_fsdp_axes(layer: MoELayer, fsdp_axes: str | tuple[str, ...]) -> MoELayer:
    """`layer` with `config.fsdp_axes` replaced (same arrays): `layer.with_config(
    fsdp_axes=fsdp_axes)`."""
    return layer.with_config(fsdp_axes=fsdp_axes)


def shard_specs(
    layer: MoELayer,
    mesh: Mesh | None = None,
    *,
    fsdp_axes: str | tuple[str, ...] | None = None,
) -> MoELayer:
    """The `shard_map` in-specs of a layer for expert parallelism: `P(axis_name)` on
    the expert weights (with `config.fsdp_axes`, their split over the expert and
    those axes, as [`moe_eqx.shard_model`][] places them), `P()` (replicated) on
    every other array (the router, the shared experts, `expert_ids`). Use it with
    [`moe_eqx.expert_parallel_shard`][].

    **Arguments:**

    - `layer`: a [`moe_eqx.MoELayer`][].
    - `mesh`: the mesh, needed only with `config.fsdp_axes` (whose split depends on
        the axis sizes); `None` = the ambient one (`jax.set_mesh`).
    - `fsdp_axes`: as in [`moe_eqx.shard_model`][] (the specs then describe the layer
        that `shard_model(..., fsdp_axes=...)` returns).

    **Returns:**

    A PyTree of the layer's structure with a `PartitionSpec` at every array.
    """
    if fsdp_axes is not None:
        layer = layer.with_config(fsdp_axes=fsdp_axes)
    cfg = layer.config
    specs = jax.tree.map(lambda _: P(), layer)
    # The settings whose specs depend on the mesh's axis sizes.
    needs_mesh = [
        f"`config.fsdp_axes` is {cfg.fsdp_axes}" if cfg.fsdp_axes else None,
        f"`config.tensor_axis` is {cfg.tensor_axis!r}" if cfg.tensor_axis else None,
    ]
    needs_mesh = [s for s in needs_mesh if s is not None]
    if needs_mesh:
        mesh = mesh if mesh is not None else concrete_mesh()
        if mesh is None:
            raise ValueError(
                f"{' and '.join(needs_mesh)}: `shard_specs` needs the mesh "
                "(`mesh=...` or `with jax.set_mesh(mesh):`) to know how the experts "
                "are split."
            )
        check_mesh(mesh, cfg)
    shape = None if mesh is None else mesh.shape
    experts = expert_specs(cfg, layer.experts, shape)
    specs = eqx.tree_at(lambda l: l.experts, specs, experts)
    if layer.shared_experts is None:
        return specs
    shared = shared_specs(cfg, layer.shared_experts, shape)
    return eqx.tree_at(lambda l: l.shared_experts, specs, shared)
