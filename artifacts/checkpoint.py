"""The checkpoint format: what a training checkpoint holds (``Checkpoint``, ``TrainState``), its atomic save, its
safe load, and the RNG states it carries. Its dict form (what torch.save writes) is written and read here only;
every other module sees a ``Checkpoint``. Where checkpoints live is ``artifacts.run_dir``'s; turning
one into a model for evaluation is ``artifacts.trained_model``'s.

Writes go through ``core.files``: a temporary file in the same directory, flushed and fsynced, then renamed
over the target: a job killed at any moment leaves either the old file or the new one, never a torn file.
Loads use ``torch.load(weights_only=True)``: a checkpoint that needs pickled code is refused (a cron job
must never run code that a file in a shared directory brings).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from config import Config, ConfigError, saved_config
from core.files import atomic_open
from core.runtime import unwrap_model
from core.tensor_files import UnreadableFile, UnsafeFile, load_tensors
from datasets.shape import DataShape
from models.adapters import frozen_fingerprint, frozen_keys

# bumped when the checkpoint dict's layout changes, or when a new key's default would change what an older
# checkpoint computes; an older format is refused (load_checkpoint), never read by guesswork.
# 2: the saved config holds every key that changes the model's output (attention, contrast, norms, ...)
CHECKPOINT_FORMAT = 2
log = logging.getLogger("longvideo")


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, torn, unsafe, or from an incompatible config."""


@dataclass
class TrainState:
    epoch: int = 0  # the epoch being trained (0-based)
    batches_done: int = 0  # micro-batches of this epoch already trained (for a mid-epoch resume)
    global_step: int = 0  # optimizer steps so far
    best_metric: float = -math.inf
    skipped_steps: int = 0
    nonfinite_streak: int = 0
    micro_splits: int = 1  # forward passes per loader batch: doubled after each out-of-memory error
    history: list = field(default_factory=list)
    chunk_train_size: int | None = None  # training chunk length set by the OOM back-off; None = the config's
    kept_chunks: int | None = None  # training chunks whose activations are kept (as the planner decided); None = none
    epoch_loss_sum: float = 0.0  # summed clip losses of this epoch so far: a resumed epoch reports the whole
    epoch_clips: int = 0  # epoch's train_loss, not only the part after the resume
    epoch_auxiliary_sum: float = 0.0  # the auxiliary loss's part of epoch_loss_sum (model.chunk_reconstruction)


# the training state a checkpoint saves, by field name: the non-finite streak starts again at 0 on a resume
SAVED_PROGRESS = tuple(f.name for f in fields(TrainState) if f.name != "nonfinite_streak")


@dataclass
class Checkpoint:
    """A training checkpoint. ``model``: the unwrapped model's state dict; ``config``: the run's config as its YAML
    mapping (``saved_config`` reads it); ``shape``: the data it trained on (classes, camera views, keypoints);
    ``features_source``: a head trained on features, where they came from (the backbone checkpoint's sha256 and
    path, their chunking; or an MS-TCN dataset's name and feature size); ``frozen_weights``: a model with adapters
    saved without its frozen backbone, what loads them again and their
    fingerprint ({"pretrained", "sha256", "tensors"}). Optimizer, scheduler, scaler and RNG states are those of a
    resumable run."""

    model: dict
    config: dict
    class_names: list
    shape: DataShape
    state: TrainState = field(default_factory=TrainState)
    optimizer: dict | None = None
    scheduler: dict | None = None
    scaler: dict | None = None
    rng: dict | None = None
    features_source: dict | None = None
    frozen_weights: dict | None = None

    @classmethod
    def of_training(
        cls, model, optimizer, scheduler, scaler, state: TrainState, cfg: Config, class_names: list, shape: DataShape
    ) -> Checkpoint:
        """A run's checkpoint now: the unwrapped model (less its frozen backbone under model.adapter with weights
        from model.pretrained: what loads them again and their fingerprint instead), optimizer, scheduler and scaler,
        and the RNG states."""
        classifier = unwrap_model(model)
        weights, frozen = classifier.state_dict(), frozen_keys(classifier)
        source = None
        if frozen and cfg.model.pretrained is not None:
            weights = {k: v for k, v in weights.items() if k not in frozen}
            source = {
                "pretrained": cfg.model.pretrained,
                "sha256": frozen_fingerprint(classifier),
                "tensors": len(frozen),
            }
        return cls(
            weights,
            cfg.to_dict(),
            class_names,
            shape,
            state,
            optimizer.state_dict(),
            scheduler.state_dict(),
            scaler.state_dict(),
            rng_state(),
            frozen_weights=source,
        )

    def load_into(self, classifier, path: str) -> None:
        """Its weights into ``classifier`` (unwrapped); one saved without its frozen backbone checks that the
        classifier's (from model.pretrained) are the ones it was trained on. A model that does not fit raises
        RuntimeError, as load_state_dict does."""
        if self.frozen_weights is None:
            classifier.load_state_dict(self.model)
            return
        wanted, spec = self.frozen_weights["sha256"], self.frozen_weights["pretrained"]
        frozen = frozen_keys(classifier)
        actual = frozen_fingerprint(classifier) if frozen else "none (no adapters here)"
        if actual != wanted:
            raise CheckpointError(
                f"{path}: its adapters were trained on a frozen backbone of sha256 {wanted[:12]}... (model.pretrained: "
                f"{spec}), but the weights loaded now are sha256 {actual[:12]}...; give the weights it was trained "
                f"on with --set model.pretrained=..., or train the adapters again on these"
            )
        missing, unexpected = classifier.load_state_dict(self.model, strict=False)
        left_out = set(missing) - frozen
        if unexpected or left_out:
            raise RuntimeError(
                f"Error(s) in loading state_dict: missing {sorted(left_out)[:3]}, unexpected {unexpected[:3]}"
            )

    def to_dict(self) -> dict:
        """The saved form: the training state by field name (``from_dict`` reads it back the same way, so adding
        a field cannot shift the others), the data's shape as three entries."""
        progress = {name: getattr(self.state, name) for name in SAVED_PROGRESS}
        saved = {
            "format": CHECKPOINT_FORMAT,
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            **progress,
            "config": self.config,
            "class_names": self.class_names,
            "rng": self.rng,
            "num_views": self.shape.num_views,
            "view_names": list(self.shape.view_names),
            "kpt_shape": self.shape.kpt_shape,
        }
        if self.features_source is not None:
            saved["features_source"] = self.features_source
        if self.frozen_weights is not None:
            saved["frozen_weights"] = self.frozen_weights
        return saved

    @classmethod
    def from_dict(cls, saved: dict) -> Checkpoint:
        """A loaded dict of the current format (``load_checkpoint`` checks it); the non-finite streak starts again
        at 0."""
        kpt_shape = saved["kpt_shape"]
        shape = DataShape(
            len(saved["class_names"]),
            saved["num_views"],
            tuple(saved["view_names"]),
            None if kpt_shape is None else tuple(kpt_shape),
        )
        return cls(
            saved["model"],
            saved["config"],
            list(saved["class_names"]),
            shape,
            TrainState(**{name: saved[name] for name in SAVED_PROGRESS if name in saved}),
            saved.get("optimizer"),
            saved.get("scheduler"),
            saved.get("scaler"),
            saved.get("rng"),
            saved.get("features_source"),
            saved.get("frozen_weights"),
        )


def changed_settings(saved: dict, cfg: Config) -> dict[str, tuple]:
    """The model.* and train.* keys whose value in ``cfg`` differs from a checkpoint's saved config (read by
    ``saved_config``): {dotted: (then, now)}."""
    then, now = saved_config(saved).to_dict(), cfg.to_dict()
    return {
        f"{section}.{key}": (then[section][key], value)
        for section in ("model", "train")
        for key, value in now[section].items()
        if then[section].get(key) != value
    }


def _settings_as_before(changed: dict[str, tuple], keys) -> str:
    """The --set options that give ``keys`` of ``changed_settings`` their checkpoint's values back."""

    def value(then) -> str:
        return json.dumps(then) if then is None or isinstance(then, (bool, list)) else str(then)

    return " ".join(f"--set {key}={value(changed[key][0])}" for key in keys)


def restore_training(
    path: str, model, optimizer, scheduler, scaler, cfg: Config | None = None
) -> tuple[TrainState, dict]:
    """The training state of a checkpoint (model, optimizer, scheduler and scaler loaded in place) and its RNG
    states. With ``cfg``, settings that differ from the checkpoint's are named: a warning (a resumed run should
    go on as it began: a default changed since, such as the head's warm-up, would change its schedule), or the
    error when the model no longer fits."""
    ckpt = load_checkpoint(path)
    try:
        changed = changed_settings(ckpt.config, cfg) if cfg is not None else {}
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}; it cannot be resumed with this version (eval.py cannot use it either)")
    try:
        ckpt.load_into(unwrap_model(model), path)
    except RuntimeError as e:
        differing = [key for key in changed if key.startswith("model.")]
        settings = ", ".join(differing) or "no model setting differs"
        # every changed setting, not only the model's: a run resumed should go on as it began, in one command
        hint = (
            f"resume with the checkpoint's settings: {_settings_as_before(changed, changed)}"
            if differing
            else "resume with the config it was trained with"
        )
        raise CheckpointError(
            f"{path}: its model does not fit this config's ({settings}); {hint}: {str(e).splitlines()[0]}"
        ) from None
    if changed:
        log.warning(
            "%s: resuming with settings that differ from the checkpoint's (%s); to go on as it began: %s",
            path,
            ", ".join(f"{key} {then!r} then, {now!r} now" for key, (then, now) in changed.items()),
            _settings_as_before(changed, changed),
        )
    saved_groups, groups = len(ckpt.optimizer["param_groups"]), len(optimizer.param_groups)
    if saved_groups != groups:  # a temporal head had groups of its own (its own learning rate) before one rate
        raise CheckpointError(
            f"{path}: its optimizer has {saved_groups} parameter groups, this version's has {groups} (the temporal "
            f"head trained at a rate of its own); it cannot be resumed here, but eval.py and infer_chunked.py use it"
        )
    optimizer.load_state_dict(ckpt.optimizer)
    scheduler.load_state_dict(ckpt.scheduler)
    scaler.load_state_dict(ckpt.scaler)
    state = ckpt.state
    log.info("resumed from %s: epoch %d, step %d", path, state.epoch + 1, state.global_step)
    return state, ckpt.rng


def save_checkpoint(ckpt: Checkpoint, path: str) -> None:
    with atomic_open(path) as f:
        torch.save(ckpt.to_dict(), f)  # straight into the temporary file: no second copy in host memory


def load_checkpoint(path: str, map_location="cpu") -> Checkpoint:
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        saved = load_tensors(path, map_location)
    except UnsafeFile as e:
        raise CheckpointError(
            f"{path}: {e}; only checkpoints of tensors and plain values are loaded "
            f"(weights_only=True): use a checkpoint written by this project's train.py"
        )
    except UnreadableFile as e:
        raise CheckpointError(
            f"{path}: not a readable checkpoint (truncated or corrupt?): {e}; use another "
            f"checkpoint of the run (last.pt, best.pt, epoch_N.pt)"
        )
    if not isinstance(saved, dict) or "model" not in saved:
        raise CheckpointError(f"{path}: not a checkpoint of this project (no 'model' entry)")
    found = saved.get("format", 0)
    if found != CHECKPOINT_FORMAT:
        age = "a newer" if isinstance(found, int) and found > CHECKPOINT_FORMAT else "an older"
        raise CheckpointError(
            f"{path}: checkpoint format {found}, written by {age} version of this project "
            f"(this one reads format {CHECKPOINT_FORMAT}); evaluate or resume it with the version that wrote it, "
            f"or train again with this one"
        )
    missing = [name for name in ("config", "class_names", "num_views", "view_names", "kpt_shape") if name not in saved]
    if missing:
        raise CheckpointError(f"{path}: not a training checkpoint of this project (no '{missing[0]}' entry)")
    return Checkpoint.from_dict(saved)


def rng_state() -> dict:
    numpy_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy_keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_pos": int(numpy_state[2]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
