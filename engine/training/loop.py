"""The training loop: ``fit`` runs epochs of ``train_one_epoch`` and the shared ``evaluate``, each returning a
dict of plain floats. ``build.build_trainer`` wires data, model, optimizer, schedule and run directory; the step
itself (forward, backward, accumulation) is ``step``'s, the OOM back-off ``oom``'s, Ctrl-C ``interrupt``'s (the
modules of engine/training/ beside this one).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from artifacts.checkpoint import restore_rng_state
from artifacts.csv_log import CsvLog
from artifacts.plots import training_plots
from config import TrainerConfig
from core import memory_monitor, watchdog
from engine.data.loaders import GuardedBatches
from engine.evaluation.evaluate import evaluate
from engine.metrics.segments import background_indices
from engine.training.at_chance import warn_if_head_at_chance
from engine.training.interrupt import next_batch, stop_if_asked
from engine.training.precise_bn import precise_bn_before_validation
from engine.training.refit import begin_head_refit, refit_due
from engine.training.step import BatchLoss, clips_per_forward, optimizer_step, train_batch
from engine.training.trainer import NonFiniteLossError, RunStopped, Trainer

log = logging.getLogger("longvideo")
PROGRESS_EVERY_S = 60.0


def train_one_epoch(trainer: Trainer, loader: DataLoader) -> dict:
    state, runtime = trainer.state, trainer.runtime
    accumulate = trainer.cfg.train.accumulate_grad_batches
    trainer.model.train()
    num_batches = len(loader) + state.batches_done
    iterator = _iterate_resumed(trainer, loader)
    totals = {"clips": 0, "data_time": 0.0}  # of this call (speed); the epoch's loss is kept in the state
    start = time.perf_counter()
    progress = tqdm(
        total=num_batches,
        initial=state.batches_done,
        desc=f"epoch {state.epoch + 1}",
        disable=not (runtime.is_main and sys.stderr.isatty()),
        leave=False,
    )
    trainer.optimizer.zero_grad(set_to_none=True)
    group_start = state.batches_done - state.batches_done % accumulate
    group: list[dict] = []  # the loader batches of this accumulation group, kept to replay it after an OOM
    mid_epoch_memory = None  # for the leak check: returned, popped by fit()
    for batch_index in range(state.batches_done, num_batches):
        tick = time.perf_counter()
        batch = next_batch(iterator)
        totals["data_time"] += time.perf_counter() - tick
        if trainer.report.bad_inputs is not None:
            trainer.report.bad_inputs.take(batch)
        group_size = min(accumulate, num_batches - group_start)
        need_update = batch_index + 1 == group_start + group_size
        group.append(batch)
        with watchdog.warming_up():  # the first steps may compile and search algorithms: not a stall
            batch_loss = train_batch(trainer, group, group_size, need_update)
        if batch_index == num_batches // 2:  # the same point of every epoch, workers alive: for the leak check
            mid_epoch_memory = memory_monitor.snapshot(runtime.device)
        totals["clips"] += _count_loss(trainer, batch_loss)
        if need_update:
            with watchdog.warming_up():
                optimizer_step(trainer)
            group_start, group = batch_index + 1, []
        watchdog.beat(state.global_step)
        state.batches_done = batch_index + 1
        progress.update(1)
        _stop_after_nonfinite_losses(trainer)
        if need_update:
            _after_step(trainer, totals, start, progress)
            if trainer.stop_after_steps and state.global_step >= trainer.stop_after_steps:
                break
    progress.close()
    elapsed = time.perf_counter() - start
    if trainer.report.bad_inputs is not None:
        trainer.report.bad_inputs.end_epoch(state.epoch + 1)
    counted = max(state.epoch_clips, 1)
    # with an auxiliary loss, the label's alone too: it is what tells a head that fits from one that does not learn
    label_loss = {"train_label_loss": (state.epoch_loss_sum - state.epoch_auxiliary_sum) / counted}
    return {
        "train_loss": state.epoch_loss_sum / counted,
        **(label_loss if trainer.has_auxiliary_loss else {}),
        "train_clips_per_s": totals["clips"] / elapsed,
        "data_time_share": totals["data_time"] / elapsed,
        "lr": trainer.scheduler.get_last_lr()[0],
        "skipped_steps": state.skipped_steps,
        "clips_per_forward": clips_per_forward(trainer),
        "chunk_train_size": trainer.chunk_spec().size,
        "memory": mid_epoch_memory,
    }


def _iterate_resumed(trainer: Trainer, loader: DataLoader):
    """iter(loader), with a resumed run's RNG state restored where the uninterrupted run had it: the state saved
    at an epoch's end is the one the next epoch's iter(loader) drew its worker seed from, so it is restored
    before that draw; one saved mid-epoch was taken after it."""
    pending, trainer.pending_rng = trainer.pending_rng, None
    if pending is not None and trainer.state.batches_done == 0:
        restore_rng_state(pending)
        pending = None
    iterator = GuardedBatches(loader, trainer.report.bad_inputs)  # iter(loader), with the sample deadline
    if pending is not None:
        restore_rng_state(pending)
    return iterator


def _count_loss(trainer: Trainer, batch_loss: BatchLoss) -> int:
    """A batch's loss into the epoch's, non-finite ones counted in a row; returns the clips counted."""
    state = trainer.state
    if math.isfinite(batch_loss.total):
        state.nonfinite_streak = 0
        state.epoch_loss_sum += batch_loss.total
        state.epoch_auxiliary_sum += batch_loss.auxiliary
        state.epoch_clips += batch_loss.clips
        return batch_loss.clips
    state.nonfinite_streak += 1
    return 0


def _stop_after_nonfinite_losses(trainer: Trainer) -> None:
    """trainer.max_nonfinite_steps non-finite losses in a row stop the run (saved_on_stop saves last.pt)."""
    state = trainer.state
    if state.nonfinite_streak >= trainer.cfg.trainer.max_nonfinite_steps:
        raise NonFiniteLossError(
            f"{state.nonfinite_streak} consecutive non-finite losses at step {state.global_step}",
            "Lower train.lr, use trainer.precision: bf16 or 32 instead of 16, or set train.grad_clip",
        )


def _after_step(trainer: Trainer, totals: dict, start: float, progress) -> None:
    state, train_cfg, runtime = trainer.state, trainer.cfg.train, trainer.runtime
    every = train_cfg.checkpoint_every_steps
    if every and state.global_step % every == 0:
        trainer.save("last.pt")
    due = (
        state.global_step % train_cfg.log_every == 0
        # a line a minute at least, for nohup and cron logs
        or time.time() - trainer.report.last_progress >= PROGRESS_EVERY_S
    )
    if due and runtime.is_main:
        trainer.report.last_progress = time.time()
        snap = memory_monitor.snapshot(runtime.device)
        elapsed = time.perf_counter() - start
        loss = state.epoch_loss_sum / max(state.epoch_clips, 1)
        progress.set_postfix_str(f"loss {loss:.3f} {memory_monitor.compact(snap)}")
        log.info(
            "epoch %d step %d (%d/%d) loss %.4f lr %.2e clips/s %.1f data %.0f%% %s",
            state.epoch + 1,
            state.global_step,
            state.batches_done,
            progress.total,
            loss,
            trainer.scheduler.get_last_lr()[0],
            totals["clips"] / elapsed,
            100 * totals["data_time"] / elapsed,
            memory_monitor.compact(snap),
        )
        if trainer.report.memory_log is not None:
            trainer.report.memory_log.write({"epoch": state.epoch + 1, "step": state.global_step, **snap})


@contextlib.contextmanager
def saved_on_stop(trainer: Trainer, resume_command: str = "--resume auto"):
    """The one place a run that ends abnormally saves last.pt: a ``RunStopped`` (an OOM nothing could fit, a row
    of non-finite losses) leaves with the checkpoint named in its message; Ctrl-C saves at the last optimizer
    step (the unfinished accumulation group is trained again on resume) and says how to continue."""
    try:
        yield
    except RunStopped as stop:
        if stop.saves_checkpoint:
            stop.note_checkpoint(trainer.save("last.pt"))
        raise
    except KeyboardInterrupt:
        state = trainer.state
        state.batches_done -= state.batches_done % trainer.cfg.train.accumulate_grad_batches
        path = trainer.save("last.pt")
        log.warning(
            "interrupted at epoch %d, step %d: saved %s; continue with: %s",
            state.epoch + 1,
            state.global_step,
            path,
            resume_command,
        )
        raise


def sync_buffers(trainer: Trainer) -> None:
    """Under DDP, rank 0's buffers (BatchNorm running statistics) to every rank before validation: each rank
    evaluates its shard with the statistics rank 0 saves."""
    if trainer.runtime.distributed:
        for buffer in trainer.model.buffers():
            torch.distributed.broadcast(buffer, 0)


def fit(
    trainer: Trainer, train_loader: DataLoader, val_loader: DataLoader | None, resume_command: str = "--resume auto"
) -> None:
    """Epochs of training and validation to trainer.max_epochs; an abnormal end saves last.pt (saved_on_stop)
    and raises; ``resume_command`` is what the Ctrl-C message says to run to continue."""
    with saved_on_stop(trainer, resume_command):
        with watchdog.armed():  # under torchrun: a stalled rank says where
            finished, confusion = _fit(trainer, train_loader, val_loader)
        if finished:  # the plots are rank 0's own work, not a wait on the group: outside the stall bound
            _end_run(trainer, confusion)


def _fit(trainer: Trainer, train_loader: DataLoader, val_loader: DataLoader | None) -> tuple[bool, list | None]:
    """The epochs; whether they reached max_epochs (not --stop-after-steps), and the last validation's confusion."""
    cfg, state, runtime = trainer.cfg, trainer.state, trainer.runtime
    max_epochs = cfg.trainer.max_epochs
    board = trainer.report.tensorboard
    metrics_log = (
        CsvLog(trainer.run.metrics_csv, board.mirror("", "epoch") if board else None) if runtime.is_main else None
    )
    changed = metrics_log.keep_rows_of(state.history) if metrics_log is not None else 0
    if changed:  # e.g. a run stopped by a full disk between its checkpoint and its row
        log.warning(
            "%s: %d row(s) written or removed to match the %d epochs of the checkpoint resumed from",
            trainer.run.metrics_csv,
            changed,
            len(state.history),
        )
    leaks = memory_monitor.LeakDetector(cfg.trainer.leak_check_epochs, cfg.trainer.leak_tolerance_mb)
    confusion = None  # of the last validation, for the plot at the end
    while state.epoch < max_epochs:
        if refit_due(trainer):
            begin_head_refit(trainer)
        train_loader.dataset.set_epoch(state.epoch)
        train_loader.sampler.set_epoch(state.epoch, start=state.batches_done * cfg.data.batch_size)
        row = {"epoch": state.epoch + 1, **train_one_epoch(trainer, train_loader)}
        mid_epoch_memory = row.pop("memory")
        if trainer.report.memory_log is not None:  # at least one memory row per epoch, whatever train.log_every is
            trainer.report.memory_log.write(
                {"epoch": state.epoch + 1, "step": state.global_step, **memory_monitor.snapshot(runtime.device)}
            )
        if trainer.stop_after_steps and state.global_step >= trainer.stop_after_steps:
            trainer.save("last.pt")
            log.info("stopped after %d steps (--stop-after-steps); last.pt saved", state.global_step)
            return False, confusion
        stop_if_asked()
        if val_loader is not None and _validation_due(cfg.trainer, state.epoch):
            precise_bn_before_validation(trainer, train_loader.dataset)
            sync_buffers(trainer)
            metrics = evaluate(
                trainer.model,
                val_loader,
                trainer.prepare,
                runtime,
                cfg.infer,
                len(trainer.class_names),
                trainer.report.bad_inputs,
                frame_stride=cfg.data.frame_stride,
                background=background_indices(cfg.data.background_labels, trainer.class_names),
            )
            row.update({f"val_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
            confusion = metrics["confusion"]
        if mid_epoch_memory is not None:
            warning = leaks.observe(mid_epoch_memory)
            if warning:
                log.warning("epoch %d: %s", state.epoch + 1, warning)
        _end_epoch(trainer, row, metrics_log)
        warn_if_head_at_chance(trainer)
    return True, confusion


def _validation_due(trainer_cfg: TrainerConfig, epoch: int) -> bool:
    """Every trainer.check_val_every_n_epoch epochs, and after the last."""
    return (epoch + 1) % trainer_cfg.check_val_every_n_epoch == 0 or epoch + 1 == trainer_cfg.max_epochs


def _end_epoch(trainer: Trainer, row: dict, metrics_log) -> None:
    """The epoch's row into the history and metrics.csv, best.pt if the monitored metric improved, the line."""
    state, cfg = trainer.state, trainer.cfg
    state.epoch += 1
    state.batches_done, state.epoch_loss_sum, state.epoch_auxiliary_sum, state.epoch_clips = 0, 0.0, 0.0, 0
    row.update(time=time.strftime("%Y-%m-%dT%H:%M:%S"), elapsed_s=round(time.time() - trainer.report.started, 3))
    state.history.append(row)
    improved = cfg.train.monitor in row and row[cfg.train.monitor] > state.best_metric
    if improved:
        state.best_metric = row[cfg.train.monitor]
    if trainer.runtime.is_main:
        _save_epoch(trainer, improved)
        metrics_log.write(row)
        shown = ("train_loss", "train_clips_per_s", "data_time_share", "val_clip_acc", "val_video_acc")
        # top-5 of 5 classes or fewer is always 1: not worth a column then
        shown += ("val_top5",) if len(trainer.class_names) > 5 else ()
        log.info(
            "epoch %d/%d: %s",
            state.epoch,
            cfg.trainer.max_epochs,
            "  ".join(f"{k} {row[k]:.4f}" for k in shown if k in row),
        )


def _end_run(trainer: Trainer, confusion: list | None) -> None:
    state, cfg = trainer.state, trainer.cfg
    if trainer.report.bad_inputs is not None:
        trainer.report.bad_inputs.end_run()
    if trainer.runtime.is_main and state.history:
        if cfg.trainer.plots:
            validated = [row["epoch"] for row in state.history if "val_clip_acc" in row]
            training_plots(
                trainer.run, trainer.class_names, confusion, cfg.train.monitor, validated[-1] if validated else None
            )
        log.info("done: best %s %.4f; checkpoints in %s", cfg.train.monitor, state.best_metric, trainer.run.checkpoints)


def _save_epoch(trainer: Trainer, improved: bool) -> None:
    trainer.save("last.pt")
    trainer.run.link_epoch(trainer.state.epoch, improved, trainer.cfg.train.keep_last_k)
