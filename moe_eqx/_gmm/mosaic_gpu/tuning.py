"""The tuning table: the JSON file `autotune_gmm` writes and `MosaicGPUGMM` reads.

It lives at `$MOE_EQX_GMM_TUNING`, default `~/.cache/moe_eqx/gmm_tuning.json`, as
`{"version": 1, "entries": {key: config}}` with keys `"kernel|device|dtype|M|K|N|G"`.
A lookup takes the exact shape, else the nearest `M` for the same device, dtype, `K`,
`N`, `G`, then falls back to `default_tile_config`.
"""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp

from .tiling import Kernel, MosaicTileConfig, config_is_valid, default_tile_config


def tuning_path() -> str:
    """Where the tuning table lives: `$MOE_EQX_GMM_TUNING`, else
    `~/.cache/moe_eqx/gmm_tuning.json`."""
    return os.environ.get(
        "MOE_EQX_GMM_TUNING",
        os.path.join(os.path.expanduser("~"), ".cache", "moe_eqx", "gmm_tuning.json"),
    )


def table_key(
    kernel: Kernel, device_kind: str, dtype, m: int, k: int, n: int, g: int
) -> str:
    """The table key `"kernel|device|dtype|M|K|N|G"` of one kernel and gmm shape."""
    return f"{kernel}|{device_kind}|{jnp.dtype(dtype).name}|{m}|{k}|{n}|{g}"


def current_device_kind() -> str:
    """The first device's `device_kind` (`"unknown"` without devices): the table keeps
    one tuning per GPU model."""
    try:
        return jax.devices()[0].device_kind
    except RuntimeError:  # pragma: no cover - no devices at all
        return "unknown"


_TABLE_CACHE: dict[str, tuple[float, dict]] = {}


def load_tuning_table(path: str | None = None) -> dict:
    """The tuning table's entries (`{}` if there is no file); re-read when it changes.

    **Arguments:**

    - `path`: the JSON file (default `tuning_path()`).

    **Returns:**

    A dict from keys `"kernel|device|dtype|M|K|N|G"` to config dicts.
    """
    path = tuning_path() if path is None else path
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return {}
    cached = _TABLE_CACHE.get(path)
    if cached is not None and cached[0] == mtime:
        return cached[1]
    with open(path) as f:
        entries = json.load(f).get("entries", {})
    _TABLE_CACHE[path] = (mtime, entries)
    return entries


def save_tuning_entries(path: str, new: dict[str, dict]) -> None:
    """Merges `new` into the table at `path` (created if missing), replacing the file
    atomically so that a concurrent reader never sees half of it.

    **Arguments:**

    - `path`: the JSON file.
    - `new`: entries `{key: config dict}`; they override existing ones.
    """
    entries = dict(load_tuning_table(path))
    entries.update(new)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _nearest_rows_entry(
    table: dict, kernel: Kernel, kind: str, dtype, m: int, k: int, n: int, g: int
) -> dict | None:
    """The entry for the same kernel, device, dtype, `K`, `N`, `G` whose row count is
    nearest `m` (in ratio), or `None`."""
    prefix = [kernel, kind, jnp.dtype(dtype).name]
    best = None
    for key, value in table.items():
        parts = key.split("|")
        if parts[:3] != prefix or parts[4:] != [str(k), str(n), str(g)]:
            continue
        dist = abs(math.log(int(parts[3]) / m))
        if best is None or dist < best[0]:
            best = (dist, value)
    return None if best is None else best[1]


def lookup_tile_config(
    kernel: Kernel,
    m: int,
    k: int,
    n: int,
    g: int,
    dtype,
    device_kind: str | None = None,
) -> MosaicTileConfig:
    """The tuned tiling for this shape if the table has one, else the heuristic.

    **Arguments:**

    - `kernel`: `"fwd"`, `"dlhs"` or `"drhs"`.
    - `m`, `k`, `n`, `g`: gmm sizes (`k`, `n` multiples of 64).
    - `dtype`: input dtype.
    - `device_kind`: defaults to the first device's `device_kind`.

    **Returns:**

    A valid `MosaicTileConfig`.
    """
    itemsize = jnp.dtype(dtype).itemsize
    kind = current_device_kind() if device_kind is None else device_kind
    table = load_tuning_table()
    entry = table.get(table_key(kernel, kind, dtype, m, k, n, g))
    if entry is None:
        # The row count (buffer size) varies with the batch; reuse the nearest.
        entry = _nearest_rows_entry(table, kernel, kind, dtype, m, k, n, g)
    if entry is not None:
        fields = {
            f.name: int(entry[f.name]) for f in dataclasses.fields(MosaicTileConfig)
        }
        config = MosaicTileConfig(**fields)
        if config_is_valid(kernel, config, m, k, n, itemsize):
            return config
    return default_tile_config(kernel, m, k, n, g, itemsize)
