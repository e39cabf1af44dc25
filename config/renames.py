"""Keys and choices that were renamed: a preset or --set with an old name works, with a one-line notice naming the
new one; a checkpoint's saved config is read under the new names silently."""

from __future__ import annotations

import logging

from core.errors import ConfigError

log = logging.getLogger("longvideo")

# Renamed keys, old name -> new: the old name keeps working (a preset or --set with a one-line notice, a
# checkpoint's saved config silently). "chunk" is the window of one forward pass; a sample window was once called a
# chunk too; model.temporal_head is a kind of head, model.temporal_attention_heads a count; a window is a frame
# range, so the count of chunks a head sees at once is infer.head_chunks; the inference chunk's
# keys lived in the train section, where training has keys of its own (train.chunk_train_size, ...).
RENAMED_KEYS = {
    "data.video_chunk_overlap": "data.sample_window_overlap",
    "infer.head_window": "infer.head_chunks",
    "model.temporal_heads": "model.temporal_attention_heads",
    "model.temporal_window": "infer.head_chunks",
    "train.chunk_infer_size": "infer.chunk_size",
    "train.chunk_overlap": "infer.chunk_overlap",
    "train.chunk_aggregation": "infer.chunk_aggregation",
    "train.video_batch_size": "infer.chunks_per_forward",
}
# Renamed choices, key -> {old value: new}, kept working as old keys are: overlap is the frames windows share
RENAMED_VALUES = {"train.ddp_sync": {"overlap": "during_backward"}}


def with_new_names(data: dict, source: str | None = None) -> dict:
    """``data`` (a config's sections) with each renamed key under its new name, in its new section, and each
    renamed choice under its new value; with ``source`` (a file or a --set), each old name found is said once,
    naming the new one."""
    for old, new in RENAMED_KEYS.items():
        old_section, old_key = old.split(".")
        values = data.get(old_section)
        if not isinstance(values, dict) or old_key not in values:
            continue
        new_section, new_key = new.split(".")
        target = data.get(new_section) if new_section != old_section else values
        target = target if isinstance(target, dict) else {}
        if new_key in target:
            raise ConfigError(f"{source or 'a saved config'}: {old} and {new} are the same key (renamed); keep {new}")
        if new_section == old_section:  # in place, so the section keeps its order
            data = {**data, old_section: {(new_key if k == old_key else k): v for k, v in values.items()}}
        else:
            data = {
                **data,
                old_section: {k: v for k, v in values.items() if k != old_key},
                new_section: {**target, new_key: values[old_key]},
            }
        if source is not None:
            log.warning("%s: %s is now called %s (the old name still works)", source, old, new)
    for key, names in RENAMED_VALUES.items():
        section, name = key.split(".")
        values = data.get(section)
        old = values.get(name) if isinstance(values, dict) else None
        if isinstance(old, str) and old in names:
            data = {**data, section: {**values, name: names[old]}}
            if source is not None:
                log.warning("%s: %s: %s is now called %s (the old value still works)", source, key, old, names[old])
    return data
