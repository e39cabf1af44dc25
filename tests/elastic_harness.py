"""Torchrun groups of train.py driven from outside: launched in either layout (one node, or two agents with a c10d
rendezvous), a rank killed or stopped at an optimizer step, waited for and stopped, and their final weights
compared. ``python -m bench.elastic`` counts bit-identical finishes over many kills; tests/test_elastic.py checks
one kill per promise."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from artifacts.checkpoint import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ("one-node", "two-agents")
WORLD_SIZE = 2  # processes in either layout
MODES = ("agreed", "during_backward")


def settings(data: str, out: str, mode: str, *extra: str) -> list[str]:
    """train.py's flags for a small CPU run: 2 epochs of 5 steps (18 clips, 2 processes of batch 2), last.pt every
    step, --resume auto."""
    values = [
        f"data.data_dir={data}",
        f"trainer.output_dir={out}",
        "data.img_size=32",
        "data.num_frames=8",
        "data.frame_stride=2",
        "data.batch_size=2",
        "data.num_workers=0",
        "data.sample_timeout_s=null",
        "model.width=8",
        "trainer.device=cpu",
        "train.max_epochs=2",
        "trainer.log_every=1",
        "train.checkpoint_every_steps=1",
        "trainer.plots=false",
        f"train.ddp_sync={mode}",
        "experiment=elastic",
        *extra,
    ]
    flags = ["--config", os.path.join(ROOT, "configs", "base.yaml")]
    for value in values:
        flags += ["--set", value]
    return flags + ["--resume", "auto"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(layout: str, train_flags: list[str], log_dir: str) -> list[subprocess.Popen]:
    """The torchrun agents of ``layout`` (each in a process group of its own, so a cleanup can end everything
    they started), with their output in ``log_dir``."""
    base = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1", "--monitor-interval", "0.5"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if layout == "one-node":
        commands = [base + ["--standalone", "--nproc-per-node", str(WORLD_SIZE), "train.py", *train_flags]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        rendezvous = ["--nnodes", str(WORLD_SIZE), "--nproc-per-node", "1"]
        rendezvous += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        rendezvous += ["--rdzv-id", f"elastic-{os.getpid()}-{time.time_ns()}"]
        commands = [base + rendezvous + ["train.py", *train_flags] for _ in range(WORLD_SIZE)]
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # several agents: each attempt's store is new
    agents = []
    for i, command in enumerate(commands):
        out = open(os.path.join(log_dir, f"agent{i}.log"), "w")
        agents.append(
            subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )
    return agents


def stat_fields(path: str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, ppid, ...); None for a process gone."""
    try:
        return open(path).read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    found = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        fields = stat_fields(path)
        if fields is not None and int(fields[1]) == pid:
            found.append(int(path.split("/")[2]))
    return found


def worker_of(agents: list[subprocess.Popen], rank: int) -> int | None:
    """The pid of the worker with ``rank`` under any of the agents (its RANK in /proc/PID/environ)."""
    for agent in agents:
        for pid in children(agent.pid):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
                return pid
    return None


def logged_step(out: str) -> int:
    """The latest optimizer step rank 0 logged in the run's train.log (0 before any)."""
    steps = [0]
    for path in glob.glob(os.path.join(out, "elastic", "*", "train.log")):
        for line in open(path, errors="replace"):
            if " step " in line and line.split(" step ")[1].split()[0].isdigit():
                steps.append(int(line.split(" step ")[1].split()[0]))
    return max(steps)


def running(pid: int) -> bool:
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields is not None and fields[0] != "Z"  # a zombie has ended


def continue_once_another_ends(stopped: int, others: list[int | None], deadline: float) -> None:
    """torchrun ends a failed group with SIGTERM and sends SIGKILL only 30 s later; a stopped process cannot take
    SIGTERM. Once the stall bound has ended another rank, the stopped one is continued, to take it at once, as a
    rank hung in a collective does."""
    while time.monotonic() < deadline and all(running(pid) for pid in others if pid is not None):
        time.sleep(0.05)
    try:
        os.kill(stopped, signal.SIGCONT)
    except ProcessLookupError:
        pass


def wait(agents: list[subprocess.Popen], timeout: float) -> list[int | None]:
    end = time.monotonic() + timeout
    for agent in agents:
        try:
            agent.wait(max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    return [agent.poll() for agent in agents]


def stop(agents: list[subprocess.Popen]) -> None:
    for agent in agents:
        if agent.poll() is None:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.wait()


def final_weights(out: str) -> dict:
    return load_checkpoint(os.path.join(out, "elastic", "latest", "checkpoints", "last.pt")).model


def run(
    data: str,
    out: str,
    layout: str,
    mode: str,
    kill_at: int | None = None,
    timeout: float = 300.0,
    rank: int = 1,
    how: signal.Signals = signal.SIGKILL,
    extra: tuple = (),
) -> dict:
    """One run of the command; with ``kill_at``, ``rank`` sent ``how`` (SIGKILL; SIGSTOP: a rank that stops
    without dying) once rank 0 has logged that step; ``extra``: more --set values. The result:
    agents' exit codes, whether the kill happened, the seconds, leftovers (temp files, processes)."""
    log_dir = tempfile.mkdtemp(prefix="elastic-logs-")
    start, killed = time.monotonic(), None
    agents = launch(layout, settings(data, out, mode, *extra), log_dir)
    try:
        while kill_at is not None and killed is None and time.monotonic() - start < timeout:
            if all(agent.poll() is not None for agent in agents):
                break
            if logged_step(out) >= kill_at:
                pid = worker_of(agents, rank)
                if pid is not None:
                    others = [worker_of(agents, r) for r in range(WORLD_SIZE) if r != rank]
                    os.kill(pid, how)
                    killed = logged_step(out)
                    if how == signal.SIGSTOP:
                        continue_once_another_ends(pid, others, start + timeout)
            time.sleep(0.05)
        codes = wait(agents, timeout - (time.monotonic() - start))
        left = [pid for agent in agents for pid in children(agent.pid)]
    finally:
        stop(agents)
    temps = [p for p in glob.glob(os.path.join(out, "**", "*"), recursive=True) if ".tmp" in os.path.basename(p)]
    logs = "".join(open(os.path.join(log_dir, name), errors="replace").read() for name in sorted(os.listdir(log_dir)))
    shutil.rmtree(log_dir)
    return {
        "codes": codes,
        "killed_at": killed,
        "seconds": time.monotonic() - start,
        "temps": temps,
        "left": left,
        "log": logs,
    }


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
