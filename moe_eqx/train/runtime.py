"""Processes, devices and the mesh of a training run.

The simulated CPU device count (`--ep N`) is applied by the command line after the
flags are parsed and before anything initialises a jax backend (importing jax does not;
the count is read when the first device is touched). Nothing at import time touches one.
"""

import dataclasses
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

# Set by `moe_eqx.train.launch` for each process it starts.
ENV_COORDINATOR = "MOE_EQX_COORDINATOR"
ENV_NUM_PROCESSES = "MOE_EQX_NUM_PROCESSES"
ENV_PROCESS_ID = "MOE_EQX_PROCESS_ID"
ENV_INIT_TIMEOUT = "MOE_EQX_INIT_TIMEOUT"
ENV_LAUNCHER_PID = "MOE_EQX_LAUNCHER_PID"


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where a run executes.

    **Fields:**

    - `process`, `num_processes`: this process's index and the process count.
    - `ep`: expert-parallel size (devices on the mesh's "expert" axis).
    - `data`: data-parallel groups (devices on the mesh's "data" axis; 1: no such
        axis).
    - `mesh`: the mesh ("expert",) of `ep` devices, or ("data", "expert") of
        `data * ep` with `data > 1`; `None` on one device of one process.
    - `distributed`: whether this is a `jax.distributed` run.
    """

    process: int
    num_processes: int
    ep: int
    mesh: Mesh | None
    distributed: bool
    data: int = 1

    @property
    def lead(self) -> bool:
        """Process 0 prints, logs and checkpoints."""
        return self.process == 0


def set_cpu_devices(count: int) -> None:
    """Asks XLA:CPU for `count` devices unless the user already chose a count.

    Importing `moe_eqx` imports jax, but the CPU device count is only read when the
    backend is first initialised, so it is not too late here (`make_runtime` checks
    `jax.device_count()` in case it is)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backend already initialised (e.g. called in-process by a test)


def exit_with_launcher(launcher_pid: int) -> None:
    """Exits this process when the launcher that started it is gone: an orphaned
    process would otherwise wait in a collective forever."""

    def watch():
        while True:
            if os.getppid() != launcher_pid:
                print("launcher is gone; exiting.", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="moe_eqx-launcher-watch").start()


def init_distributed() -> None:
    """`jax.distributed.initialize` from the launcher's variables, or auto-detection."""
    # Cross-process collectives on CPU need gloo (XLA:CPU has none by default). Only
    # the CPU client reads this, and asking which backend is in use would initialise
    # it too early, so it is set unconditionally.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        # With a persistent compilation cache written by an earlier multi-process CPU
        # run, the next run loads the cached executable and hangs in its first
        # collective (jax 0.10). Compiling afresh always works.
        jax.config.update("jax_enable_compilation_cache", False)
    address = os.environ.get(ENV_COORDINATOR)
    if address is None:
        # TPU pods, SLURM, ...: jax detects the cluster itself.
        jax.distributed.initialize()
        return
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=int(os.environ[ENV_PROCESS_ID]),
        initialization_timeout=int(os.environ.get(ENV_INIT_TIMEOUT, "60")),
    )


def _check_devices(
    ep: int, *, data: int, experts: int, batch: int, distributed: bool
) -> None:
    devices = ep * data
    flags = f"--ep {ep}" + (f" x --data {data}" if data > 1 else "")
    if distributed and devices != jax.device_count():
        raise SystemExit(
            f"{flags} must equal the global device count ({jax.device_count()}) with "
            "--distributed: the mesh spans every device of every process."
        )
    if devices > jax.device_count():
        raise SystemExit(
            f"{flags} needs {devices} devices, but jax sees {jax.device_count()} "
            f"({jax.default_backend()}). On CPU, unset XLA_FLAGS or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}; on an "
            "accelerator host, JAX_PLATFORMS=cpu simulates devices on the CPU."
        )
    if experts % ep:
        raise SystemExit(f"--experts ({experts}) must be divisible by --ep ({ep}).")
    if batch % devices:
        raise SystemExit(
            f"--batch ({batch}) must be divisible by {flags} ({devices}): the batch "
            "is sharded over every device."
        )


def make_runtime(
    ep: int | None,
    *,
    experts: int,
    batch: int,
    distributed: bool,
    data: int = 1,
) -> Runtime:
    """Joins the `jax.distributed` run if asked, checks the device count and builds
    the mesh.

    **Arguments:**

    - `ep`: the `--ep` flag (`None`: 1, or every global device with `distributed`,
        divided by `data`).
    - `experts`, `batch`: must be divisible by the expert-parallel size (the batch
        by the device count).
    - `distributed`: join a `jax.distributed` run first.
    - `data`: the `--data` flag: data-parallel groups, a mesh axis "data" before
        "expert" when > 1.

    **Returns:**

    The [`moe_eqx.train.runtime.Runtime`][]. Exits with a message naming the flag when
    the devices do not fit.
    """
    if distributed:
        init_distributed()
    if ep is None:
        ep = jax.device_count() // data if distributed else 1
    _check_devices(ep, data=data, experts=experts, batch=batch, distributed=distributed)
    mesh = None
    if data > 1:
        mesh = jax.make_mesh(
            (data, ep),
            ("data", "expert"),
            axis_types=(jax.sharding.AxisType.Auto,) * 2,
            devices=jax.devices()[: data * ep],
        )
    elif ep > 1 or distributed:
        mesh = jax.make_mesh(
            (ep,),
            ("expert",),
            axis_types=(jax.sharding.AxisType.Auto,),
            devices=jax.devices()[:ep],
        )
    return Runtime(
        process=jax.process_index(),
        num_processes=jax.process_count(),
        ep=ep,
        mesh=mesh,
        distributed=distributed,
        data=data,
    )


def gather_to_host(tree: Any) -> Any:
    """Host NumPy copy of `tree`. Collective in a multi-process run: every process must
    call it, in the same order."""
    from jax.experimental import multihost_utils

    def get(a):
        if not isinstance(a, jax.Array):
            return a
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            # A typed PRNG key has no NumPy form: its key data, wrapped again.
            data = get(jax.random.key_data(a))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
        if a.is_fully_addressable or a.is_fully_replicated:
            return np.asarray(a)
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(get, tree)


def all_agree(ok: bool, runtime: Runtime) -> bool:
    """Whether `ok` holds on every process (collective in a multi-process run)."""
    if runtime.num_processes == 1:
        return bool(ok)
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(bool(ok)))))
