"""Configs saved with older checkpoints: keys they predate get the behaviour they were trained with."""

from __future__ import annotations

from config.schema import Config, defaults, with_new_names
from config.validation import validate

# keys added since a saved config may have been written, with the value that reproduces what the code did then
# (before data.resize, every frame was stretched to data.img_size)
# model.norm_groups: GroupNorm had gcd(8, channels) groups before the key (the same for 16 channels or more)
# model.temporal_attention: every head of the transformer head attended to every chunk before the key
# model.temporal_input_norm: the head projected the chunk features as they came before the key
# model.temporal_contrast: the head's tokens were its chunks' features alone before the key
# model.temporal_running: the head's tokens had no running sum of the contrast before the key
# model.chunk_reconstruction: no decoder trained beside the backbone before the key
# train.temporal_warmup_epochs: a run with a head warmed up for train.warmup_epochs before the key
_BEFORE_THE_KEY = {
    "data.resize": "stretch",
    "model.norm_groups": 8,
    "model.temporal_attention": "bidirectional",
    "model.temporal_input_norm": False,
    "model.temporal_contrast": False,
    "model.temporal_running": False,
    "model.chunk_reconstruction": 0.0,
    "train.temporal_warmup_epochs": 0.0,
}


def _tcn_dropout_then(saved: dict) -> float:
    """model.temporal_tcn_dropout before the key: the tcn took MS-TCN's 0.5 while model.temporal_dropout was at
    its default (0.1), else model.temporal_dropout."""
    dropout = saved.get("model", {}).get("temporal_dropout", 0.1)
    return 0.5 if dropout == 0.1 else dropout


_DERIVED_BEFORE_THE_KEY = {"model.temporal_tcn_dropout": _tcn_dropout_then}  # key: the saved config -> its value


def saved_config(cfg: dict) -> Config:
    """A config saved with a checkpoint, validated; keys it predates get the behaviour it was trained with (or
    the default), so an older checkpoint evaluates as it was trained."""
    cfg = with_new_names(cfg)
    full = defaults()
    then = {**_BEFORE_THE_KEY, **{dotted: value_of(cfg) for dotted, value_of in _DERIVED_BEFORE_THE_KEY.items()}}
    for dotted, value in then.items():
        section, key = dotted.split(".")
        if key not in cfg.get(section, {}):
            full[section][key] = value
    for section, values in cfg.items():
        if isinstance(values, dict) and isinstance(full.get(section), dict):
            full[section].update(values)
        else:
            full[section] = values
    return Config.from_dict(validate(full))
