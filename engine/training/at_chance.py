"""A run whose validation stays at chance says so once, with where to read what helps."""

from __future__ import annotations

import logging
import math

from engine.training.run import TrainingRun

log = logging.getLogger("longvideo")

AT_CHANCE_VALIDATIONS = 3  # validations in a row at chance before a run says so


def warn_if_at_chance(run: TrainingRun) -> None:
    """A temporal head's validation accuracy at chance for the last AT_CHANCE_VALIDATIONS validations (within
    1 / classes + two standard errors of a guess over that many clips, 0.05 at least: 48 clips of 2 classes at 0.58
    are a coin's luck): one warning a run, which tells a head that does not learn (the label's training loss near
    chance's, ln classes) from one that fits the training clips only, and points to the docs."""
    if not run.has_temporal_head or not run.runtime.is_main or run.report.at_chance_said:
        return
    chance = 1.0 / len(run.class_names)
    # a timeline (dense chunk labels) is judged by its frames; a clip's one label is then only its majority's
    dense = run.cfg.train.chunk_loss == "dense"
    accuracy = "val_seg_frame_acc" if dense else "val_clip_acc"
    rows = [row for row in run.state.history if accuracy in row][-AT_CHANCE_VALIDATIONS:]
    if len(rows) < AT_CHANCE_VALIDATIONS:
        return
    clips = None if dense else rows[-1].get("val_num_clips")
    margin = 0.05 if not clips else max(0.05, 2 * math.sqrt(chance * (1 - chance) / clips))
    if max(row[accuracy] for row in rows) > chance + margin:
        return
    run.report.at_chance_said = True
    # the label's loss alone: an auxiliary loss beside it (the chunk reconstruction's) says nothing of the label
    train_loss = rows[-1].get("train_label_loss", rows[-1].get("train_loss"))
    chance_loss = math.log(len(run.class_names))
    fits = train_loss is not None and train_loss < 0.5 * chance_loss
    log.warning(
        "epoch %d: validation %saccuracy has stayed at chance (%.3f) for %d validations with the temporal head on, "
        "while the label's training loss is %.3f (chance: %.3f): %s; docs/long-videos.md, \"When the head does not "
        'learn", says what to try',
        run.state.epoch,
        "frame " if dense else "",
        chance,
        len(rows),
        train_loss if train_loss is not None else float("nan"),
        chance_loss,
        "it fits the training clips, not the task" if fits else "the head is not learning",
    )
