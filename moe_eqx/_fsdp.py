"""Where each expert array is split (the expert axis; FSDP / ZeRO-3's data axes; the
tensor axis's `d_ff` split, `moe_eqx._tensor`), and FSDP's gather when the layer
runs.

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


def tensor_size(cfg: MoEConfig, mesh_shape: Mapping[str, int] | None) -> int:
    """`P`, the devices of `config.tensor_axis` (1 without one); a `ValueError` when
    the mesh lacks it or it does not divide `d_ff`."""
    axis = cfg.tensor_axis
    if axis is None or mesh_shape is None:
        return 1
    if axis not in mesh_shape:
        raise ValueError(
            f"`config.tensor_axis` {axis!r} is not an axis of the mesh (axes: "
            f"{tuple(mesh_shape)})."
        )
    size = mesh_shape[axis]
    for name, width in (("d_ff", cfg.d_ff), ("shared_d_ff", cfg.shared_d_ff)):
        if width % size:
            raise ValueError(
                f"`config.tensor_axis` {axis!r} has {size} devices, which do not "
                f"divide `{name}` ({width}): every expert's hidden units are split "
                "over it."
            )
    return size


def fsdp_dim(cfg: MoEConfig, num_shards: int, size: int, tensor: int = 1) -> str | None:
    """Which dimension the fsdp axes split: `"experts"`, `"d_ff"`, or `None` (no fsdp
    axes, or all of size 1). A `ValueError` when neither divides (`tensor`: the
    devices `d_ff` is split over already)."""
    if size == 1:
        return None
    local = local_experts(
        cfg.num_experts, num_shards, shards=f"mesh axis {cfg.axis_name!r}"
    )
    if local % size == 0:
        return "experts"
    if (cfg.d_ff // tensor) % size == 0:
        return "d_ff"
    raise ValueError(
        f"`config.fsdp_axes` {cfg.fsdp_axes} hold {size} devices, which divide "
        f"neither the {local} experts of a shard nor its `d_ff` ({cfg.d_ff // tensor}"
        f"{' per device of the tensor axis' if tensor > 1 else ''}): the experts "
        "cannot be split over them."
    )


def expert_specs(cfg: MoEConfig, experts, mesh_shape: Mapping[str, int] | None):
    """The `PartitionSpec` of each array of `experts` (an `Experts`) on a mesh of
    these axis sizes: `P(axis_name)` without fsdp axes, else the split above, and
    with `config.tensor_axis` each expert's `d_ff` over it (`moe_eqx._tensor`).
    Leading axes beyond an expert array's own (layers stacked for `lax.scan`, as
    `eqx.filter_vmap` builds them) are not split. A quantized weight gets a tree of
    specs (its values' and its scales')."""
    ax = cfg.axis_name
    tensor = tensor_size(cfg, mesh_shape)
    dim = None
    if cfg.fsdp_axes:  # else no mesh needed (`mesh_shape` may be None)
        dim = fsdp_dim(cfg, mesh_shape[ax], fsdp_size(cfg, mesh_shape), tensor)
    fsdp = cfg.fsdp_axes
    _check_quantized_split(experts, dim)
    tp = (cfg.tensor_axis,) if tensor > 1 else ()
    check_quantized_tensor_split(cfg, experts, tensor)
    # The `d_ff` dimension's axes: the tensor axis, then (FSDP's `d_ff` split) the
    # fsdp axes within each tensor device's part.
    d_ff = (*tp, *(fsdp if dim == "d_ff" else ()))
    lead = (ax, *fsdp) if dim == "experts" else ax
    d_ff = d_ff or None
    specs = {
        "w_gate_up": P(lead, None, d_ff),
        "w_down": P(lead, d_ff, None),
        "b_gate_up": P(lead, d_ff),
        "b_down": P(lead),  # [E, d_model]: nothing of d_ff in it, and small
    }
    specs = {
        name: jax.tree.map(
            _trimmed,
            _quantized_specs(
                getattr(experts, name),
                _lead(getattr(experts, name), _NDIM[name], spec),
            ),
            is_leaf=lambda s: isinstance(s, P),
        )
        for name, spec in specs.items()
    }
    return _with(experts, specs)


def _trimmed(spec: P) -> P:
    """`spec` without trailing `None`s: the same split, written as `P(axis)` (the
    form `shard_specs` has always returned, and `P`'s equality tells apart)."""
    parts = tuple(spec)
    while parts and parts[-1] is None:
        parts = parts[:-1]
    return P(*parts)


def _quantized_specs(a, spec: P):
    """`spec` for a float array; for a `QuantizedArray` split along `d_ff`, the
    specs of its values and scales, as its format lays them out."""
    if not isinstance(a, QuantizedArray) or all(d is None for d in spec[-2:]):
        return spec
    values, scales = a.format.partition_specs(tuple(spec[:-2]), *spec[-2:])
    values, scales = P(*values), P(*scales)
    return eqx.tree_at(
        lambda q: (q.values, q.scales),
        a,
        (values, scales),
        is_leaf=lambda x: x is None,
    )


def check_quantized_tensor_split(cfg: MoEConfig, experts, tensor: int) -> None:
    """Quantized weights split over the tensor axis along their scale blocks only:
    FP8's 128 x 128 blocks (both weights' `d_ff` sides) and MXFP4's 32 values along
    `w_down`'s `d_ff` rows must not straddle two devices."""
    if tensor == 1:
        return
    per_device = cfg.d_ff // tensor
    for name in ("w_gate_up", "w_down"):
        w = getattr(experts, name)
        if not isinstance(w, QuantizedArray):
            continue
        # `d_ff` is `w_down`'s contracting axis and `w_gate_up`'s output axis.
        block = w.format.block("k" if name == "w_down" else "n")
        if per_device % block:
            raise ValueError(
                f"`config.tensor_axis` {cfg.tensor_axis!r} splits `d_ff` "
                f"({cfg.d_ff}) into {per_device} hidden units per device, which does "
                f"not align with the {block}-wide scale blocks of the {w.fmt!r} "
                f"`{name}`: use a tensor axis whose size leaves a multiple of "
                f"{block} per device."
            )


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
    tensor = jax.lax.axis_size(cfg.tensor_axis) if cfg.tensor_axis else 1
    dim = fsdp_dim(cfg, num_shards, jax.lax.axis_size(cfg.fsdp_axes), tensor)
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
    if shape[:2] != (local, cfg.d_ff // tensor):
        raise ValueError(
            f"With `config.fsdp_axes` {cfg.fsdp_axes}, a device holds part of its "
            f"shard's experts, which gather to `w_down` {shape} here instead of "
            f"({local}, {cfg.d_ff // tensor}, ...): pass the layer with the in-specs "
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


def shared_specs(cfg: MoEConfig, shared, mesh_shape: Mapping[str, int] | None):
    """The `PartitionSpec`s of the shared experts' arrays: replicated, or with
    `config.tensor_axis` their hidden units split over it as the routed experts'
    (`w_gate_up`'s columns, `w_down`'s rows). `P()` when there are none."""
    if shared is None:
        return P()
    specs = jax.tree.map(lambda _: P(), shared)
    if tensor_size(cfg, mesh_shape) == 1:
        return specs
    axis = cfg.tensor_axis
    return eqx.tree_at(
        lambda s: (s.w_gate_up, s.w_down),
        specs,
        (P(None, axis), P(axis)),
    )
