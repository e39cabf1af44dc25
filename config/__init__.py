"""YAML presets: inheritance, strict validation, command-line overrides.

A config is a typed ``Config``: one dataclass per section (``cfg.data.batch_size``), built from the YAML and
``--set`` and validated once. Every key, its type, default and allowed range are declared once, as the fields of
those dataclasses (config/schema.py), a choice's values as its ``Literal`` annotation; ``configs/base.yaml`` is
written from them for readers (``python -m config.reference``), and a test keeps the two equal. Code below the
scripts takes the section it uses (``DataConfig``, ...), not the whole config.

Errors are ``ConfigError``: one line naming the file (or ``--set``), the key, what is wrong and how to
fix it. The scripts print it and exit with code 2. The modules:

    keys        how a key is declared: a field with its Key (type, default, range, meaning): setting, choice
    schema      the sections (Config, ModelConfig, TrainConfig, InferConfig, TrainerConfig), every key as a
                field (SCHEMA: the same as a mapping); the backbone and norm names
    data_schema the data section (DataConfig), the largest
    loading     YAML presets with base:, --set, dump; a checkpoint's saved config (saved_config)
    validation  each value, then the checks across keys; apply_flags, derive (a validated copy with keys changed)
    flags       eval.py's and infer_chunked.py's shared flags, the keys they set (INFERENCE_FLAGS)
    reference   configs/base.yaml written from the schema (python -m config.reference)
    renames     renamed and removed keys and choices: the new names read, the removed ones named (with_new_names)
"""

from config.data_schema import DataConfig
from config.flags import INFERENCE_FLAGS, add_inference_flags, apply_inference_flags, inference_overrides
from config.keys import Key
from config.loading import dump, load_config, parse_override, saved_config
from config.schema import (
    ALL_KEYS,
    BACKBONES,
    EXTERNAL_BACKBONES,
    NORMS,
    SCHEMA,
    Config,
    InferConfig,
    ModelConfig,
    TrainConfig,
    TrainerConfig,
    defaults,
)
from config.validation import apply_flags, derive, external_package_missing, validate
from core.errors import ConfigError

__all__ = [
    "ALL_KEYS",
    "BACKBONES",
    "EXTERNAL_BACKBONES",
    "INFERENCE_FLAGS",
    "NORMS",
    "SCHEMA",
    "Config",
    "ConfigError",
    "DataConfig",
    "InferConfig",
    "Key",
    "ModelConfig",
    "TrainConfig",
    "TrainerConfig",
    "add_inference_flags",
    "apply_flags",
    "apply_inference_flags",
    "defaults",
    "derive",
    "external_package_missing",
    "dump",
    "inference_overrides",
    "load_config",
    "parse_override",
    "saved_config",
    "validate",
]
