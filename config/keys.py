"""How a configuration key is declared: a dataclass field whose metadata holds its ``Key`` (type, default, range
and meaning), made by ``setting`` or ``choice``; ``section_keys`` reads a section's keys back."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args, get_origin, get_type_hints


@dataclass(frozen=True)
class Key:
    default: Any
    kind: str  # int, float, bool, str, list, choice (its values: the field's Literal), size, precision, any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    nullable: bool = False
    also: tuple = ()  # extra single values allowed outside [minimum, maximum], e.g. -1 for "all"
    refused: tuple = ()  # (value, why) pairs: values a user may expect to work, refused with their reason


def setting(default: Any, kind: str, help: str, **limits) -> Any:
    """A dataclass field declared by its ``Key``: the default (a fresh copy for a list), and the kind, range and
    meaning validation and the docs read."""
    key = Key(default, kind, help, **limits)
    if isinstance(default, list):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"key": key})
    return field(default=default, metadata={"key": key})


def choice(default: Any, help: str, **limits) -> Any:
    """A field whose allowed values are those of its ``Literal`` annotation (``SCHEMA`` reads them from it)."""
    return setting(default, "choice", help, **limits)


def _literal_values(annotation) -> tuple:
    """The values of a ``Literal[...]`` annotation, or of ``Literal[...] | None``."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return next(_literal_values(a) for a in get_args(annotation) if a is not type(None))


def section_keys(section) -> dict[str, Key]:
    """A section's fields by name, each as its ``Key``; a choice's values are those of its annotation."""
    hints = get_type_hints(section)
    keys = {}
    for f in fields(section):
        key = f.metadata["key"]
        if key.kind == "choice":
            key = replace(key, choices=_literal_values(hints[f.name]))
            if key.default not in key.choices and not (key.nullable and key.default is None):
                raise TypeError(f"{section.__name__}.{f.name}: default {key.default!r} is not one of {key.choices}")
        keys[f.name] = key
    return keys
