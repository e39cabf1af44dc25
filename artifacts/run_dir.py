"""Where a run's files live: the one owner of every path under ``runs/`` (timm's ``CheckpointSaver`` is the model).

    runs/<experiment>/                  ExperimentDirectory
        latest -> <timestamp>           the newest run that has saved a checkpoint
        <timestamp>/                    RunDirectory
            config.yaml  train.log  metrics.csv  memory.csv  training_curves.png  confusion_matrix.png
            checkpoints/last.pt  best.pt  epoch_NNNN.pt     (best and epoch files: hard links to a last.pt)
            checkpoints/<name>.bank.npz                      train.feature_bank: the bank as its checkpoint left it
            feature_bank.npy                                 train.feature_bank: disk, the live bank
        eval.jsonl  .eval.lock  eval_history.png            WatchedDirectory (also of one run)

Nobody else joins path strings under a run directory.
"""

from __future__ import annotations

import glob
import logging
import os
import time

from artifacts.checkpoint import Checkpoint, save_checkpoint
from config import Config
from core.errors import ConfigError, UsageError
from core.files import atomic_link, atomic_symlink

log = logging.getLogger("longvideo")
CHECKPOINTS = "checkpoints"
LATEST = "latest"
CHECKPOINT_SIDECARS = (".bank.npz",)  # files beside a checkpoint that belong to its state: linked and removed with it


def sidecar(checkpoint: str, suffix: str) -> str:
    """checkpoints/last.pt -> checkpoints/last<suffix>."""
    return os.path.splitext(checkpoint)[0] + suffix


class RunDirectory:
    """One training run: its files and its checkpoints."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls, experiment: "ExperimentDirectory") -> "RunDirectory":
        """runs/<experiment>/<timestamp>/checkpoints, a new directory. ``latest`` moves to it with its first
        checkpoint (``save``): a run killed before saving anything never becomes the latest."""
        path = os.path.join(experiment.path, time.strftime("%Y%m%d-%H%M%S"))
        suffix = 1
        while os.path.exists(path):
            path = os.path.join(experiment.path, time.strftime("%Y%m%d-%H%M%S") + f"-{suffix}")
            suffix += 1
        os.makedirs(os.path.join(path, CHECKPOINTS))
        return cls(path)

    @classmethod
    def of_checkpoint(cls, checkpoint: str) -> "RunDirectory | None":
        """The run a checkpoint belongs to (``<run>/checkpoints/`` beside a ``config.yaml``), else None."""
        folder = os.path.dirname(os.path.realpath(checkpoint))
        run = cls(os.path.dirname(folder))
        if os.path.basename(folder) != CHECKPOINTS or not os.path.isfile(run.config_yaml):
            return None
        return run

    def __str__(self) -> str:
        return self.path

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    config_yaml = property(lambda self: self.file("config.yaml"))
    train_log = property(lambda self: self.file("train.log"))
    metrics_csv = property(lambda self: self.file("metrics.csv"))
    memory_csv = property(lambda self: self.file("memory.csv"))
    curves_png = property(lambda self: self.file("training_curves.png"))
    confusion_png = property(lambda self: self.file("confusion_matrix.png"))
    memory_snapshot = property(lambda self: self.file("memory_snapshot.pickle"))  # trainer.memory_snapshot
    tensorboard = property(lambda self: self.file("tb"))  # trainer.tensorboard
    checkpoints = property(lambda self: self.file(CHECKPOINTS))
    feature_bank = property(lambda self: self.file("feature_bank.npy"))  # train.feature_bank: disk

    def checkpoint(self, name: str) -> str:
        return os.path.join(self.checkpoints, name)

    def save(self, ckpt: Checkpoint, name: str = "last.pt") -> str:
        """``checkpoints/<name>`` written atomically, then ``latest`` points here (only a run with a checkpoint
        becomes the latest)."""
        path = self.checkpoint(name)
        save_checkpoint(ckpt, path)
        self.point_latest_here()
        return path

    def point_latest_here(self) -> None:
        """runs/<experiment>/latest -> this run, replaced atomically (readers see the old or the new run)."""
        real = os.path.realpath(self.path)  # a run resumed through the "latest" link itself
        atomic_symlink(os.path.basename(real), os.path.join(os.path.dirname(real), LATEST))

    def link_epoch(self, epoch: int, improved: bool, keep_last_k: int) -> None:
        """best.pt (when the monitored metric improved) and epoch_NNNN.pt as links to the last.pt just written:
        the state is serialized once an epoch, not up to three times. The oldest epoch files beyond keep_last_k
        go."""
        last = self.checkpoint("last.pt")
        if improved:
            self._link_sidecars(last, self.checkpoint("best.pt"))
            atomic_link(last, self.checkpoint("best.pt"))
        if keep_last_k > 0:
            atomic_link(last, self.checkpoint(f"epoch_{epoch:04d}.pt"))
            self._link_sidecars(last, self.checkpoint(f"epoch_{epoch:04d}.pt"))
            epochs = sorted(n for n in os.listdir(self.checkpoints) if n.startswith("epoch_") and n.endswith(".pt"))
            for name in epochs[:-keep_last_k]:
                os.unlink(self.checkpoint(name))
                for suffix in CHECKPOINT_SIDECARS:
                    if os.path.exists(sidecar(self.checkpoint(name), suffix)):
                        os.unlink(sidecar(self.checkpoint(name), suffix))

    @staticmethod
    def _link_sidecars(source: str, target: str) -> None:
        for suffix in CHECKPOINT_SIDECARS:
            if os.path.exists(sidecar(source, suffix)):
                atomic_link(sidecar(source, suffix), sidecar(target, suffix))


class ExperimentDirectory:
    """runs/<experiment>: its runs and the ``latest`` link."""

    def __init__(self, output_dir: str, experiment: str):
        self.path, self.experiment = os.path.join(output_dir, experiment), experiment

    @classmethod
    def of_config(cls, cfg: Config) -> "ExperimentDirectory":
        return cls(cfg.trainer.output_dir, cfg.experiment)

    @property
    def latest(self) -> RunDirectory:
        return RunDirectory(os.path.join(self.path, LATEST))

    def resume_checkpoint(self) -> str:
        """``--resume auto``: last.pt of the latest run; an error when there is none."""
        path = self.latest.checkpoint("last.pt")
        if not os.path.exists(path):
            raise UsageError(
                f"--resume auto: no {path} to continue from; start without --resume, or give a checkpoint path"
            )
        return path

    def latest_best(self, why: str) -> str:
        """best.pt of the latest run; an error naming ``why`` (the flag that chose this experiment) if none."""
        path = self.latest.checkpoint("best.pt")
        if not os.path.exists(path):
            raise ConfigError(
                f"{why}: no {path} (experiment '{self.experiment}' has no trained run here); train "
                f"it first or pass --checkpoint PATH"
            )
        return path


def most_recent_best(runs_root: str) -> str:
    """The most recently written best.pt of any experiment under ``runs_root`` (the last one trained)."""
    candidates = glob.glob(os.path.join(runs_root, "*", "*", CHECKPOINTS, "best.pt"))
    if not candidates:
        raise ConfigError(
            f"no --checkpoint given and no {runs_root}/<experiment>/<run>/checkpoints/best.pt found; "
            f"train first or pass --checkpoint PATH"
        )
    return max(candidates, key=os.path.getmtime)


def resolve_resume(resume: str, cfg: Config, restart: int | None = None) -> str | None:
    """--resume auto|PATH: the checkpoint to continue from. Under torchrun (``restart``: its attempt, 0 for the
    first) ``auto`` is the one command of every attempt: the first starts a new run when the experiment has no
    last.pt, every restart continues it; a restart that finds none is an error, never a silent new run."""
    if resume == "auto":
        experiment = ExperimentDirectory.of_config(cfg)
        if restart is None:
            return experiment.resume_checkpoint()
        path = experiment.latest.checkpoint("last.pt")
        if os.path.exists(path):
            return path
        if restart == 0:
            log.info(
                "--resume auto under torchrun: no %s yet, so a new run starts; torchrun's restarts continue it", path
            )
            return None
        raise UsageError(
            f"--resume auto: torchrun's restart {restart} found no {path} to continue from (the group stopped before "
            f"its first last.pt; train.checkpoint_every_steps writes one every N steps); start the command again "
            f"without --max-restarts, or give a checkpoint path"
        )
    if not os.path.exists(resume):
        raise UsageError(f"--resume {resume}: checkpoint not found")
    return resume


class WatchedDirectory:
    """What ``eval.py --watch`` reads and writes in an experiment directory or one run's."""

    def __init__(self, path: str):
        self.path = path

    ledger = property(lambda self: os.path.join(self.path, "eval.jsonl"))
    lock = property(lambda self: os.path.join(self.path, ".eval.lock"))
    history_png = property(lambda self: os.path.join(self.path, "eval_history.png"))

    def checkpoints(self) -> list[str]:
        """Checkpoints of one run or of every run of an experiment, oldest first (the ``latest`` link not
        twice)."""
        paths = {}
        for pattern in (f"{CHECKPOINTS}/*.pt", f"*/{CHECKPOINTS}/*.pt"):
            for path in glob.glob(os.path.join(self.path, pattern)):  # glob skips dot-files: no .tmp files
                paths.setdefault(os.path.realpath(path), path)
        return sorted(paths, key=lambda p: os.stat(p).st_mtime_ns)
