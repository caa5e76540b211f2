"""Input checks of the public stages, run whether or not runtime type checking is on
(the test suite turns jaxtyping's import hook on; a user's program need not): a
wrong shape, dtype or count is a `ValueError` or `TypeError` naming the argument,
at trace time, and concrete values are checked where they are known."""

import math

import jax
import jax.numpy as jnp
import numpy as np

_KINDS = {
    "float": (jnp.floating, "floating-point"),
    "int": (jnp.integer, "integer"),
    "bool": (jnp.bool_, "boolean"),
}


def check_array(
    name: str,
    a,
    *,
    ndim: int | None = None,
    shape: tuple | None = None,
    kind: str | None = None,
    where: str = "",
) -> None:
    """`a` is an array of `ndim` axes and `shape` (`None` entries: any size) whose
    dtype is of `kind` (`"float"`, `"int"`, `"bool"`); else a `TypeError` (not an
    array, or the dtype) or `ValueError` (the shape) naming `name`, as `where` calls
    it."""
    prefix = f"{where}: " if where else ""
    dtype = getattr(a, "dtype", None)
    if dtype is None or not hasattr(a, "shape"):
        raise TypeError(f"{prefix}`{name}` must be an array, got {type(a).__name__}.")
    if kind is not None:
        sub, words = _KINDS[kind]
        if not jnp.issubdtype(dtype, sub):
            raise TypeError(f"{prefix}`{name}` must be {words}, got dtype {dtype}.")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and len(a.shape) != ndim:
        want = _spell(shape) if shape is not None else f"{ndim} axes"
        raise ValueError(
            f"{prefix}`{name}` must have shape {want}, got {tuple(a.shape)}."
        )
    if shape is not None and any(
        s is not None and s != got for s, got in zip(shape, a.shape, strict=True)
    ):
        raise ValueError(
            f"{prefix}`{name}` must have shape {_spell(shape)}, got {tuple(a.shape)}."
        )


def _spell(shape: tuple) -> str:
    sizes = ["_" if s is None else str(s) for s in shape]
    return "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"


def concrete(a) -> np.ndarray | None:
    """`a`'s value where it is known now (not a tracer), as NumPy; else `None`. In
    NumPy: under an outer `jit` a JAX operation would be staged, even on a concrete
    array."""
    if isinstance(a, jax.core.Tracer):
        return None
    try:
        return np.asarray(a)
    except Exception:  # a value without one (an abstract array)
        return None


def check_group_sizes(name: str, sizes, num_groups: int, num_rows: int, where: str):
    """`sizes` is `[num_groups]` integers; where concrete, none negative and their
    sum at most `num_rows`."""
    check_array(name, sizes, shape=(num_groups,), kind="int", where=where)
    value = concrete(sizes)
    if value is None:
        return
    if (value < 0).any():
        raise ValueError(
            f"{where}: `{name}` must be non-negative, got {value.tolist()}."
        )
    total = int(value.sum(dtype=np.int64))
    if total > num_rows:
        raise ValueError(
            f"{where}: `{name}` sums to {total}, more than the {num_rows} rows."
        )


def check_finite(value, name: str, owner: str) -> None:
    """A `ValueError` naming `owner.name` unless `value` is a finite number."""
    if not (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    ):
        raise ValueError(f"`{owner}.{name}` must be a finite number, got {value!r}.")


def check_positive(value, name: str, owner: str, *, optional: bool = False) -> None:
    """A `ValueError` naming `owner.name` unless `value` is a positive finite number
    (or, with `optional`, `None`)."""
    if optional and value is None:
        return
    if not (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        raise ValueError(
            f"`{owner}.{name}` must be a positive finite number"
            + (" or None" if optional else "")
            + f", got {value!r}."
        )


def check_int(
    value,
    name: str,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    optional: bool = False,
) -> None:
    """A `ValueError` naming `name` (e.g. `"num_slots"`, `"Selection.group_top"`)
    unless `value` is an integer (not a bool; a NumPy integer counts) in
    `[minimum, maximum]` (or, with `optional`, `None`)."""
    if optional and value is None:
        return
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)
    if ok and value >= minimum and (maximum is None or value <= maximum):
        return
    if maximum is not None:
        want = f"an integer in [{minimum}, {maximum}]"
    else:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ValueError(
        f"`{name}` must be {want}"
        + (" or None" if optional else "")
        + f", got {value!r}."
    )
