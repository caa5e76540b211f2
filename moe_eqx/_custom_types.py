"""Shared jaxtyping aliases and small helpers used across stages."""

from typing import TypeAlias

from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

__all__ = [
    "Array",
    "Bool",
    "Float",
    "Int",
    "PRNGKeyArray",
    "Tokens",
    "RoutedWeights",
    "RoutedExperts",
    "ExpertCounts",
]

Tokens: TypeAlias = Float[Array, "tokens d_model"]
RoutedWeights: TypeAlias = Float[Array, "tokens k"]
RoutedExperts: TypeAlias = Int[Array, "tokens k"]
ExpertCounts: TypeAlias = Int[Array, " experts"]
