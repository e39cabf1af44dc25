"""Train a video classifier inside a fixed memory budget.

    python train.py --config configs/rtx5080.yaml --use_amp
    python train.py --config configs/quickstart.yaml --set data.batch_size=4 --resume auto
    torchrun --nproc_per_node=2 train.py --config configs/rtx4090.yaml

A hand-written loop: ``train_one_epoch`` and ``evaluate`` return dicts of plain floats; ``main`` wires.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from artifacts.checkpoint import CheckpointError
from artifacts.run_dir import resolve_resume
from config import Config, dump, load_config
from core import watchdog
from core.cli import add_config_arguments, exit_on_usage_error
from core.errors import ConfigError
from core.files import DiskFullError
from core.logs import detach_log_file, setup_logging
from core.runtime import elastic_restart, setup_runtime
from datasets.bad_input import BAD_INPUT_ERRORS
from datasets.records import DATA_LAYOUTS
from datasets.video.capture import quiet_decoder_logs
from engine.training.build import build_trainer
from engine.training.interrupt import stop_on_ctrl_c
from engine.training.loop import fit
from engine.training.trainer import RunStopped
from planner.before_the_run import memory_decisions, state_disk_needs
from planner.disk import DiskPlan
from planner.memory_table import probe_memory

log = logging.getLogger("longvideo")  # set up by main(): importing train configures nothing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue a run: auto = last.pt of runs/<experiment>/latest, or a checkpoint path",
    )
    parser.add_argument("--device", help="override trainer.device (auto, cpu, cuda, cuda:N)")
    parser.add_argument(
        "--probe-memory",
        action="store_true",
        help="estimate (on any machine; with CUDA also measure) the peak device memory of one "
        "training step over a grid of num_frames x batch_size, print the largest batch that "
        "fits trainer.memory_budget_gb, and exit",
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
        help="before training, pick the largest micro-batch whose estimated memory fits "
        "trainer.memory_budget_gb and keep the global batch by accumulation (as "
        "data.batch_size: auto does)",
    )
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        metavar="N",
        help="stop after N optimizer steps (saving last.pt): smoke tests and quick checks",
    )
    return parser.parse_args(argv)


def refuse_gpu_preset_without_cuda(cfg: Config, config_path: str | None, device: str | None) -> None:
    """A preset sized for a GPU (trainer.memory_budget_gb, device auto or cuda) on a machine without CUDA would
    train for hours on the CPU without a word: stop at once, unless --device cpu says that is meant."""
    budget, wanted = cfg.trainer.memory_budget_gb, device or cfg.trainer.device
    if budget and wanted != "cpu" and not torch.cuda.is_available():
        raise ConfigError(
            f"{config_path or 'the config'}: this machine has no CUDA device, and the preset is for a "
            f"{budget:g} GB GPU (trainer.memory_budget_gb); use configs/cpu.yaml, or add --device cpu "
            f"to run it on the CPU anyway"
        )


def refuse_demo_data_for_gpu_preset(cfg: Config, origins: dict, config_path: str | None) -> None:
    """A GPU preset names no data of its own: without data.data_dir set (in the user's preset or by --set) it
    would train on the demo's synthetic clips without a word."""
    origin = origins.get("data.data_dir", "defaults")
    if cfg.trainer.memory_budget_gb and (origin == "defaults" or os.path.basename(origin) == "base.yaml"):
        raise ConfigError(
            f"{config_path or 'the config'}: data.data_dir is not set, and a GPU preset does not fall "
            f"back to the demo's {cfg.data.data_dir}: set data.data_dir (and data.train_manifest, "
            f"data.val_manifest or data.val_fraction) to your data, e.g. --set "
            f"data.data_dir=/data/clips; a manifest may be {DATA_LAYOUTS}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_decoder_logs()
    origins: dict[str, str] = {}
    cfg = load_config(args.config, args.overrides, args.use_amp, origins)
    if args.print_config:
        print(dump(cfg), end="")
        return 0
    if args.probe_memory:  # before the runtime: nothing of this machine's is used unless it has CUDA
        return probe_memory(cfg, args.device, args.probe_frames, args.probe_batches, args.world_size)
    refuse_gpu_preset_without_cuda(cfg, args.config, args.device)
    refuse_demo_data_for_gpu_preset(cfg, origins, args.config)
    runtime = setup_runtime(cfg.trainer, device=args.device)
    setup_logging(runtime.is_main)
    resume_path = resolve_resume(args.resume, cfg, elastic_restart()) if args.resume else None
    cfg, kept_chunks, features_index = memory_decisions(cfg, runtime, args.fit_budget)
    plan = None
    try:
        trainer, train_loader, val_loader = build_trainer(
            cfg, runtime, resume_path, args.stop_after_steps, kept_chunks, features_index
        )
        plan = state_disk_needs(trainer, len(train_loader), resumed=bool(resume_path)) if runtime.is_main else None
    except DiskFullError as e:
        raise disk_full_advice(e, plan, args, resumable=bool(args.resume)) from None
    try:
        with stop_on_ctrl_c():
            fit(trainer, train_loader, val_loader, resume_command(args))
        if runtime.distributed:  # rank 0 still saves and plots: no rank tears its connections down under a peer
            torch.distributed.barrier()
    except RunStopped as e:  # last.pt saved (named in the message)
        log.error("error: %s", e)
        return 1
    except KeyboardInterrupt:  # last.pt saved, the command that continues said
        return 130  # the shell's code for SIGINT
    except DiskFullError as e:  # the run stops at its first failed write; what was written before is whole
        resumable = bool(args.resume) or (trainer.run is not None and os.path.exists(trainer.run.checkpoint("last.pt")))
        raise disk_full_advice(e, plan, args, resumable) from None
    finally:
        detach_log_file(trainer.report.log_file)
        if runtime.distributed:
            watchdog.stop()
            torch.distributed.destroy_process_group()
    return 0


def disk_full_advice(
    error: DiskFullError, plan: DiskPlan | None, args: argparse.Namespace, resumable: bool
) -> DiskFullError:
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
