"""A config from YAML presets (``base:`` inheritance, deep-merged; lists are replaced) and ``--set`` overrides,
then validated into a typed ``Config``; a config saved with a checkpoint (``saved_config``); and back to YAML
(``dump``)."""

from __future__ import annotations

import copy
import os
from typing import Any

import yaml

from config.renames import with_new_names
from config.schema import Config, defaults, flat_keys
from config.validation import validate
from core.errors import ConfigError


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found; presets live in configs/ (e.g. configs/quickstart.yaml)")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = str(getattr(e, "problem", e))
        fix = "; indent with spaces, not tabs" if "\\t" in problem or "\t" in problem else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({problem}){fix}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a config must be a mapping of sections (model:, data:, ...), got {type(data).__name__}"
        )
    return data


def _merge(into: dict, update: dict, origins: dict, source: str, prefix: str = "") -> None:
    for key, value in update.items():
        dotted = prefix + str(key)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, origins, source, dotted + ".")
        else:
            into[key] = copy.deepcopy(value)
            for leaf in flat_keys(value, dotted + ".") if isinstance(value, dict) else [dotted]:
                origins[leaf] = source
            origins.setdefault(dotted, source)


def _load_chain(path: str, seen: tuple = ()) -> list[tuple[str, dict]]:
    """The files of an inheritance chain, root first: [(path, data), ...]."""
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError(f"{path}: 'base' inheritance loops back to this file; remove one of the 'base:' lines")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return [(path, data)]
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: must be a file name such as base.yaml, got {base!r}")
    base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
    if not os.path.exists(base_path):
        raise ConfigError(
            f"{path}: base: {base} not found ({base_path}); a base is resolved relative to the file "
            f"that names it: fix the 'base:' line, e.g. base: base.yaml"
        )
    return _load_chain(base_path, seen + (real,)) + [(path, data)]


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE, e.g. --set data.batch_size=8")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(
    path: str | None, overrides: list[str] = (), use_amp: bool = False, origins: dict | None = None
) -> Config:
    """Defaults <- the preset's base chain <- the preset <- each --set; then validated. ``origins``, if given, is
    filled with where each key was set (a file, or "--set KEY=VALUE"; keys left at their defaults are absent)."""
    cfg = defaults()
    origins = {} if origins is None else origins
    if path is not None:
        for file_path, data in _load_chain(path):
            _merge(cfg, with_new_names(data, file_path), origins, file_path)
    for text in overrides:
        key, value = parse_override(text)
        update: dict = {}
        node = update
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        _merge(cfg, with_new_names(update, f"--set {text}"), origins, f"--set {text}")
    if use_amp:
        cfg["trainer"]["precision"] = "amp"
        origins["trainer.precision"] = "--use_amp"
    return Config.from_dict(validate(cfg, origins))


def saved_config(saved: dict) -> Config:
    """A config saved with a checkpoint, validated. A checkpoint of the current format (artifacts/checkpoint.py)
    saved every key its code had; a key added since takes its default, so a key whose default would change what
    an older checkpoint computes comes with a new checkpoint format, not a shim here. Renamed keys and values
    are read under their new names, silently (the checkpoint is not the user's to edit)."""
    cfg = defaults()
    _merge(cfg, with_new_names(saved), {}, "a checkpoint's config")
    return Config.from_dict(validate(cfg))


def dump(cfg: Config | dict) -> str:
    values = cfg.to_dict() if isinstance(cfg, Config) else cfg
    return yaml.safe_dump(values, sort_keys=False, default_flow_style=None)
