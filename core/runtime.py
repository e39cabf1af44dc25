"""One place for the device, the precision and the process group: chosen once, used by every script.

The loop bodies never branch on precision: they enter ``runtime.autocast()`` and call the scaler, which
is a no-op when disabled (nanoGPT's pattern).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from core import watchdog
from core.errors import ConfigError, UsageError

log = logging.getLogger("longvideo")

# The one precision table: the names a config or flag may use, and the autocast dtype of each precision.
PRECISION_ALIASES = {
    "32": "32",
    "32-true": "32",
    "fp32": "32",
    "16": "16",
    "16-mixed": "16",
    "fp16": "16",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "amp": "amp",  # resolved per device: fp16 + GradScaler on CUDA, bf16 on the CPU (resolve_precision)
}
AUTOCAST_DTYPES = {"32": None, "16": torch.float16, "bf16": torch.bfloat16}  # None: no autocast


@dataclass
class Runtime:
    device: torch.device
    precision: str  # "32", "16" or "bf16", after resolving "amp" for the device
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self):
        if AUTOCAST_DTYPES[self.precision] is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.precision])

    def grad_scaler(self) -> torch.amp.GradScaler:
        # fp16 needs loss scaling (its range underflows small gradients); bf16 and fp32 do not
        return torch.amp.GradScaler(self.device.type, enabled=self.precision == "16")


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means; a CUDA device always with its index (torch.cuda.set_device refuses a bare
    "cuda")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device: {name!r} asked for, but this machine has no CUDA device "
            f"(use --device cpu or trainer.device: auto)"
        )
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "amp":
        if device.type == "cuda":
            return "16"
        log.warning(
            "precision amp (--use_amp) without CUDA: bf16 autocast on the CPU (on a GPU it means fp16 with GradScaler)"
        )
        precision = "bf16"
    if precision == "bf16" and device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        if "AVX512" not in capability and "AMX" not in capability:
            log.warning(
                "bf16 on this CPU (%s, no AVX512-BF16/AMX) is emulated, many times slower than fp32; use "
                "precision 32 here",
                capability,
            )
    if precision == "16" and device.type == "cpu":
        log.warning("fp16 on the CPU is slow and gains nothing; bf16 (or --use_amp) is the CPU's mixed precision")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("trainer.precision: bf16 is not supported by this GPU (pre-Ampere); use 16 or 32")
    return precision


class RuntimeSettings(Protocol):
    """What setup_runtime reads of the trainer section (config.TrainerConfig; core sits below config)."""

    device: str
    precision: str
    process_group_timeout_s: float
    stall_timeout_s: float | None


def elastic_restart() -> int | None:
    """Under torchrun, which attempt this is (0: the first start; N: its N-th restart of the workers); None
    outside torchrun. Each agent counts its own: on several nodes, only the node whose worker failed counts one."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return None if count is None else int(count)


def _join_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """init_process_group, within the stall bound (a restarted group that cannot join says so), in a store of this
    attempt's own under torchrun's restarts. torchrun's agent keeps one store across the restarts of its workers,
    and the group's keys are the same at every attempt, so a restarted group could read the dead one's addresses (a
    reset connection, or a hang in init_process_group). One agent (one node) gives all its workers the same restart
    count: the attempt's prefix. Several agents count apart, and there TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes
    each attempt's store new (docs/training.md)."""
    # torch._dynamo imported after the group exists (the first optimizer does it) keeps references to the group, so
    # destroy_process_group no longer joins gloo's threads: alive at interpreter exit, one of them releasing a
    # tensor then aborts the process ("terminate called without an active exception"). Imported first, it holds
    # none; outside the stall bound, as it is no wait on the group (1.7 s on a 2-core CPU, more when it is busy).
    import torch._dynamo  # noqa: F401

    with watchdog.armed():
        _init_process_group(backend, timeout)


def _init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    restart, max_restarts = elastic_restart(), int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    fresh_stores = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
    if restart is None or max_restarts == 0 or fresh_stores:
        dist.init_process_group(backend, timeout=timeout)
        return
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes > 1:
        raise UsageError(
            f"torchrun with {nodes} nodes and --max-restarts {max_restarts}: a restarted group would read the dead "
            f"group's addresses from the store torchrun keeps; start torchrun with "
            f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment on every node (docs/training.md, Restarts under "
            f"torchrun)"
        )
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"longvideo/attempt_{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def setup_runtime(trainer_cfg: RuntimeSettings, device: str | None = None, precision: str | None = None) -> Runtime:
    """Device, precision and (under torchrun) the process group; TF32 where allowed."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and (device or trainer_cfg.device) != "cpu" else "gloo"
        # a collective that waits past it (a rank died or stopped) raises on every rank instead of hanging
        watchdog.start(trainer_cfg.stall_timeout_s, rank)
        _join_process_group(backend, datetime.timedelta(seconds=trainer_cfg.process_group_timeout_s))
    dev = resolve_device(device or trainer_cfg.device)
    if dev.type == "cuda" and world_size > 1:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        # TF32 keeps fp32 range with a 10-bit mantissa on Ampere+: faster matmuls/convs, same memory
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    normal = PRECISION_ALIASES.get(str(precision or trainer_cfg.precision).lower())
    if normal is None:
        raise UsageError(f"--precision: {precision!r} is not one of 32, 16, bf16, amp")
    return Runtime(dev, resolve_precision(normal, dev), rank, world_size)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model under DDP, torch.compile and the training forward's wrapper (each keeps the wrapped
    model as ``module`` or ``_orig_mod``), so state dicts have no module./_orig_mod. prefixes."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compute_threads() -> str:
    """The words "N compute threads": the threads torch adds each CPU sum with (OMP_NUM_THREADS, the cores by
    default). A CPU run's figures depend on the count, so the lines that start runs name it."""
    threads = torch.get_num_threads()
    return f"{threads} compute thread{'s' if threads > 1 else ''}"
