"""train.temporal_refit_epochs: the run's last epochs train a new temporal head on the backbone as the epochs
before leave it, frozen. A head that learns beside features that move can miss a relation between far events that
a new head on the same features, settled, finds (bench/RESULTS.md, "The head again on the trained backbone"; the
decoupled training of Kang et al., 2020, is the same two steps in one run)."""

from __future__ import annotations

import logging

from core.runtime import unwrap_model
from engine.training.trainer import Trainer
from models import temporal_head_of

log = logging.getLogger("longvideo")


def refit_due(trainer: Trainer) -> bool:
    """Whether the epoch about to start is the first of train.temporal_refit_epochs' (and the refit not begun)."""
    refit = trainer.cfg.train.temporal_refit_epochs
    state = trainer.state
    return bool(refit) and not state.head_refit and state.epoch >= trainer.cfg.trainer.max_epochs - refit


def begin_head_refit(trainer: Trainer) -> None:
    """The backbone frozen as it is, the head built anew (seeded by train.seed, the global random state untouched,
    so a resumed run does the same) and its optimizer state dropped; the schedule starts again by itself
    (optim.build_scheduler)."""
    classifier = unwrap_model(trainer.model)
    classifier.freeze_backbone()
    classifier.new_temporal_head(trainer.cfg.train.seed)
    for parameter in temporal_head_of(classifier).parameters():
        trainer.optimizer.state.pop(parameter, None)
    trainer.state.head_refit = True
    if trainer.runtime.is_main:
        log.info(
            "epoch %d: train.temporal_refit_epochs: the backbone frozen as it is (weights and BatchNorm statistics), "
            "a new temporal head trained on it to epoch %d; best.pt keeps whichever epoch validates best",
            trainer.state.epoch + 1,
            trainer.cfg.trainer.max_epochs,
        )


def resume_head_refit(trainer: Trainer) -> None:
    """A checkpoint from within the refit epochs: its backbone frozen again (its weights are the checkpoint's)."""
    if trainer.state.head_refit:
        unwrap_model(trainer.model).freeze_backbone()
