"""A temporal head whose validation stays at chance: one warning a run for each of the two ways it fails (not
learning, or fitting the training clips only), with the settings that help each."""

from __future__ import annotations

import logging
import math

from engine.training.optim import max_grad_norm, warmup_epochs
from engine.training.trainer import Trainer

log = logging.getLogger("longvideo")

HEAD_AT_CHANCE_VALIDATIONS = 3  # validations in a row at chance before a run with a temporal head says so


def warn_if_head_at_chance(trainer: Trainer) -> None:
    """A temporal head whose validation accuracy has stayed at chance for the last HEAD_AT_CHANCE_VALIDATIONS
    validations (within 1 / classes + two standard errors of a guess over that many clips, 0.05 at least: 48 clips
    of 2 classes at 0.58 are a coin's luck): a warning with the switches that help. Two cases, told apart by the
    label's training loss (an auxiliary loss's part left out) and each said once a run (bench/RESULTS.md,
    "Long-range tasks"): near chance's loss (ln classes), the head is not learning, which a slower head fixed; under
    half of it, the head fits the training clips but not the validation ones, which no learning rate fixed, and more
    training videos or fewer, longer chunks did (and, for a relation between events told apart by colour, the chunk
    reconstruction, named where it can apply; for a head that does not learn beside a backbone that trains, a new
    head on that backbone, frozen; over a backbone that does not train, the event contrast). A transformer head with
    bidirectional attention is told to make it directional first, and one without its contrast to turn it on first
    (docs/long-videos.md has the measurements behind each advice)."""
    if not trainer.has_temporal_head or not trainer.runtime.is_main:
        return
    chance = 1.0 / len(trainer.class_names)
    # a timeline (dense chunk labels) is judged by its frames; a clip's one label is then only its majority's
    dense = trainer.cfg.train.chunk_loss == "dense"
    accuracy = "val_seg_frame_acc" if dense else "val_clip_acc"
    rows = [row for row in trainer.state.history if accuracy in row][-HEAD_AT_CHANCE_VALIDATIONS:]
    if len(rows) < HEAD_AT_CHANCE_VALIDATIONS:
        return
    clips = None if dense else rows[-1].get("val_num_clips")
    margin = 0.05 if not clips else max(0.05, 2 * math.sqrt(chance * (1 - chance) / clips))
    if max(row[accuracy] for row in rows) > chance + margin:
        return
    train_cfg, said = trainer.cfg.train, trainer.report.head_at_chance_said
    at_chance = (
        f"epoch {trainer.state.epoch}: validation {'frame ' if dense else ''}accuracy has stayed at chance "
        f"({chance:.3f}) for "
        f"{len(rows)} validations with the temporal head on"
    )
    # the label's loss alone: an auxiliary loss beside it (the chunk reconstruction's) says nothing of the label
    train_loss = rows[-1].get("train_label_loss", rows[-1].get("train_loss"))
    chance_loss = math.log(len(trainer.class_names))
    kind = "fitting" if train_loss is not None and train_loss < 0.5 * chance_loss else "not learning"
    if kind in said:
        return
    said.add(kind)
    model_cfg = trainer.cfg.model
    # a backbone that trains in this run (not frozen, not features read from disk): only its features can still change
    backbone_trains = (
        trainer.cfg.data.features_dir is None and not model_cfg.freeze_backbone and not trainer.state.head_refit
    )
    # a bidirectional encoder starts nearly blind to order, and tokens without their contrast differ little where
    # most chunks look alike: the first switches (docs/long-videos.md has the measurements)
    transformer = model_cfg.temporal_head == "transformer"
    first = [
        switch
        for switch, wanted in (
            (
                "model.temporal_attention: directional (now bidirectional)",
                transformer and model_cfg.temporal_attention == "bidirectional",
            ),
            ("model.temporal_contrast: true (now false)", transformer and not model_cfg.temporal_contrast),
        )
        if wanted
    ]
    first_switches = (
        f"first set {' and '.join(first)} (docs/long-videos.md, Temporal context across chunks); " if first else ""
    )
    if kind == "fitting":
        # a head on features (data.features_dir) has the chunks infer_chunked.py --features wrote them with
        chunking = (
            "infer_chunked.py --features --chunk"
            if trainer.cfg.data.features_dir is not None
            else f"train.chunk_train_size, now {train_cfg.chunk_train_size}"
        )
        # a relation between far events fitted this way until the backbone was made to keep the events' colours
        # apart (bench/RESULTS.md, "The chunk reconstruction"); only a backbone that trains here can be
        reconstruction = (
            "; a label that relates far events told apart by colour (did the end match the start) also needs "
            "model.chunk_reconstruction: 1.0 (configs/long-range-relations.yaml)"
            if model_cfg.chunk_reconstruction == 0 and backbone_trains
            else ""
        )
        log.warning(
            "%s while the label's training loss fell to %.3f (chance: %.3f): it fits the training clips, not the "
            "task; %sgive it more training videos, or fewer, longer chunks (%s); model.temporal_head: none "
            "shows what the chunks alone give%s",
            at_chance,
            train_loss,
            chance_loss,
            first_switches,
            chunking,
            reconstruction,
        )
        return
    max_norm = max_grad_norm(train_cfg, True)
    # a relation between far events stayed at chance end to end while the backbone's features told the events
    # apart, and a new head on those features, frozen, learnt it (bench/RESULTS.md, "The head again on the trained
    # backbone"); only a backbone that trains here, without adapters (a new head would drop them), gives such a run
    again = (
        "; once the backbone tells the events apart, a new head on this run's last backbone, frozen, can find "
        "what this one misses beside features that move (model.pretrained: this run's last.pt, "
        "model.freeze_backbone: true; or in one run, train.temporal_refit_epochs; docs/long-videos.md)"
        if backbone_trains and model_cfg.adapter == "none"
        else ""
    )
    # over fixed features where each event's kind lies close beside the step every event shares, a relation stayed
    # at chance until the head was given the events' differences from their mean (bench/RESULTS.md, "Kinds of event
    # close together"); where the backbone trains, the event contrast did not help
    events = (
        "; a label that relates far events whose kinds differ little beside how far any event lies from the rest "
        "(two directions of one movement): try model.temporal_event_contrast: true"
        if transformer and not model_cfg.temporal_event_contrast and not backbone_trains
        else ""
    )
    log.warning(
        "%s; %sa head that does not learn usually trains too fast: lower train.temporal_lr_scale (now %g) "
        "or train.lr (now %g), lengthen train.temporal_warmup_epochs (now %g), set train.temporal_grad_clip "
        "(now %s), or narrow model.temporal_width (now %d); "
        "model.temporal_head: none shows what the chunks alone give%s%s",
        at_chance,
        first_switches,
        train_cfg.temporal_lr_scale,
        train_cfg.lr,
        warmup_epochs(train_cfg, True),
        "off" if max_norm is None else f"{max_norm:g}",
        model_cfg.temporal_width,
        again,
        events,
    )
