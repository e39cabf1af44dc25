"""Train a video classifier inside a fixed memory budget.

    python train.py --config configs/quickstart.yaml
    python train.py --config configs/rtx5080.yaml --use_amp --set data.data_dir=/data/clips
    python train.py --config configs/quickstart.yaml --set data.batch_size=4 --resume auto
    torchrun --nproc_per_node=2 train.py --config configs/rtx4090.yaml --set data.data_dir=/data/clips

The loop is this file, read top to bottom: ``forward_backward`` and ``optimizer_step`` (one step), ``train_one_epoch``
(the accumulation groups of an epoch), ``fit`` (epochs, validation, checkpoints) and ``main`` (wiring). What the
project adds to a plain loop is one named call each, from the packages below: the chunked training forward and its
recompute (engine.training.chunked_forward), the out-of-memory back-off and its agreement across processes
(engine.training.oom), the RNG state of exact resume (engine.data.loaders.resumed_batches), the watchdog of
stalled processes (core.watchdog) and the feature bank (engine.training.feature_bank). The memory planner runs
``forward_backward`` and ``optimizer_step`` themselves on fake tensors (``STEP``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import warnings

import torch
from tqdm import tqdm

from artifacts.checkpoint import CheckpointError
from artifacts.csv_log import CsvLog
from artifacts.plots import training_plots
from artifacts.run_dir import resolve_resume
from config import Config, dump, load_config
from core import memory_monitor, watchdog
from core.cli import add_config_arguments, exit_on_usage_error
from core.files import DiskFullError
from core.logs import detach_log_file, setup_logging
from core.runtime import elastic_restart, setup_runtime
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.video.capture import quiet_decoder_logs
from engine.data.loaders import resumed_batches
from engine.evaluation.evaluate import evaluate
from engine.metrics.segments import background_indices
from engine.training.at_chance import warn_if_at_chance
from engine.training.build import build_run, refuse_demo_data_for_gpu_preset, refuse_gpu_preset_without_cuda
from engine.training.interrupt import next_batch, saved_on_stop, stop_if_asked, stop_on_ctrl_c
from engine.training.motion_pretext import evaluate_motion, motion_config
from engine.training.oom import agree_and_reduce, with_oom_backoff
from engine.training.precise_bn import precise_bn_before_validation
from engine.training.run import NonFiniteLossError, RunStopped, TrainingRun
from engine.training.step import BatchLoss, clips_per_forward, micro_batches
from planner.before_the_run import memory_decisions, state_disk_needs
from planner.disk import DiskPlan
from planner.memory_table import probe_memory
from planner.project import LoopStep

log = logging.getLogger("longvideo")  # set up by main(): importing train configures nothing
PROGRESS_EVERY_S = 60.0  # a log line a minute at least, for nohup and cron logs
MAX_NONFINITE_STEPS = 20  # non-finite losses in a row that stop the run


def forward_backward(model, inputs, piece, spec, losses, runtime, scaler, weight: float):
    """One micro-batch: the training forward (its training chunks, recomputed in backward) and its loss under
    autocast, then the backward of the loss times ``weight`` (the micro-batch's share of its accumulation group),
    scaled for fp16. Returns the loss and its auxiliary part (None without one), detached."""
    with runtime.autocast():
        label, auxiliary = losses(model(inputs, spec, piece.get("sample")), piece, spec)
        loss = label if auxiliary is None else label + auxiliary.to(label.dtype)
    scaler.scale(loss * weight).backward()
    return loss.detach(), None if auxiliary is None else auxiliary.detach()


def optimizer_step(model, optimizer, scaler, scheduler, max_norm: float | None) -> bool:
    """The accumulated gradients into the weights: unscaled and clipped to ``max_norm``, the optimizer's step
    (skipped when a gradient is inf or NaN), the gradients freed, the schedule advanced. Whether the step was taken."""
    norm = None  # of all gradients together: inf or NaN if any of them is
    if max_norm is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if scaler.is_enabled():
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skipped by the scaler itself on inf/NaN gradients
        scaler.update()
        stepped = scaler.get_scale() >= scale  # a lowered scale: the step was skipped
    else:
        if norm is None:  # one fused norm and one device sync, not one per parameter
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        stepped = bool(torch.isfinite(norm))
        if stepped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # a step skipped for inf/NaN gradients still advances the schedule (it counts optimizer steps); torch warns
        # about a scheduler step before any optimizer step, which is then expected
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()
    return stepped


STEP = LoopStep(forward_backward, optimizer_step)  # what the memory planner estimates


def train_batch(run: TrainingRun, batch: dict, group_size: int, position: int, ends_group: bool) -> BatchLoss:
    """One loader batch through forward and backward, in the micro-batches the out-of-memory back-off split it into
    (``position``: its place in its accumulation group). Under torchrun with train.ddp_sync: during_backward, DDP
    all-reduces in the backward of the group's last micro-batch (``ends_group``), the others under no_sync."""
    pieces = micro_batches(batch, run.state.micro_splits)
    size, total, auxiliary = len(batch["label"]), 0.0, 0.0
    for i, piece in enumerate(pieces):
        inputs = run.inputs.transfer(piece)  # non_blocking; frames stay uint8 until their chunk runs
        clips = len(piece["label"])
        spec, weight = run.chunk_spec(position, i), clips / size / group_size  # weight: a share of the group's mean
        with run.sync_context(ends_group and i == len(pieces) - 1):
            loss, aux = forward_backward(run.model, inputs, piece, spec, run.losses, run.runtime, run.scaler, weight)
        total += float(loss) * clips
        auxiliary += 0.0 if aux is None else float(aux) * clips
    return BatchLoss(total, auxiliary, size)


def train_one_epoch(run: TrainingRun, loader) -> dict:
    """One epoch (or its rest, resumed): accumulation groups of train.accumulate_grad_batches loader batches, each
    ending in an optimizer step. Returns the epoch's row of plain numbers."""
    state, runtime, cfg = run.state, run.runtime, run.cfg
    accumulate = cfg.train.accumulate_grad_batches
    run.model.train()
    num_batches = len(loader) + state.batches_done
    pending_rng, run.pending_rng = run.pending_rng, None
    batches = resumed_batches(loader, pending_rng, state.batches_done, run.report.bad_inputs)  # exact resume's RNG
    progress = tqdm(
        total=num_batches,
        initial=state.batches_done,
        desc=f"epoch {state.epoch + 1}",
        disable=not (runtime.is_main and sys.stderr.isatty()),
        leave=False,
    )
    clips, data_time, start = 0, 0.0, time.perf_counter()  # this call's, for its speed
    group_start = state.batches_done - state.batches_done % accumulate
    group: list[dict] = []  # this accumulation group's batches, kept to replay it after an out-of-memory error
    mid_epoch_memory = None  # for the leak check
    for batch_index in range(state.batches_done, num_batches):
        tick = time.perf_counter()
        batch = next_batch(batches)
        data_time += time.perf_counter() - tick
        run.report.take_bad_inputs(batch)
        group_size = min(accumulate, num_batches - group_start)  # the last group of an epoch may be short
        need_update = batch_index + 1 == group_start + group_size
        group.append(batch)
        with watchdog.warming_up():  # the first steps may compile and search algorithms: not a stall
            loss = with_oom_backoff(run, group, group_size, need_update, train_batch)
        if batch_index == num_batches // 2:  # the same point of every epoch, workers alive: for the leak check
            mid_epoch_memory = memory_monitor.snapshot(runtime.device)
        if math.isfinite(loss.total):
            state.nonfinite_streak = 0
            state.epoch_loss_sum += loss.total
            state.epoch_auxiliary_sum += loss.auxiliary
            state.epoch_clips += loss.clips
            clips += loss.clips
        else:
            state.nonfinite_streak += 1
        if need_update:
            if runtime.distributed and not run.syncs_in_backward:
                agree_and_reduce(run)  # every rank's back-off agreed, then the gradients averaged
            with watchdog.warming_up():
                stepped = optimizer_step(run.model, run.optimizer, run.scaler, run.scheduler, run.max_grad_norm)
            if not stepped:
                state.skipped_steps += 1
                log.warning("step %d skipped: non-finite gradients (%d so far)", state.global_step, state.skipped_steps)
            state.global_step += 1
            group_start, group = batch_index + 1, []
        watchdog.beat(state.global_step)
        state.batches_done = batch_index + 1
        progress.update(1)
        if state.nonfinite_streak >= MAX_NONFINITE_STEPS:
            raise NonFiniteLossError(
                f"{state.nonfinite_streak} consecutive non-finite losses at step {state.global_step}",
                "Lower train.lr, use trainer.precision: bf16 or 32 instead of 16, or set train.grad_clip",
            )
        if need_update:
            every = cfg.train.checkpoint_every_steps
            if every and state.global_step % every == 0:
                run.save("last.pt")
            log_progress(run, clips, data_time, time.perf_counter() - start, progress)
            if run.stop_after_steps and state.global_step >= run.stop_after_steps:
                break
    progress.close()
    elapsed = time.perf_counter() - start
    run.report.end_epoch(state.epoch + 1)
    counted = max(state.epoch_clips, 1)
    row = {"train_loss": state.epoch_loss_sum / counted}
    if run.has_auxiliary_loss:  # the label's loss alone: what tells a head that fits from one that does not learn
        row["train_label_loss"] = (state.epoch_loss_sum - state.epoch_auxiliary_sum) / counted
    return {
        **row,
        "train_clips_per_s": clips / elapsed,
        "data_time_share": data_time / elapsed,
        "lr": run.scheduler.get_last_lr()[0],
        "skipped_steps": state.skipped_steps,
        "clips_per_forward": clips_per_forward(cfg.data.batch_size, state.micro_splits),
        "chunk_train_size": run.chunk_spec().size,
        "memory": mid_epoch_memory,
    }


def log_progress(run: TrainingRun, clips: int, data_time: float, elapsed: float, progress) -> None:
    """Every trainer.log_every optimizer steps (and once a minute at least): the log line and a memory.csv row."""
    state, runtime = run.state, run.runtime
    due = (
        state.global_step % run.cfg.trainer.log_every == 0 or time.time() - run.report.last_progress >= PROGRESS_EVERY_S
    )
    if not (due and runtime.is_main):
        return
    run.report.last_progress = time.time()
    memory = memory_monitor.snapshot(runtime.device)
    loss = state.epoch_loss_sum / max(state.epoch_clips, 1)
    progress.set_postfix_str(f"loss {loss:.3f} {memory_monitor.compact(memory)}")
    log.info(
        "epoch %d step %d (%d/%d) loss %.4f lr %.2e clips/s %.1f data %.0f%% %s",
        state.epoch + 1,
        state.global_step,
        state.batches_done,
        progress.total,
        loss,
        run.scheduler.get_last_lr()[0],
        clips / elapsed,
        100 * data_time / elapsed,
        memory_monitor.compact(memory),
    )
    run.report.write_memory(state.epoch + 1, state.global_step, memory)


def fit(run: TrainingRun, train_loader, val_loader) -> tuple[bool, list | None]:
    """Epochs of ``train_one_epoch`` and ``evaluate`` to train.max_epochs: after each, its row in metrics.csv,
    last.pt and (when the monitored metric improved) best.pt. Whether the epochs ran to the end (not
    --stop-after-steps), and the last validation's confusion matrix."""
    cfg, state, runtime = run.cfg, run.state, run.runtime
    metrics_log = run.report.metrics_log(run.directory, state.history) if runtime.is_main else None
    leaks = memory_monitor.LeakDetector()
    confusion = None  # of the last validation, for the plot at the end
    while state.epoch < cfg.train.max_epochs:
        train_loader.dataset.set_epoch(state.epoch)
        train_loader.sampler.set_epoch(state.epoch, start=state.batches_done * cfg.data.batch_size)
        row = {"epoch": state.epoch + 1, **train_one_epoch(run, train_loader)}
        mid_epoch_memory = row.pop("memory")
        run.report.write_memory(state.epoch + 1, state.global_step, memory_monitor.snapshot(runtime.device))
        if run.stop_after_steps and state.global_step >= run.stop_after_steps:
            run.save("last.pt")
            log.info("stopped after %d steps (--stop-after-steps); last.pt saved", state.global_step)
            return False, confusion
        stop_if_asked()
        if val_loader is not None and validation_due(cfg, state.epoch):
            precise_bn_before_validation(run, train_loader.dataset)
            sync_buffers(run)
            if cfg.train.objective == "motion":  # the objective on held-out clips: no label is read
                chunk, bad_inputs = cfg.train.chunk_train_size, run.report.bad_inputs
                metrics = evaluate_motion(run.model, val_loader, run.inputs, runtime, chunk, cfg.train.seed, bad_inputs)
            else:
                metrics = evaluate(
                    run.model,
                    val_loader,
                    run.inputs,
                    runtime,
                    cfg.infer,
                    len(run.class_names),
                    run.report.bad_inputs,
                    frame_stride=cfg.data.frame_stride,
                    background=background_indices(cfg.data.background_labels, run.class_names),
                )
            row.update({f"val_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
            confusion = metrics.get("confusion")
        if mid_epoch_memory is not None and (warning := leaks.observe(mid_epoch_memory)):
            log.warning("epoch %d: %s", state.epoch + 1, warning)
        end_epoch(run, row, metrics_log)
        warn_if_at_chance(run)
    return True, confusion


def validation_due(cfg: Config, epoch: int) -> bool:
    """Every train.check_val_every_n_epoch epochs, and after the last."""
    return (epoch + 1) % cfg.train.check_val_every_n_epoch == 0 or epoch + 1 == cfg.train.max_epochs


def sync_buffers(run: TrainingRun) -> None:
    """Under DDP, rank 0's buffers (BatchNorm running statistics) to every rank before validation: each rank
    evaluates its shard with the statistics rank 0 saves."""
    if run.runtime.distributed:
        for buffer in run.model.buffers():
            torch.distributed.broadcast(buffer, 0)


def end_epoch(run: TrainingRun, row: dict, metrics_log: CsvLog | None) -> None:
    """The epoch's row into the history and metrics.csv, last.pt, best.pt if the monitored metric improved, the
    line."""
    state, cfg = run.state, run.cfg
    state.epoch += 1
    state.batches_done, state.epoch_loss_sum, state.epoch_auxiliary_sum, state.epoch_clips = 0, 0.0, 0.0, 0
    row.update(time=time.strftime("%Y-%m-%dT%H:%M:%S"), elapsed_s=round(time.time() - run.report.started, 3))
    state.history.append(row)
    improved = cfg.train.monitor in row and row[cfg.train.monitor] > state.best_metric
    if improved:
        state.best_metric = row[cfg.train.monitor]
    if not run.runtime.is_main:
        return
    run.save("last.pt")
    run.directory.link_epoch(state.epoch, improved, cfg.train.keep_last_k)
    metrics_log.write(row)
    shown = ("train_loss", "train_clips_per_s", "data_time_share", "val_clip_acc", "val_video_acc", "val_direction_acc")
    shown += ("val_top5",) if len(run.class_names) > 5 else ()  # top-5 of 5 classes or fewer is always 1
    log.info(
        "epoch %d/%d: %s", state.epoch, cfg.train.max_epochs, "  ".join(f"{k} {row[k]:.4f}" for k in shown if k in row)
    )


def end_run(run: TrainingRun, confusion: list | None) -> None:
    """The skipped files said once, the plots of the run (rank 0's own work: outside the stall bound), the last line."""
    state, cfg = run.state, run.cfg
    run.report.end_run()
    if run.runtime.is_main and state.history:
        if cfg.trainer.plots:
            validated = [row["epoch"] for row in state.history if "val_clip_acc" in row]
            monitor, last = cfg.train.monitor, validated[-1] if validated else None
            training_plots(run.directory, run.class_names, confusion, monitor, last)
        log.info(
            "done: best %s %.4f; checkpoints in %s", cfg.train.monitor, state.best_metric, run.directory.checkpoints
        )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument(
        "--resume", metavar="auto|PATH", help="continue a run: auto = last.pt of runs/<experiment>/latest, or a path"
    )
    parser.add_argument("--device", help="override trainer.device (auto, cpu, cuda, cuda:N)")
    parser.add_argument(
        "--probe-memory",
        action="store_true",
        help="estimate (on any machine; with CUDA also measure) the peak device memory of one training step over a "
        "grid of num_frames x batch_size, print the largest batch that fits trainer.memory_budget_gb, and exit",
    )
    parser.add_argument("--probe-frames", metavar="N,N,...", help="num_frames values of the probe grid")
    parser.add_argument("--probe-batches", metavar="N,N,...", help="batch sizes of the probe grid")
    parser.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        default=int(os.environ.get("WORLD_SIZE", 1)),
        help="--probe-memory for N processes (torchrun --nproc_per_node=N); default: this launch's WORLD_SIZE, else 1",
    )
    parser.add_argument(
        "--fit-budget",
        action="store_true",
        help="before training, pick the largest micro-batch whose estimated memory fits trainer.memory_budget_gb and "
        "keep the global batch by accumulation (as data.batch_size: auto does)",
    )
    parser.add_argument(
        "--stop-after-steps", type=int, metavar="N", help="stop after N optimizer steps (saving last.pt): quick checks"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_decoder_logs()
    origins: dict[str, str] = {}
    cfg = motion_config(load_config(args.config, args.overrides, args.use_amp, origins))
    if args.print_config:
        print(dump(cfg), end="")
        return 0
    if args.probe_memory:  # before the runtime: nothing of this machine's is used unless it has CUDA
        return probe_memory(cfg, STEP, args.device, args.probe_frames, args.probe_batches, args.world_size)
    refuse_gpu_preset_without_cuda(cfg, args.config, args.device)
    refuse_demo_data_for_gpu_preset(cfg, origins, args.config)
    runtime = setup_runtime(cfg.trainer, device=args.device)
    setup_logging(runtime.is_main)
    resume_path = resolve_resume(args.resume, cfg, elastic_restart()) if args.resume else None
    cfg, kept_chunks, features_index = memory_decisions(cfg, runtime, args.fit_budget, STEP)
    plan = None
    try:
        run, train_loader, val_loader = build_run(
            cfg, runtime, resume_path, args.stop_after_steps, kept_chunks, features_index
        )
        plan = state_disk_needs(run, len(train_loader), resumed=bool(resume_path)) if runtime.is_main else None
    except DiskFullError as e:
        raise disk_full_advice(e, plan, args, resumable=bool(args.resume)) from None
    try:
        with stop_on_ctrl_c(), saved_on_stop(run, resume_command(args)):
            with watchdog.armed():  # under torchrun: a stalled rank says where it waits
                finished, confusion = fit(run, train_loader, val_loader)
            if finished:
                end_run(run, confusion)
        if runtime.distributed:  # rank 0 still saves and plots: no rank tears its connections down under a peer
            torch.distributed.barrier()
    except RunStopped as e:  # last.pt saved (named in the message)
        log.error("error: %s", e)
        return 1
    except KeyboardInterrupt:  # last.pt saved, the command that continues said
        return 130  # the shell's code for SIGINT
    except DiskFullError as e:  # the run stops at its first failed write; what was written before is whole
        resumable = bool(args.resume) or (
            run.directory is not None and os.path.exists(run.directory.checkpoint("last.pt"))
        )
        raise disk_full_advice(e, plan, args, resumable) from None
    finally:
        detach_log_file(run.report.log_file)
        if runtime.distributed:
            watchdog.stop()
            torch.distributed.destroy_process_group()
    return 0


def disk_full_advice(error: DiskFullError, plan: DiskPlan | None, args: argparse.Namespace, resumable: bool):
    """The one line of a full disk: the failed write, what the run needs, and how to go on (``resumable``: a
    checkpoint of this run exists)."""
    needs = f"this run needs about {plan.total / 2**20:.0f} MB in all; " if plan else ""
    then = (
        f"the last checkpoint written is intact: free space there, then continue with: {resume_command(args)}"
        if resumable
        else "free space there, then run the same command again"
    )
    return DiskFullError(f"{error}; {needs}{then}")


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run after a Ctrl-C."""
    return " ".join(
        ["python", "train.py"]
        + (["--config", args.config] if args.config else [])
        + [f"--set {item}" for item in args.overrides]
        + ["--resume", "auto"]
    )


if __name__ == "__main__":
    exit_on_usage_error(main, BAD_INPUT_ERRORS + (CheckpointError,))
