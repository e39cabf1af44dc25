"""A file that never answers (a stalled network mount): every place that reads one has a deadline.

The stall is real, not a mocked clock: a small LD_PRELOAD shim, compiled here, makes every open() of one path block
forever (in pause(), as a process waiting on a dead NFS server does) while stat() works, so the size check passes
and the block comes inside FFmpeg's open. Each run must end within data.sample_timeout_s plus a margin, say which
file, and leave no process behind.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import overrides

from config import load_config
from datasets.manifest import read_manifest
from datasets.video_dataset import VideoWindowDataset, index_cache_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 2.0
# start-up, indexing, an epoch, the DataLoader's 5 s check of dead workers on a loaded 2-core machine; the stall
# itself never ends, so any finite bound tells a bounded stall from a hang
MARGIN_S = 90.0

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void stall_if_asked(const char *path) {
    const char *stalled = getenv("STALLED_PATH");
    if (stalled && path && strcmp(path, stalled) == 0)
        for (;;) pause();
}

#define WRAP(name, ...) \
    int name(__VA_ARGS__, int flags, ...) { \
        va_list ap; va_start(ap, flags); int mode = va_arg(ap, int); va_end(ap); \
        stall_if_asked(path); \
        int (*real)() = (int (*)()) dlsym(RTLD_NEXT, #name); \
        return ARGS_##name; \
    }
#define ARGS_open real(path, flags, mode)
#define ARGS_open64 real(path, flags, mode)
#define ARGS_openat real(dirfd, path, flags, mode)
#define ARGS_openat64 real(dirfd, path, flags, mode)
WRAP(open, const char *path)
WRAP(open64, const char *path)
WRAP(openat, int dirfd, const char *path)
WRAP(openat64, int dirfd, const char *path)
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the LD_PRELOAD shim that simulates a stalled mount")
    folder = tmp_path_factory.mktemp("shim")
    (folder / "stall.c").write_text(SHIM)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(folder / "stall.so"), str(folder / "stall.c"), "-ldl"],
        check=True,
        capture_output=True,
    )
    return str(folder / "stall.so")


@pytest.fixture
def stalled_data(synthetic_root, tmp_path):
    """Six training clips (one of them the stalled file) and three validation clips, with absolute paths."""
    records = read_manifest(os.path.join(synthetic_root, "train.jsonl"))[:6]
    data = tmp_path / "data"
    data.mkdir()
    lines = [{"video": r.first_path, "label": r.label} for r in records]
    (data / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (data / "val.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:3]))
    return data, records[4].first_path  # the fifth training clip stalls


def our_processes(marker: str) -> list[int]:
    """Live processes (not zombies) started with ``marker`` in their environment: a run's workers included."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(pid))
    return found


def run_with_stall(shim, stalled, args, tmp_path):
    marker = f"STALL_TEST_MARKER={tmp_path.name}"
    env = {**os.environ, "LD_PRELOAD": shim, "STALLED_PATH": stalled, "STALL_TEST_MARKER": tmp_path.name}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=TIMEOUT_S + MARGIN_S + 60
    )
    elapsed = time.monotonic() - start
    time.sleep(0.5)
    assert our_processes(marker) == [], "a process of the run was left behind"
    return result, elapsed


def training_args(data, tmp_path, workers, policy, *extra):
    args = overrides(
        str(data),
        tmp_path / "runs",
        f"data.num_workers={workers}",
        f"data.on_bad_video={policy}",
        f"data.sample_timeout_s={TIMEOUT_S}",
        "data.val_manifest=val.jsonl",
        "train.max_epochs=1",
        "data.batch_size=2",
        *extra,
    )
    return ["train.py", *args]


def index_without_stall(data, tmp_path):
    """The main process indexes from the cache: the stall then comes in a DataLoader worker's open."""
    cfg = load_config(None, [f"data.data_dir={data}", f"trainer.output_dir={tmp_path / 'runs'}"])  # the run's index
    VideoWindowDataset(
        read_manifest(str(data / "train.jsonl")),
        ["down", "grow", "left", "right", "shrink", "up"],
        cfg.data,
        training=True,
        index_cache=index_cache_for(cfg),
    )


def train_with_a_stalled_worker(shim, stalled_data, tmp_path, workers, policy):
    """Training where the stall comes in a DataLoader worker's open (the index cached, so not at indexing)."""
    data, stalled = stalled_data
    index_without_stall(data, tmp_path)
    result, elapsed = run_with_stall(shim, stalled, training_args(data, tmp_path, workers, policy), tmp_path)
    assert result.returncode == (2 if policy == "raise" else 0), result.stderr[-3000:]
    assert elapsed < TIMEOUT_S + MARGIN_S
    return result, stalled


def test_a_sample_stalled_in_a_worker_stops_the_run_with_one_line(shim, stalled_data, tmp_path):
    """Two workers (data.num_workers: 0 with a deadline loads in 1 worker, which the skip test below runs; the stop
    after the report is the same for any number of workers)."""
    result, stalled = train_with_a_stalled_worker(shim, stalled_data, tmp_path, 2, "raise")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr  # the log, then one error line
    assert errors[0].startswith(f"error: {stalled}: sample window [0, ")
    assert f"still loading after {TIMEOUT_S:g} s (data.sample_timeout_s) in DataLoader worker " in errors[0]
    assert errors[0].endswith("set data.on_bad_video: skip to go on without it")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_stalled_in_a_worker_is_skipped_and_training_goes_on(shim, stalled_data, tmp_path, workers):
    result, stalled = train_with_a_stalled_worker(shim, stalled_data, tmp_path, workers, "skip")
    output = result.stdout + result.stderr
    assert output.count(f"skipping {stalled}: sample window") == 1  # reported once, when it happened
    assert f"run: 1 file(s) skipped (data.on_bad_video: skip): {stalled} (" in output
    metrics = (tmp_path / "runs" / "e2e" / "latest" / "metrics.csv").read_text().splitlines()
    assert len(metrics) == 2  # the epoch ended, with its validation


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_header_that_never_comes_at_indexing_is_bounded_too(shim, stalled_data, tmp_path, policy):
    data, stalled = stalled_data  # no index cache: the main process probes every file
    result, elapsed = run_with_stall(shim, stalled, training_args(data, tmp_path, 2, policy), tmp_path)
    assert elapsed < TIMEOUT_S + MARGIN_S
    message = f"{stalled}: no answer within {TIMEOUT_S:g} s while reading its header (data.sample_timeout_s)"
    if policy == "raise":
        assert result.returncode == 2
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: {message}: a stalled mount or a corrupt file? (sample at {data / 'train.jsonl'}:5)"]
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"skipping {data / 'train.jsonl'}:5: {message}" in result.stdout + result.stderr


def test_streaming_inference_stops_at_a_stalled_video_and_says_what_was_not_run(
    shim, stalled_data, tmp_path, trained_run
):
    data, stalled = stalled_data
    run_dir, _ = trained_run
    best = os.path.join(run_dir, "checkpoints", "best.pt")
    manifest = tmp_path / "infer.jsonl"
    first = read_manifest(str(data / "train.jsonl"))[0].first_path
    manifest.write_text(
        json.dumps({"video": stalled, "label": "up"}) + "\n" + json.dumps({"video": first, "label": "up"}) + "\n"
    )
    # the checkpoint's config has the default 300 s: --sample-timeout sets a shorter one
    result, elapsed = run_with_stall(
        shim,
        stalled,
        [
            "infer_chunked.py",
            "--checkpoint",
            best,
            "--input",
            str(manifest),
            "--chunk",
            "4",
            "--sample-timeout",
            str(TIMEOUT_S),
        ],
        tmp_path,
    )
    assert elapsed < TIMEOUT_S + MARGIN_S
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors[0].startswith(f"error: {stalled}: no answer within {TIMEOUT_S:g} s while reading its header")
    # OpenCV's open holds a process-wide lock that the blocked thread keeps: the next video could never open
    assert errors[1] == (
        "error: the other 1 videos are not run: a stalled file keeps the decoder blocked in this "
        "process; run infer_chunked.py again without it"
    )
    assert f"{first}: " not in result.stdout


def test_eval_on_a_stalled_file_ends_with_one_line(shim, stalled_data, tmp_path, trained_run):
    """eval.py (and --watch, which evaluates through the same loader) with the checkpoint's config."""
    data, stalled = stalled_data
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    result, elapsed = run_with_stall(
        shim,
        stalled,
        ["eval.py", "--checkpoint", best, "--data", str(data / "train.jsonl"), "--sample-timeout", str(TIMEOUT_S)],
        tmp_path,
    )
    assert elapsed < TIMEOUT_S + MARGIN_S
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {stalled}: ")
    # at indexing (a header never read) or in the evaluation loader's worker (the header cached by earlier runs)
    assert f"no answer within {TIMEOUT_S:g} s" in errors[0] or f"still loading after {TIMEOUT_S:g} s" in errors[0]
