"""The backbone registry: each RGB backbone module registers its builder by name (the names config.BACKBONES
allows), and ``build_registered`` builds one (models.build_rgb_backbone also builds the optional packages'
timm/... and hf/..., models/external.py)."""

from __future__ import annotations

from typing import Callable

from config import BACKBONES


class ModelConfigError(ValueError):
    """A model section that does not fit the data or the backbone: the scripts print it as a config error.
    Only this error is turned into one; any other ValueError keeps its traceback (a bug, not a config)."""


_RGB_BACKBONES: dict[str, Callable] = {}


def register_backbone(name: str):
    if name not in BACKBONES:
        raise ValueError(f"backbone '{name}' is not in config.BACKBONES: add it there, so configs may name it")

    def wrap(factory):
        _RGB_BACKBONES[name] = factory
        return factory

    return wrap


def registered_names() -> list[str]:
    return sorted(_RGB_BACKBONES)


def build_registered(name: str, width: int = 32):
    """The backbone ``name`` with BatchNorm layers (``models.norms.convert_norms`` applies model.norm)."""
    if name not in _RGB_BACKBONES:
        raise ModelConfigError(f"unknown model '{name}'; known: {', '.join(sorted(_RGB_BACKBONES))}")
    return _RGB_BACKBONES[name](width=width)
