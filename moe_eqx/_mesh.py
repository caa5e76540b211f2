"""Which mesh and platform a call runs on: the caller's mesh, the ambient one
(`jax.set_mesh`) or the experts' own; its checks; the platform `"auto"` resolves for;
and placing a tree's arrays by partition specs. Below the layer and the per-shard
stages."""

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ._config import MoEConfig
from ._fsdp import fsdp_dim, fsdp_size, tensor_size
from ._rules import local_experts

PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def platform_of(platform: str | None, devices: str | None) -> str:
    """The platform that `"auto"` backends resolve for: `platform` if given (one of
    `PLATFORMS`, else a `ValueError` naming it), else `devices` (the platform of
    the devices the program runs on, if known), else `jax.default_backend()`."""
    if platform is None:
        platform = devices if devices is not None else jax.default_backend()
        return PLATFORMS.get(platform, platform)
    if platform not in PLATFORMS:
        raise ValueError(
            f"`platform` must be one of {tuple(PLATFORMS)} or None, got {platform!r}."
        )
    return PLATFORMS[platform]


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the current `shard_map` is manual over (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()) or ())


def auto_mesh(mesh: Mesh) -> Mesh:
    # `jax.make_mesh` makes Explicit axes by default in recent jax; the layer is a
    # manual shard_map over its axis and works on the same devices with Auto axes, which
    # lets callers pass unsharded arrays and take gradients outside of jit.
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def output_home(x, ambient: Mesh | None):
    """Where the output of a concrete `x` goes (`None` for a tracer): `x`'s sharding;
    inside `with jax.set_mesh(mesh):`, for an `x` that was never placed
    (uncommitted), replicated over that mesh, which is where jax puts what is
    computed from such an `x` there (so `x + y` works)."""
    home = concrete_sharding(x)
    if home is not None and ambient is not None and not x.committed:
        return NamedSharding(ambient, P())
    return home


def concrete_sharding(a):
    """The sharding of a concrete array (`None` for a tracer)."""
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        return a.sharding
    return None


def resolve_mesh(
    mesh: Mesh | None, ambient: Mesh | None, cfg: MoEConfig, experts
) -> Mesh | None:
    """The mesh to run on: `mesh` if given; else the `ambient` one (`jax.set_mesh`)
    if it has `config.axis_name`; else the mesh the experts are placed on (a placed
    layer in evaluation code); else `None`, one device."""
    if mesh is not None:
        return mesh
    if ambient is not None and cfg.axis_name in ambient.shape:
        return ambient
    placed = concrete_sharding(experts)
    if isinstance(placed, NamedSharding) and cfg.axis_name in placed.mesh.shape:
        if placed.mesh.shape[cfg.axis_name] > 1:
            return placed.mesh
    if isinstance(experts, jax.core.Tracer):
        spec = getattr(jax.typeof(experts).sharding, "spec", None)
        if spec and any(d is not None for d in spec):
            raise ValueError(
                f"The layer's experts are sharded ({spec}) but no mesh was given: "
                "call it with `mesh=...` or inside `with jax.set_mesh(mesh):`, or "
                "gather the experts first for one device."
            )
    return None


def check_mesh(mesh: Mesh, cfg: MoEConfig) -> int:
    if cfg.axis_name not in mesh.shape:
        raise ValueError(
            f"`config.axis_name` {cfg.axis_name!r} is not an axis of the mesh "
            f"(axes: {tuple(mesh.shape)})."
        )
    num_shards = mesh.shape[cfg.axis_name]
    local_experts(cfg.num_experts, num_shards, shards=f"mesh axis {cfg.axis_name!r}")
    tensor = tensor_size(cfg, mesh.shape)
    fsdp_dim(cfg, num_shards, fsdp_size(cfg, mesh.shape), tensor)
    return num_shards


def resolve_platform(platform: str | None, mesh: Mesh | None) -> str:
    # The mesh's devices, not the default backend, decide what "auto" means: a CPU
    # mesh on a GPU machine still needs the dense exchange.
    devices = None if mesh is None else mesh.devices.flat[0].platform
    return platform_of(platform, devices)


def place_tree(place, tree, spec, mesh: Mesh):
    """`place(leaf, mesh, spec)` at every array of `tree`; `spec` is one
    `PartitionSpec` for all of them or a tree of them matching `tree`."""
    if isinstance(spec, P):
        return jax.tree.map(lambda a: place(a, mesh, spec), tree)
    # `spec` may be a prefix of `tree`: one spec for all arrays of a quantized weight.
    return jax.tree.map(
        lambda s, a: jax.tree.map(lambda leaf: place(leaf, mesh, s), a),
        spec,
        tree,
        is_leaf=lambda n: n is None or isinstance(n, P),
    )


def spec_axes(spec: P) -> list[str]:
    axes = []
    for d in spec:
        axes += [] if d is None else [d] if isinstance(d, str) else list(d)
    return axes
