"""Experts sharded over data axes too (FSDP / ZeRO-3): where each expert array is
split, and its gather when the layer runs.

With `config.fsdp_axes`, the experts (and with them their optimizer state and
gradients) are split over the expert axis and those data axes, so no two devices
hold the same expert weights:

- the experts' dimension is split over `(axis_name, *fsdp_axes)` jointly when
  `D = prod(fsdp sizes)` divides the `L` home experts of a shard;
- else (`R * D > E`, or `L` not a multiple of `D`) each expert is split within: its
  `d_ff` dimension over the fsdp axes (the last axis of `w_gate_up`, whose gate and
  up halves are just columns here, and the first of `w_down`).

Inside `shard_map`, `gather_experts` all-gathers the shard's `L` experts over the
fsdp axes (`tiled`, so the layout above is reassembled in order). JAX's transpose of
that all-gather is a reduce-scatter: the weight gradients come back summed over
the data groups and split again, never all-reduced whole.
"""

import math
from collections.abc import Mapping

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P

from ._config import MoEConfig
from ._quant import QuantizedArray
from ._rules import local_experts


def fsdp_size(cfg: MoEConfig, mesh_shape: Mapping[str, int]) -> int:
    """`D`, the number of devices the fsdp axes hold (1 without them)."""
    for a in cfg.fsdp_axes:
        if a not in mesh_shape:
            raise ValueError(
                f"`config.fsdp_axes` {cfg.fsdp_axes} names {a!r}, which is not an "
                f"axis of the mesh (axes: {tuple(mesh_shape)})."
            )
    return math.prod(mesh_shape[a] for a in cfg.fsdp_axes)


def fsdp_dim(cfg: MoEConfig, num_shards: int, size: int) -> str | None:
    """Which dimension the fsdp axes split: `"experts"`, `"d_ff"`, or `None` (no fsdp
    axes, or all of size 1). A `ValueError` when neither divides."""
    if size == 1:
        return None
    local = local_experts(
        cfg.num_experts, num_shards, shards=f"mesh axis {cfg.axis_name!r}"
    )
    if local % size == 0:
        return "experts"
    if cfg.d_ff % size == 0:
        return "d_ff"
    raise ValueError(
        f"`config.fsdp_axes` {cfg.fsdp_axes} hold {size} devices, which divide "
        f"neither the {local} experts of a shard nor `d_ff` ({cfg.d_ff}): the "
        "experts cannot be split over them."
    )


def expert_specs(cfg: MoEConfig, experts, mesh_shape: Mapping[str, int] | None):
    """The `PartitionSpec` of each array of `experts` (an `Experts`) on a mesh of
    these axis sizes: `P(axis_name)` without fsdp axes, else the split above.
    Leading axes beyond an expert array's own (layers stacked for `lax.scan`, as
    `eqx.filter_vmap` builds them) are not split."""
    ax = cfg.axis_name
    dim = None
    if cfg.fsdp_axes:  # else no mesh needed (`mesh_shape` may be None)
        dim = fsdp_dim(cfg, mesh_shape[ax], fsdp_size(cfg, mesh_shape))
    fsdp = cfg.fsdp_axes
    _check_quantized_split(experts, dim)
    if dim is None:
        specs = {name: P(ax) for name in _ARRAYS}
    elif dim == "experts":
        specs = {name: P((ax, *fsdp)) for name in _ARRAYS}
    else:
        specs = {
            "w_gate_up": P(ax, None, fsdp),
            "w_down": P(ax, fsdp, None),
            "b_gate_up": P(ax, fsdp),
            "b_down": P(ax),  # [E, d_model]: nothing of d_ff in it, and small
        }
    specs = {
        name: _lead(getattr(experts, name), _NDIM[name], spec)
        for name, spec in specs.items()
    }
    return _with(experts, specs)


def _check_quantized_split(experts, dim) -> None:
    """Quantized weights split over the fsdp axes by whole experts only: their
    blocks and scales do not follow a split within `d_ff`."""
    if dim == "d_ff" and any(
        isinstance(getattr(experts, name), QuantizedArray) for name in _ARRAYS
    ):
        raise ValueError(
            "Quantized experts are split over `config.fsdp_axes` by whole experts "
            "only: the fsdp axes must divide the experts of each shard "
            "(`num_experts` over the expert axis), not `d_ff`."
        )


# The rank of each expert array of one layer.
_NDIM = {"w_gate_up": 3, "w_down": 3, "b_gate_up": 2, "b_down": 2}


def _lead(a, ndim: int, spec: P) -> P:
    """`spec` behind one `None` per stacked leading axis of `a`."""
    if a is None:
        return spec
    lead = len(a.shape) - ndim
    if lead < 0:
        raise ValueError(
            f"An expert array of shape {a.shape} has fewer than {ndim} axes."
        )
    return P(*((None,) * lead), *spec)


def gather_experts(cfg: MoEConfig, experts, num_shards: int):
    """Inside `shard_map`: the shard's `L` whole experts from its fsdp part (the
    experts unchanged without fsdp axes)."""
    if not cfg.fsdp_axes:
        return experts
    dim = fsdp_dim(cfg, num_shards, jax.lax.axis_size(cfg.fsdp_axes))
    if dim is None:
        return experts
    _check_quantized_split(experts, dim)
    if dim == "experts":
        axes = {name: 0 for name in _ARRAYS}
    else:
        axes = {"w_gate_up": 2, "w_down": 1, "b_gate_up": 1, "b_down": None}

    def gather(a, axis):
        if a is None or axis is None:
            return a
        return jax.lax.all_gather(a, cfg.fsdp_axes, axis=axis, tiled=True)

    gathered = {name: gather(getattr(experts, name), axes[name]) for name in _ARRAYS}
    local = local_experts(cfg.num_experts, num_shards)
    shape = gathered["w_down"].shape
    if shape[:2] != (local, cfg.d_ff):
        raise ValueError(
            f"With `config.fsdp_axes` {cfg.fsdp_axes}, a device holds part of its "
            f"shard's experts, which gather to `w_down` {shape} here instead of "
            f"({local}, {cfg.d_ff}, ...): pass the layer with the in-specs "
            "`me.shard_specs(layer, mesh)`."
        )
    return _with(experts, gathered)


_ARRAYS = ("w_gate_up", "w_down", "b_gate_up", "b_down")


def _with(experts, values: Mapping):
    """`experts` with its arrays replaced by `values[name]` (`None` stays `None`)."""
    for name in _ARRAYS:
        if getattr(experts, name) is not None:
            # `replace_fn`: a `PartitionSpec` is a tuple, which `replace` would
            # read as several replacements.
            experts = eqx.tree_at(
                lambda e, n=name: getattr(e, n),
                experts,
                replace_fn=lambda _, v=values[name]: v,
            )
    return experts
