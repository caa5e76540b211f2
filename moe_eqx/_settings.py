"""Converters of static settings (the config's and the stage objects' fields): NumPy
and other scalars become plain Python values (hashable, static), and anything else is
left for the owner's `__check_init__` to reject with a `ValueError` naming the field
(a converted field's value is not type-checked before that)."""

import numbers

import numpy as np


def integer(value):
    """An integral scalar as an `int` (not a bool)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def real(value):
    """An integral scalar as an `int`, any other real one as a `float`."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def boolean(value):
    """A NumPy boolean as a `bool` (strings such as "false" are not truthy here)."""
    return bool(value) if isinstance(value, np.bool_) else value


def axis_names(value):
    """One mesh axis name or a sequence of them, as a tuple."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value
