"""The private JAX and Equinox APIs the library uses, in one place.

Each is pinned by the version bounds of `jax` and `equinox` in `pyproject.toml` (the
versions the test suite runs); a new release that moves one is fixed here alone.
"""

import equinox.internal as eqxi
import jax
from jax.sharding import Mesh

# The marker `equinox.internal.filter_primitive_*` put in place of each array of a
# primitive's arguments (`moe_eqx._autodiff` needs it to tell arrays from statics).
missing_dynamic = eqxi._primitive._missing_dynamic


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
