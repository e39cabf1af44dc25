"""An out-of-memory error on one rank under DDP: every rank takes the same back-off, nobody waits in a collective
another rank abandoned, and the weights stay identical across ranks. Two gloo processes on the CPU."""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK_SCRIPT = r"""
import json, os, sys
import torch
from torch import nn
from torch.utils.data import DataLoader

from artifacts.checkpoint import TrainState
from artifacts.run_dir import RunDirectory
from config import load_config
from core.logs import setup_logging
from core.runtime import setup_runtime
from datasets.sampler import EpochSampler
from datasets.shape import DataShape
from datasets.device_input import DeviceInputs
from engine.training import build
from engine.training.oom import OutOfMemoryAdvice, OutOfMemoryError
from engine.training.interrupt import saved_on_stop
from engine.training.run import TrainingRun
from models.norms import convert_norms
import train

where, out = sys.argv[1], sys.argv[2]
cfg = load_config(None, ["data.batch_size=4", "train.accumulate_grad_batches=2", "train.weight_decay=0",
                         "trainer.device=cpu", "trainer.log_every=1000",
                         f"model.norm={'sync' if where == 'sync' else 'batch'}",
                         f"train.ddp_sync={'during_backward' if where == 'during_backward' else 'agreed'}",
                         "trainer.process_group_timeout_s=60"])
runtime = setup_runtime(cfg.trainer)
setup_logging(is_main=True)  # every rank prints: the test reads both ranks' reports


class RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise OutOfMemoryError("CUDA out of memory (simulated, in backward)")


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv3d(3, 4, 3, padding=1), nn.Linear(4, 3)
        self.norm = nn.BatchNorm3d(4) if where == "sync" else nn.Identity()
        self.forwards = 0

    def forward(self, inputs):
        self.forwards += 1
        if where == "sync" and runtime.rank == 1 and self.forwards == 4:  # rank 0 waits in the norm's collective
            raise OutOfMemoryError("CUDA out of memory (simulated, in a synchronized forward)")
        x = torch.relu(self.norm(self.conv(inputs["video"]))).mean(dim=(2, 3, 4))
        # rank 1 only, once, mid-epoch: the 4th forward is the second batch of the second accumulation group,
        # the piece whose backward would all-reduce under plain DDP
        if runtime.rank == 1 and self.forwards == 4:
            if where == "forward":
                raise OutOfMemoryError("CUDA out of memory (simulated, in forward)")
            x = RaiseInBackward.apply(x)
        return self.fc(x)


generator = torch.Generator().manual_seed(1)
samples = [{"video": torch.randint(0, 255, (3, 4, 8, 8), generator=generator, dtype=torch.uint8), "label": i % 3}
           for i in range(32)]
sampler = EpochSampler(len(samples), shuffle=False, rank=runtime.rank, world_size=runtime.world_size, pad=True)
loader = DataLoader(samples, batch_size=4, sampler=sampler)
model = Model()
if where == "sync":
    convert_norms(model, "sync")
inputs = DeviceInputs(runtime.device, cfg.data.mean, cfg.data.std)
wrapped = build.wrap_for_training(model, inputs, cfg, runtime)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
run = TrainingRun(wrapped, optimizer, scheduler, runtime.grad_scaler(), inputs, runtime, cfg,
                  RunDirectory(out) if runtime.is_main else None, ["a", "b", "c"], DataShape(3),
                  nn.CrossEntropyLoss(), TrainState())
try:
    with saved_on_stop(run):  # as train.py's fit
        train.train_one_epoch(run, loader)
except OutOfMemoryAdvice as e:  # as train.py
    print(f"rank {runtime.rank} error: {e}", flush=True)
    sys.exit(1)
with open(os.path.join(out, f"rank{runtime.rank}.json"), "w") as f:
    json.dump({"micro_splits": run.state.micro_splits, "steps": run.state.global_step,
               "weights": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
torch.distributed.destroy_process_group()
"""


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_on_one_rank_is_agreed_by_every_rank(tmp_path, where):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            where,
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )  # a hang fails here, within the timeout
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    # rank 1 backed off on its own; rank 0 learned it at the group's end and took the same back-off
    assert "out of memory at 4 clips per forward: now 2 per forward" in output
    assert "rank 0: another rank ran out of memory: now 2 forwards per batch and whole clips, as every rank" in output
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert [r["micro_splits"] for r in ranks] == [2, 2]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 2  # 4 batches a rank, 2 per step: no step lost or doubled
    assert ranks[0]["weights"] == ranks[1]["weights"]  # identical, not merely close


def test_an_oom_under_sync_batch_norm_stops_every_rank_with_the_reason(tmp_path):
    """SyncBatchNorm puts a collective in every forward: rank 1's OOM leaves rank 0 waiting in one, so no back-off
    can be agreed. Rank 1 stops with the reason; rank 0 is stopped too (by gloo's closed connection or by
    torchrun), within the timeout rather than at gloo's 30-minute one."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            "sync",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "rank 1 error: out of memory with model.norm: sync: every BatchNorm forward is synchronized" in output
    assert "use model.norm: batch" in output
    assert not os.path.exists(tmp_path / "rank0.json")  # rank 0 did not carry on alone


def test_an_oom_with_overlapped_all_reduce_stops_every_rank_and_leaves_last_pt(tmp_path):
    """train.ddp_sync: during_backward: rank 1 runs out of memory in a backward whose all-reduce rank 0 waits in. No
    back-off can be agreed: rank 1 stops with the reason and the way out, rank 0 is stopped too (torchrun, or the
    process group's timeout) within a bounded time, and the last.pt there before is left as it was."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    os.makedirs(tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"the checkpoint of an earlier step")
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            "during_backward",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert result.returncode != 0 and time.monotonic() - started < 120
    output = result.stdout + result.stderr
    assert (
        "rank 1 error: rank 1: out of memory with train.ddp_sync: during_backward: the other 1 process(es) wait in an "
        "all-reduce of the backward this process abandoned"
    ) in output
    assert "resume with --resume auto and train.ddp_sync: agreed" in output
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == b"the checkpoint of an earlier step"
    assert not os.path.exists(tmp_path / "rank0.json")  # rank 0 did not carry on alone


AVERAGE_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from engine.training.oom import average_gradients

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
grads = [torch.randn(5, 3), torch.randn(40), torch.randn(2, 2).double(), torch.randn(3, 4).t(), torch.randn(7)]
before = [g.clone() for g in grads]
pointers = [g.data_ptr() for g in grads]
average_gradients(grads, 2, bucket_bytes=64)  # 16 floats a bucket: several buckets, one gradient larger than one
gathered = [None, None]
dist.all_gather_object(gathered, [b.tolist() for b in before])
expected = [(torch.tensor(a, dtype=g.dtype) + torch.tensor(b, dtype=g.dtype)) / 2
            for a, b, g in zip(gathered[0], gathered[1], grads)]
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:  # a file a rank: printed lines of two ranks interleave
    json.dump({"equal": all(torch.equal(g, e) for g, e in zip(grads, expected)),
               "in_place": [g.data_ptr() for g in grads] == pointers}, f)
dist.destroy_process_group()
"""


def test_gradients_are_averaged_in_place_bucket_by_bucket(tmp_path):
    """The averaging agree_and_reduce runs: each rank's gradients summed and halved, written where they are
    (no second copy of all of them), across buckets, a gradient larger than a bucket, two dtypes and a
    non-contiguous gradient."""
    script = tmp_path / "average.py"
    script.write_text(AVERAGE_SCRIPT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.load(open(tmp_path / f"rank{rank}.json")) for rank in (0, 1)]
    assert reports == [{"equal": True, "in_place": True}] * 2
