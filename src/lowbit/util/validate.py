"""Strict parsing of configuration mappings: unknown keys are errors that name their path.

:func:`from_mapping` builds a frozen dataclass from a mapping, driven by the dataclass's own
fields: keys are the field names, values are checked against the field's declared type (or
converted by a per-field parser), and the dataclass's ``__post_init__`` owns the defaults
and the range checks.  Every error is a ``ValueError`` that starts with the key path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["check_keys", "from_mapping"]

T = TypeVar("T")

# the annotations the config dataclasses use (strings: ``from __future__ import annotations``)
_SCALARS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def check_keys(d: dict, allowed: set[str], where: str) -> None:
    """Raise ``ValueError`` naming ``where`` if ``d`` is not a mapping or has keys outside
    ``allowed``."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        # YAML keys may be numbers, booleans or null as well as strings: sort by their text
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown, key=repr)}; allowed: {sorted(allowed)}")


def _check_type(value: Any, annotation: str, where: str) -> Any:
    options = [a.strip() for a in str(annotation).split("|")]
    if value is None:
        if "None" in options:
            return None
        raise ValueError(f"{where}: required, got null")
    for opt in options:
        kinds = _SCALARS.get(opt)
        if kinds is None:
            continue
        if isinstance(value, bool) and bool not in kinds:
            continue  # YAML's true is not a number
        if isinstance(value, kinds):
            return float(value) if opt == "float" else value
    wanted = " or ".join(o for o in options if o in _SCALARS or o == "None")
    raise ValueError(f"{where}: expected {wanted}, got {type(value).__name__} {value!r}")


def from_mapping(cls: type[T], d: Mapping | None, where: str, *,
                 parsers: Mapping[str, Callable[[Any, str], Any]] | None = None,
                 required: tuple[str, ...] = ()) -> T:
    """``cls(**d)`` for a frozen dataclass ``cls``, checked field by field.

    ``parsers[name](value, path)`` converts a field's value (e.g. a format name into a
    Format); other fields must be of their annotated scalar type (``bool``, ``int``,
    ``float``, ``str``, optionally ``| None``).  Missing fields take the dataclass's
    defaults; ``required`` ones must be given.

    Raises:
        ValueError: naming ``where.key`` for an unknown key, a missing required one, a
            value of the wrong type, or a value ``cls.__post_init__`` refuses.
    """
    d = {} if d is None else d
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    check_keys(d, set(fields), where)
    for name in required:
        if name not in d:
            raise ValueError(f"{where}.{name}: required")
    parsers = parsers or {}
    kw = {}
    for name, value in d.items():
        path = f"{where}.{name}"
        kw[name] = parsers[name](value, path) if name in parsers else _check_type(value, fields[name].type, path)
    try:
        return cls(**kw)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
