"""What became of old keys: renamed keys and choices keep working under their new names (a preset or --set with an old
name says so in one line; a checkpoint's saved config is read silently), and removed keys are one line naming what
replaced them."""

from __future__ import annotations

import logging

from core.errors import ConfigError

log = logging.getLogger("longvideo")

# Renamed keys, old name -> new: the old name keeps working (a preset or --set with a one-line notice, a
# checkpoint's saved config silently). "chunk" is the window of one forward pass; a sample window was once called a
# chunk too; model.temporal_head is a kind of head; the count of chunks a head sees at once is infer.head_chunks;
# the inference chunk's keys lived in the train section, where training has keys of its own; "checkpoint" names
# saved files only; train holds what the loop does (its epochs), trainer where it runs and what it reports.
RENAMED_KEYS = {
    "data.video_chunk_overlap": "data.sample_window_overlap",
    "infer.head_window": "infer.head_chunks",
    "model.temporal_window": "infer.head_chunks",
    "model.grad_checkpointing": "model.recompute_blocks",
    "train.chunk_infer_size": "infer.chunk_size",
    "train.chunk_overlap": "infer.chunk_overlap",
    "train.chunk_aggregation": "infer.chunk_aggregation",
    "train.video_batch_size": "infer.chunks_per_forward",
    "train.log_every": "trainer.log_every",
    "trainer.max_epochs": "train.max_epochs",
    "trainer.check_val_every_n_epoch": "train.check_val_every_n_epoch",
}
# Renamed choices, key -> {old value: new}, kept working as old keys are: overlap is the frames windows share
RENAMED_VALUES = {"train.ddp_sync": {"overlap": "during_backward"}}

# Removed keys, name -> (the value every run now has, what became of it). A preset or --set that gives that value
# is said once and goes on; another value stops with the same words, since nothing would do what it asks.
REMOVED_KEYS = {
    "model.adapter_width": (64, "the block and side adapters' bottleneck is 64 wide"),
    "model.adapter_rank": (8, "LoRA's updates have rank 8"),
    "model.adapter_kernel": (3, "the adapters' temporal convolution spans 3 tokens"),
    "model.adapter_taps": (4, "side adapters read 4 blocks"),
    "model.fusion": ("concat", "RGB and keypoint features are concatenated"),
    "model.dropout": (0.0, "the classifier has no dropout"),
    "model.norm_groups": (32, "model.norm: group uses 32 groups a layer"),
    "model.norm_frozen_affine": (False, "model.norm: frozen trains the BatchNorm scale and shift"),
    "model.temporal_width": (64, "the temporal head's tokens are 64 wide"),
    "model.temporal_layers": (2, "the transformer head has 2 layers"),
    "model.temporal_heads": (4, "the temporal head has 4 attention heads"),
    "model.temporal_attention_heads": (4, "the temporal head has 4 attention heads"),
    "model.temporal_stages": (4, "the tcn head has MS-TCN's 4 stages"),
    "model.temporal_tcn_layers": (10, "the tcn head has MS-TCN's 10 layers a stage"),
    "model.temporal_tcn_dropout": (0.5, "the tcn head has MS-TCN's dropout of 0.5"),
    "model.temporal_dropout": (0.0, "the attention and transformer heads have no dropout"),
    "model.temporal_attention": ("directional", "the transformer head's attention is directional"),
    "model.temporal_input_norm": (True, "the transformer head always normalizes each chunk's features"),
    "model.temporal_contrast": (True, "the transformer head always sees each chunk's contrast"),
    "model.temporal_running": (True, "the transformer head always sees the running sum of the contrast"),
    "model.temporal_event_contrast": (False, "the event contrast is gone"),
    "model.temporal_head_init": (None, "a head no longer starts from another checkpoint's head"),
    "model.chunk_reconstruction_target": ("colour", "the chunk reconstruction predicts the chunks' colours"),
    "model.chunk_discrimination": (0.0, "the chunk discrimination is gone"),
    "model.chunk_discrimination_temperature": (0.2, "the chunk discrimination is gone"),
    "data.crop_scale": ([0.35, 1.0], "the random crop covers 35-100% of the frame"),
    "data.crop_ratio": ([0.75, 1.3333], "the random crop's aspect ratio is 3/4-4/3 of data.img_size's"),
    "data.prefetch_factor": (2, "each loader worker loads 2 batches ahead"),
    "data.pin_memory": (True, "batches are page-locked on CUDA"),
    "data.index_cache": (None, "the video index is <trainer.output_dir>/.video_index.json"),
    "data.autorotate": (True, "frames are always shown as a viewer sees them (display rotation applied)"),
    "data.prepared_gop": (16, "a prepared copy has a keyframe every 16 frames"),
    "data.prepared_crf": (18, "a prepared copy is x264 at quality 18"),
    "train.momentum": (0.9, "SGD's momentum is 0.9"),
    "train.recompute": ("auto", "training chunks are kept as far as the memory budget allows, the rest recomputed"),
    "train.temporal_lr_scale": (1.0, "the temporal head trains at train.lr"),
    "train.temporal_refit_epochs": (0, "the head refit is gone"),
    "train.label_smoothing": (0.0, "the loss has no label smoothing"),
    "train.checkpoint_frozen_weights": (
        False,
        "an adapted model's checkpoints hold the adapters, not the frozen weights",
    ),
    "trainer.allow_tf32": (True, "TF32 is always allowed on Ampere and newer"),
    "trainer.max_nonfinite_steps": (20, "20 non-finite losses in a row stop the run"),
    "trainer.leak_check_epochs": (3, "the leak warning watches 3 epochs"),
    "trainer.leak_tolerance_mb": (256.0, "the leak warning fires past 256 MB of growth"),
}


def with_new_names(data: dict, source: str | None = None) -> dict:
    """``data`` (a config's sections) with each renamed key under its new name, in its new section, each renamed
    choice under its new value, and each removed key dropped; with ``source`` (a file or a --set), each old name
    found is said once, naming the new one."""
    data = _without_removed(data, source)
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


def _without_removed(data: dict, source: str | None) -> dict:
    """``data`` without its removed keys: one that asks for what every run now does is said (``source``: a file or
    a --set; a checkpoint's config, None, silently); one that asks for something else is a ConfigError."""
    for dotted, (value, what) in REMOVED_KEYS.items():
        section, key = dotted.split(".")
        values = data.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        given = values[key]
        same = given == value or (isinstance(value, float) and isinstance(given, (int, float)) and given == value)
        if not same and source is None:  # a checkpoint's: its model or its run no longer exists here
            raise ConfigError(f"trained with {dotted}: {given!r}, a setting this version no longer has ({what})")
        if not same:
            raise ConfigError(
                f"{source}: {dotted} was removed ({what}), so {dotted}: {given!r} cannot be honoured; remove the key"
            )
        if source is not None:
            log.warning("%s: %s was removed (%s); the key can go", source, dotted, what)
        data = {**data, section: {k: v for k, v in values.items() if k != key}}
    return data
