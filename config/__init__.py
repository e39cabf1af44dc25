"""YAML presets: inheritance, strict validation, command-line overrides.

A config is a plain nested dict (``cfg["data"]["batch_size"]``). Every key, its default, its type and
its allowed range are declared once, in ``SCHEMA`` (config/schema.py); ``configs/base.yaml`` mirrors the defaults
for readers and a test keeps the two equal.

Errors are ``ConfigError``: one line naming the file (or ``--set``), the key, what is wrong and how to
fix it. The scripts print it and exit with code 2. The modules:

    schema      every key (SCHEMA), its default and range; the backbone and norm names
    loading     YAML presets with base:, --set, dump
    validation  each value, then the checks across keys; apply_flags
    compat      configs of older checkpoints (saved_config)
    flags       eval.py's and infer_chunked.py's flags -> keys (INFERENCE_FLAGS)
"""
from config.compat import saved_config
from config.flags import INFERENCE_FLAGS, apply_inference_flags
from config.loading import dump, load_config, parse_override
from config.schema import ALL_KEYS, BACKBONES, NORMS, SCHEMA, Key, defaults
from config.validation import apply_flags, validate
from core.errors import ConfigError

__all__ = ["ALL_KEYS", "BACKBONES", "INFERENCE_FLAGS", "NORMS", "SCHEMA", "ConfigError", "Key", "apply_flags",
           "apply_inference_flags", "defaults", "dump", "load_config", "parse_override", "saved_config", "validate"]
