"""Atomic, checksummed checkpoints of training state (model, optimizer state, step, key).

Layout of a checkpoint directory, for step `s` (zero-padded to 10 digits):

- `ckpt_<s>.eqx`: the leaves, written by `equinox.tree_serialise_leaves`.
- `ckpt_<s>.json`: the manifest: step, payload file name, size, sha256, metadata.

Both files are written to a temporary file in the same directory, fsynced, then moved
into place with `os.replace` (atomic on POSIX), payload first. A checkpoint exists only
once its manifest does, so a crash mid-write never leaves a corrupt *latest* checkpoint;
corruption after the fact (a truncated or altered payload) is caught by the checksum.
"""

import hashlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

FORMAT_VERSION = 1
_MANIFEST = re.compile(r"^ckpt_(\d{10})\.json$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupt, or does not match the expected tree."""


def _name(step: int, suffix: str) -> str:
    return f"ckpt_{step:010d}{suffix}"


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_host(x: Any) -> Any:
    if _is_key(x):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array):
        if not (x.is_fully_addressable or x.is_fully_replicated):
            raise ValueError(
                "save_checkpoint got an array sharded across processes; gather it first "
                "(e.g. `jax.experimental.multihost_utils.process_allgather(x, "
                "tiled=True)` on every process) and save from one process."
            )
        return np.asarray(x)
    return x


def list_checkpoints(directory: str | os.PathLike) -> list[int]:
    """Steps of the checkpoints in `directory` (those with a manifest), oldest first.

    **Arguments:**

    - `directory`: the checkpoint directory (need not exist).

    **Returns:**

    A sorted list of steps; empty when there is none.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        m = _MANIFEST.match(entry.name)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    tree: PyTree,
    *,
    keep: int = 2,
    metadata: dict | None = None,
) -> Path:
    """Writes `tree` as the checkpoint of `step`, atomically, and prunes old ones.

    Arrays must be addressable from this process (in a multi-process run, gather
    sharded arrays first and save from one process). Typed PRNG keys are stored as
    their key data and restored as keys.

    **Arguments:**

    - `directory`: the checkpoint directory (created if missing).
    - `step`: the step the state belongs to (the step to resume from).
    - `tree`: any PyTree of arrays and Python scalars (model, optimizer state, key...);
        non-array leaves are not stored (they come from `like_tree` on load).
    - `keep`: how many most recent checkpoints to keep (>= 1).
    - `metadata`: JSON-serialisable extra information, stored in the manifest.

    **Returns:**

    The path of the manifest written.
    """
    if keep < 1:
        raise ValueError(f"`keep` must be >= 1, got {keep}.")
    if step < 0:
        raise ValueError(f"`step` must be >= 0, got {step}.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    host_tree = jax.tree.map(_to_host, tree)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, host_tree)
    payload = buf.getvalue()
    payload_name = _name(step, ".eqx")
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "payload": payload_name,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "num_leaves": len(jax.tree.leaves(host_tree)),
        "metadata": metadata or {},
    }
    _atomic_write(directory / payload_name, payload)
    manifest_path = directory / _name(step, ".json")
    _atomic_write(manifest_path, json.dumps(manifest, indent=1).encode())
    for old in list_checkpoints(directory)[:-keep]:
        # Manifest first: a half-pruned checkpoint is invisible rather than corrupt.
        for suffix in (".json", ".eqx"):
            try:
                os.unlink(directory / _name(old, suffix))
            except FileNotFoundError:
                pass
    return manifest_path


def read_manifest(directory: str | os.PathLike, step: int) -> dict:
    """The manifest of the checkpoint of `step` (raises `CheckpointError` if unreadable).

    **Arguments:**

    - `directory`: the checkpoint directory.
    - `step`: which checkpoint.

    **Returns:**

    The manifest as a dict (`step`, `payload`, `size`, `sha256`, `metadata`, ...).
    """
    path = Path(directory) / _name(step, ".json")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint manifest {path} does not exist.") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable: {e}") from e
    if (
        not isinstance(manifest, dict)
        or manifest.get("format_version") != FORMAT_VERSION
    ):
        raise CheckpointError(
            f"checkpoint manifest {path} has an unknown format (expected "
            f"format_version {FORMAT_VERSION})."
        )
    return manifest


def _check_like(loaded: Any, like: Any, where: str) -> Any:
    if not isinstance(like, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
        return loaded
    want_dtype = like.dtype
    if _is_key_like(like):
        impl = jax.random.key_impl(like) if isinstance(like, jax.Array) else None
        want_shape = jax.eval_shape(jax.random.key_data, like).shape
        if tuple(loaded.shape) != tuple(want_shape):
            raise CheckpointError(
                f"{where}: PRNG key data has shape {tuple(loaded.shape)}, expected "
                f"{tuple(want_shape)}."
            )
        return jax.random.wrap_key_data(jnp.asarray(loaded), impl=impl)
    if tuple(loaded.shape) != tuple(like.shape) or loaded.dtype != want_dtype:
        raise CheckpointError(
            f"{where}: leaf has shape {tuple(loaded.shape)} and dtype {loaded.dtype}, "
            f"expected {tuple(like.shape)} and {want_dtype} (was the checkpoint written "
            "by a different model configuration?)."
        )
    sharding = getattr(like, "sharding", None)
    if (
        isinstance(like, jax.Array | jax.ShapeDtypeStruct)
        and sharding is not None
        and sharding.is_fully_addressable
    ):
        # Restored where the like tree's leaf lives (e.g. experts split over a mesh),
        # so that a resumed training step reuses the compilation of the first run. A
        # sharding over several processes is left to the caller: placing onto it is a
        # collective, which processes that load at different times would deadlock on.
        return jax.device_put(loaded, sharding)
    return loaded


def _is_key_like(x: Any) -> bool:
    return _is_key(x) or (
        isinstance(x, jax.ShapeDtypeStruct)
        and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    )


def _verified_payload(path: Path, manifest: dict) -> bytes:
    """The payload's bytes, checked against the manifest's size and sha256."""
    try:
        payload = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint payload {path} is unreadable: {e}") from e
    if len(payload) != manifest["size"]:
        raise CheckpointError(
            f"checkpoint payload {path} is truncated or altered: {len(payload)} bytes, "
            f"the manifest says {manifest['size']}."
        )
    digest = hashlib.sha256(payload).hexdigest()
    if digest != manifest["sha256"]:
        raise CheckpointError(
            f"checkpoint payload {path} is corrupt: sha256 {digest[:16]}... does not "
            f"match the manifest's {manifest['sha256'][:16]}...."
        )
    return payload


def read_checkpoint(
    directory: str | os.PathLike, step: int, like_tree: PyTree
) -> PyTree:
    """Low-level loader of one checkpoint: verifies size and sha256, then deserialises.

    **Arguments:**

    - `directory`: the checkpoint directory.
    - `step`: which checkpoint.
    - `like_tree`: a PyTree with the structure, shapes and dtypes of the saved one
        (arrays or `jax.ShapeDtypeStruct`s); its non-array leaves are kept.

    **Returns:**

    The loaded tree: JAX arrays with the sharding of `like_tree`'s leaf where it has
    JAX arrays (or `ShapeDtypeStruct`s with a sharding) on this process's devices,
    on the default device where that sharding spans several processes (place them
    as the first run did), NumPy arrays where it has NumPy arrays.

    **Raises:**

    `CheckpointError` with the reason when the checkpoint is missing, truncated, corrupt
    or does not match `like_tree`.
    """
    directory = Path(directory)
    manifest = read_manifest(directory, step)
    path = directory / manifest["payload"]
    payload = _verified_payload(path, manifest)
    # Keys are stored as key data: deserialise against a like tree of raw key data.
    raw_like = jax.tree.map(
        lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key_like(x) else x,
        like_tree,
    )
    try:
        loaded = eqx.tree_deserialise_leaves(io.BytesIO(payload), raw_like)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint payload {path} does not match the expected tree: {e}"
        ) from e
    paths_like = jax.tree_util.tree_flatten_with_path(like_tree)[0]
    leaves_loaded, treedef = jax.tree.flatten(loaded)
    if len(paths_like) != len(leaves_loaded):
        raise CheckpointError(
            f"checkpoint payload {path} has a different tree structure."
        )
    checked = [
        _check_like(new, like, f"checkpoint {path}, leaf {jax.tree_util.keystr(kp)}")
        for new, (kp, like) in zip(leaves_loaded, paths_like, strict=True)
    ]
    return jax.tree.unflatten(treedef, checked)


def load_checkpoint(
    directory: str | os.PathLike, like_tree: PyTree
) -> tuple[int, PyTree]:
    """Loads the most recent good checkpoint in `directory`.

    If the latest checkpoint is unreadable, truncated or corrupt, prints a warning to
    stderr and falls back to the previous one, and so on.

    **Arguments:**

    - `directory`: the checkpoint directory.
    - `like_tree`: a PyTree with the structure, shapes and dtypes of the saved one.

    **Returns:**

    `(step, tree)`.

    **Raises:**

    `CheckpointError` when the directory holds no checkpoint, or none is good (the
    message lists why each one was rejected).
    """
    steps = list_checkpoints(directory)
    if not steps:
        raise CheckpointError(f"no checkpoint in {directory}.")
    reasons = []
    for step in reversed(steps):
        try:
            tree = read_checkpoint(directory, step, like_tree)
        except CheckpointError as e:
            reasons.append(f"step {step}: {e}")
            print(
                f"WARNING: skipping checkpoint of step {step}: {e}",
                file=sys.stderr,
                flush=True,
            )
            continue
        if reasons:
            print(
                f"WARNING: resuming from the previous good checkpoint (step {step}).",
                file=sys.stderr,
                flush=True,
            )
        return step, tree
    raise CheckpointError(
        f"no good checkpoint in {directory}:\n  " + "\n  ".join(reasons)
    )
