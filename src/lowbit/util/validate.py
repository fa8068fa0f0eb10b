"""Strict parsing of configuration mappings: unknown keys are errors that name their path."""

from __future__ import annotations

__all__ = ["check_keys"]


def check_keys(d: dict, allowed: set[str], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` if ``d`` is not a mapping or has keys outside
    ``allowed``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
