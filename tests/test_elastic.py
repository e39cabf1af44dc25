"""One rank killed under torchrun: the one command torchrun reruns (train.py ... --resume auto) starts a run, the
restarted group joins, resumes mid-epoch from last.pt and finishes with the weights of an uninterrupted run, bit
for bit; a killed agent is resumed by running the command again; a group without progress says where it waits.
2 gloo processes, tiny shapes (elastic_harness.py drives the groups; python -m bench.elastic counts 20 kills)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import elastic_harness as elastic
import pytest
from conftest import overrides

import train
from core import watchdog
from core.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def references(synthetic_root, tmp_path_factory):
    """The final weights of an uninterrupted run of the command, in each train.ddp_sync mode."""
    found = {}
    for mode in elastic.MODES:
        out = str(tmp_path_factory.mktemp(f"reference-{mode}"))
        result = elastic.run(synthetic_root, out, "one-node", mode)
        assert result["codes"] == [0], result["log"][-3000:]
        assert "no " in result["log"] and "a new run starts" in result["log"]  # --resume auto began a new run
        found[mode] = elastic.final_weights(out)
    return found


def assert_resumed_and_identical(result: dict, out: str, reference: dict) -> None:
    assert all(code == 0 for code in result["codes"]), result["log"][-3000:]
    assert result["killed_at"] is not None and "resumed from" in result["log"], result["log"][-3000:]
    assert result["temps"] == [] and result["left"] == []
    assert elastic.identical(elastic.final_weights(out), reference)


# one kill per sync mode; rank 0 is the one that writes; two-agents: two torchrun agents with a c10d rendezvous, one
# worker each (as two nodes), against the one-node reference
@pytest.mark.parametrize("mode, rank, layout", [("agreed", 1, "one-node"), ("during_backward", 0, "two-agents")])
def test_a_rank_killed_mid_epoch_restarts_and_finishes_bit_identically(
    synthetic_root, tmp_path, references, mode, rank, layout
):
    result = elastic.run(synthetic_root, str(tmp_path), layout, mode, kill_at=4, rank=rank)  # 5 steps an epoch
    assert_resumed_and_identical(result, str(tmp_path), references[mode])


def test_a_rank_that_stops_without_dying_is_ended_by_the_stall_bound_and_the_group_restarts(
    synthetic_root, tmp_path, references
):
    """A hang torchrun cannot see: rank 1 stopped (SIGSTOP) mid-epoch, rank 0 waiting for it in a collective. Rank
    0's stall bound ends it with one line saying where it waited; torchrun restarts the group, which resumes and
    finishes bit-identically (the stopped process, continued once rank 0 has ended, takes torchrun's SIGTERM)."""
    result = elastic.run(
        synthetic_root,
        str(tmp_path),
        "one-node",
        "agreed",
        kill_at=4,
        how=signal.SIGSTOP,
        extra=("trainer.stall_timeout_s=3",),
    )
    assert_resumed_and_identical(result, str(tmp_path), references["agreed"])
    # rank 0's line; the stopped rank, continued once rank 0 has ended (elastic_harness.py), may say its own
    [line] = [line for line in result["log"].splitlines() if line.startswith("error: rank 0: no progress")]
    assert line.startswith("error: rank 0: no progress for 3 s after step ")
    assert "(trainer.stall_timeout_s), waiting in " in line and "torch/distributed/distributed_c10d.py:" in line
    assert re.search(r", called from (train\.py|engine/\S+):\d+ \(\w+\)", line), line  # where in the project


def test_a_killed_agent_is_resumed_by_running_the_same_command_again(synthetic_root, tmp_path, references):
    """The whole node: torchrun's agent and its workers killed; the same command continues from last.pt."""
    logs = str(tmp_path / "logs")
    os.makedirs(logs)
    agents = elastic.launch("one-node", elastic.settings(synthetic_root, str(tmp_path), "agreed"), logs)
    try:
        deadline = time.monotonic() + 240
        while elastic.logged_step(str(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(agents[0].pid, signal.SIGKILL)
    finally:
        elastic.stop(agents)
    again = elastic.run(synthetic_root, str(tmp_path), "one-node", "agreed")
    assert again["codes"] == [0], again["log"][-3000:]
    assert "resumed from" in again["log"] and again["temps"] == [] and again["left"] == []
    assert elastic.identical(elastic.final_weights(str(tmp_path)), references["agreed"])


def test_a_restart_that_finds_no_checkpoint_is_an_error_and_a_first_start_a_new_run(tmp_path):
    from artifacts.run_dir import resolve_resume
    from config import load_config

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "experiment=elastic"])
    assert resolve_resume("auto", cfg, restart=0) is None
    with pytest.raises(UsageError) as info:
        resolve_resume("auto", cfg, restart=1)
    assert str(info.value).startswith(
        f"--resume auto: torchrun's restart 1 found no {tmp_path}/elastic/latest/checkpoints/last.pt to continue from"
    )
    with pytest.raises(UsageError, match="^--resume auto: no .* to continue from; start without --resume"):
        resolve_resume("auto", cfg)  # outside torchrun, as before


def test_several_agents_with_restarts_need_fresh_stores(monkeypatch):
    """Agents count their restarts apart, so no prefix of one attempt is common to every node: the documented
    variable is asked for, in one line, before anything connects."""
    from core.runtime import _join_process_group

    for name, value in {
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "1",
        "GROUP_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    with pytest.raises(UsageError, match="^torchrun with 2 nodes and --max-restarts 1: .*TORCH_DISABLE_SHARE_RDZV"):
        _join_process_group("gloo", None)


GROUP_LEFT = r"""
import datetime, os, sys
sys.path.insert(0, {root!r})
import torch
from core.runtime import _join_process_group

_join_process_group("gloo", datetime.timedelta(seconds=30))
weights = torch.nn.Parameter(torch.ones(3))
torch.optim.SGD([weights], lr=0.1)  # its first use imports torch._dynamo
torch.distributed.all_reduce(weights.data)
torch.distributed.destroy_process_group()
print(sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_leaving_the_group_ends_its_threads_before_the_interpreter_exits(tmp_path):
    """gloo's threads alive at interpreter exit can abort the process as it ends (a run that finished, then failed
    under torchrun): the group joined by the runtime is gone, threads and all, once destroyed, also after an
    optimizer imported torch._dynamo (which otherwise keeps references to it)."""
    script = tmp_path / "leave.py"
    script.write_text(GROUP_LEFT.format(root=ROOT))
    with socket.socket() as free:  # a port no other test's group has
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    threads = result.stdout.strip()
    assert threads.startswith("[") and "gloo" not in threads, threads


STALLED = r"""
import sys, time
sys.path.insert(0, {root!r})
from core import watchdog

def wait_for_a_peer():
    time.sleep(60)

watchdog.start(0.5, rank=1)
watchdog.beat(step=7)
with watchdog.armed():
    with watchdog.not_counting():  # waiting for data: not a stall
        time.sleep(1.0)
    wait_for_a_peer()
"""


def test_a_rank_without_progress_says_where_it_waits_and_ends(tmp_path):
    script = tmp_path / "stalled.py"
    script.write_text(STALLED.format(root=ROOT))
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert result.returncode == 3 and 1.5 < took < 20, (result.returncode, took, result.stderr)
    [line] = result.stderr.splitlines()
    assert line.startswith("error: rank 1: no progress for 0.5 s after step 7 (trainer.stall_timeout_s), waiting in ")
    assert f"waiting in wait_for_a_peer ({script}:" in line  # the main thread's innermost Python call
    assert line.endswith("; this process ends so torchrun restarts the group from last.pt")


def test_the_plots_at_the_end_of_a_run_are_outside_the_stall_bound(synthetic_root, tmp_path, monkeypatch):
    """The stall bound covers waits on the group or the model; the plots drawn at the end are rank 0's own work
    (matplotlib's first import may build its font cache for seconds), so a slow drawing cannot end the run."""
    armed_while_plotting, plots = [], train.training_plots

    def recording(*args, **kwargs):
        armed_while_plotting.append(watchdog._watchdog.armed)
        return plots(*args, **kwargs)

    monkeypatch.setattr(train, "training_plots", recording)
    watchdog.start(3600, rank=0)  # as under torchrun; never reached here
    try:
        assert train.main(overrides(synthetic_root, tmp_path, "train.max_epochs=1", "trainer.plots=true")) == 0
    finally:
        watchdog.stop()
    assert armed_while_plotting == [0]
