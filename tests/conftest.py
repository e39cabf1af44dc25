"""Fixtures: tiny videos written to temp dirs (barcoded frame numbers), a small synthetic dataset."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import runpy
import shutil
import subprocess
import sys
import traceback
import warnings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test runs one pytest worker per core (-n auto): each with one compute thread, itself and the scripts it
    # starts, so the workers share the cores instead of fighting over them
    os.environ["OMP_NUM_THREADS"] = "1"

import cv2  # noqa: E402 (after the thread setting, which the libraries read when they load)
import numpy as np
import pytest

# make test hands out whole files to its two workers in this order (--dist loadfile --no-loadscope-reorder): the
# longest first, so that no long file starts last and runs alone while the other worker idles. From the durations
# make test prints; a file not named here comes after these, in collection order.
LONGEST_FIRST = (
    "test_readme.py",
    "test_head_learning.py",
    "test_mstcn.py",
    "test_elastic.py",
    "test_stalls.py",
    "test_training_loop.py",
    "test_two_stage.py",
    "test_chunked_training.py",
    "test_ddp_oom.py",
    "test_gpu_suite.py",
    "test_adapters.py",
    "test_full_disk.py",
    "test_models.py",
    "test_workers_and_bad_input.py",
    "test_memory_estimate.py",
    "test_external_backbones.py",
    "test_eval_watch.py",
    "test_prepared.py",
    "test_first_hour.py",
    "test_temporal_head.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BITS = 12
BLOCK = 10  # pixels per bit: wide blocks survive lossy codecs
WIDTH, HEIGHT = BITS * BLOCK, 48


def needs_packages(*names: str, reason: str):
    """A test module's skip mark where an optional package is missing, found without importing it: transformers and
    peft take seconds to import, which every worker would pay while collecting (the tests import them when they
    run)."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{' and '.join(missing)} missing: {reason}")


def run_python(args, **kwargs) -> subprocess.CompletedProcess:
    """``python ARGS...`` from the project root, as a user runs the scripts."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, **kwargs)


def run_in_process(args: list[str], cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS...`` (a script or ``-m MODULE``, from ``cwd``, else the project root) run in this interpreter:
    the script's own ``__main__`` block (runpy), its stdout, stderr and exit code captured as run_python's, a crash
    as its traceback and code 1. The same code path as a new interpreter for all that ends in Python, without one's
    2 s of imports: for the scripts' usage errors and short runs. What needs a process of its own keeps
    run_python: signals and kills, torchrun, a timeout, an environment of its own, and C libraries writing to file
    descriptor 2 (a decoder's noise is not captured here)."""
    from core.logs import log

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, folder, handlers, level = sys.argv, os.getcwd(), log.handlers[:], log.level
    for handler in handlers:  # the script's logger writes to this run's stderr, as it would in its own process
        log.removeHandler(handler)
    try:
        module = args[1] if args[0] == "-m" else None
        sys.argv = [module or args[0], *args[2 if module else 1 :]]
        os.chdir(cwd or ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # a module that an earlier test imported is run again as __main__: runpy's warning says so, harmlessly
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(args[0], run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
        os.chdir(folder)
        for handler in log.handlers[:]:
            log.removeHandler(handler)
            if handler not in handlers:
                handler.close()
        for handler in handlers:
            log.addHandler(handler)
        log.setLevel(level)
    return subprocess.CompletedProcess([sys.executable, *args], code, out.getvalue(), err.getvalue())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def decode_sequentially(path: str, rgb: bool = True) -> list[np.ndarray]:
    """Every frame of ``path`` by a plain cv2 read() loop (the reference of frame-exactness), RGB or as stored."""
    cap, frames = cv2.VideoCapture(path), []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB) if rgb else frame)
    cap.release()
    return frames


def barcode_frame(index: int) -> np.ndarray:
    """An RGB frame whose bits (white/black blocks) spell ``index``."""
    frame = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    for bit in range(BITS):
        if (index >> bit) & 1:
            frame[:, bit * BLOCK : (bit + 1) * BLOCK] = 255
    return frame


def read_barcode(frame: np.ndarray) -> int:
    """The frame number drawn by barcode_frame (frame: RGB or BGR, at the written size)."""
    value = 0
    for bit in range(BITS):
        if frame[HEIGHT // 2 - 4 : HEIGHT // 2 + 4, bit * BLOCK + 3 : (bit + 1) * BLOCK - 3].mean() > 127:
            value |= 1 << bit
    return value


def write_with_pyav(
    path: str,
    num_frames: int,
    codec: str,
    fps: int = 25,
    options: dict | None = None,
    gop: int | None = None,
    bframes: int | None = None,
    container_options: dict | None = None,
    frame=None,
    display_rotation: int | None = None,
    display_matrix: list | None = None,
) -> str:
    """``num_frames`` frames of ``frame(i)`` (RGB; barcoded frame numbers by default) encoded with PyAV; a
    ``display_rotation`` (counter-clockwise degrees, as PyAV and FFmpeg's tools say it) or ``display_matrix``
    (FFmpeg's 9 ints) is written as a phone writes its rotation."""
    import av

    frame = frame or barcode_frame
    height, width = frame(0).shape[:2]
    with av.open(path, "w", options=container_options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if display_rotation is not None:
            stream.set_display_rotation(display_rotation)
        if display_matrix is not None:
            stream.set_display_matrix(display_matrix)
        if gop is not None:
            stream.codec_context.gop_size = gop
        if bframes is not None:
            stream.codec_context.max_b_frames = bframes
        if options:
            stream.options = options
        for i in range(num_frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame(i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_with_opencv(path: str, num_frames: int, fourcc: str = "XVID", fps: int = 25) -> str:
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), fps, (WIDTH, HEIGHT))
    assert writer.isOpened()
    for i in range(num_frames):
        writer.write(barcode_frame(i)[:, :, ::-1])
    writer.release()
    return path


def tiny_video_transformer(folder, family: str = "videomae", layers: int = 2) -> str:
    """A tiny transformers video model's config saved in ``folder`` (no download): 4 frames at 32x32, 32 wide;
    ``family``: videomae or vjepa2 (its predictor one layer deep)."""
    import transformers

    shape = dict(patch_size=8, tubelet_size=2, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2)
    if family == "videomae":
        config = transformers.VideoMAEConfig(image_size=32, num_frames=4, intermediate_size=64, **shape)
    else:
        config = transformers.VJEPA2Config(
            crop_size=32, frames_per_clip=4, mlp_ratio=2.0, pred_hidden_size=32, pred_num_hidden_layers=1,
            pred_num_attention_heads=2, **shape,
        )  # fmt: skip
    config.save_pretrained(folder)
    return str(folder)


def quickstart_config(*changes):
    """configs/quickstart.yaml with ``changes`` (KEY=VALUE), a 1 GB budget for the planner's lines."""
    from config import load_config

    return load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), ["trainer.memory_budget_gb=1", *changes])


@pytest.fixture(scope="session")
def barcode_videos(tmp_path_factory):
    """Barcoded test videos in several containers and codecs: {name: (path, frame count)}."""
    root = tmp_path_factory.mktemp("barcode")
    n = 400
    videos = {
        # the common camera case: H.264, B-frames, a 250-frame GOP, no scene-cut keyframes
        "h264_bframes_mp4": write_with_pyav(
            str(root / "h264.mp4"),
            n,
            "libx264",
            gop=250,
            bframes=3,
            options={"bf": "3", "g": "250", "keyint_min": "250", "sc_threshold": "0", "crf": "18"},
        ),
        "mpeg4_avi": write_with_opencv(str(root / "mpeg4.avi"), n, "XVID"),
        "h264_mkv": write_with_pyav(
            str(root / "h264.mkv"), n, "libx264", gop=120, bframes=2, options={"bf": "2", "g": "120", "crf": "18"}
        ),
        "vp9_webm": write_with_pyav(str(root / "vp9.webm"), n, "libvpx-vp9", gop=100),
    }
    return {name: (path, n) for name, path in videos.items()}


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory):
    from datasets.synthetic import generate

    root = tmp_path_factory.mktemp("synthetic") / "data"
    generate(
        str(root),
        seed=3,
        size=32,
        num_train=18,
        num_val=6,
        num_test=6,
        short_frames=20,
        num_long=1,
        long_frames=300,
        num_multiview=6,
        quiet=True,
    )
    return str(root)


@pytest.fixture
def tiny_cfg(synthetic_root, tmp_path):
    """A validated config for fast CPU runs on the small synthetic dataset."""
    from config import load_config

    return load_config(
        None,
        [
            f"data.data_dir={synthetic_root}",
            f"trainer.output_dir={tmp_path / 'runs'}",
            "data.img_size=32",
            "data.num_frames=8",
            "data.frame_stride=2",
            "data.batch_size=4",
            "data.num_workers=0",
            "data.sample_timeout_s=null",
            "model.width=8",
            "trainer.device=cpu",
            "train.max_epochs=1",
            "trainer.log_every=1",
        ],
    )


BASE_CONFIG = os.path.join(ROOT, "configs", "base.yaml")


def overrides(synthetic_root, out, *extra):
    """A small CPU run's flags. Samples load in this process (num_workers 0, no sample deadline, which would move
    them to a worker): tests that want workers or the deadline say so in ``extra``."""
    args = ["--config", BASE_CONFIG]
    for item in (
        f"data.data_dir={synthetic_root}",
        f"trainer.output_dir={out}",
        "data.img_size=32",
        "data.num_frames=8",
        "data.frame_stride=2",
        "data.batch_size=4",
        "data.num_workers=0",
        "data.sample_timeout_s=null",
        "model.width=8",
        "trainer.device=cpu",
        "train.max_epochs=2",
        "trainer.log_every=1",
        "trainer.plots=false",  # tests that look at the plots turn them on
        "experiment=e2e",
        *extra,
    ):
        args += ["--set", item]
    return args


@pytest.fixture(scope="session")
def trained_run(synthetic_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    import train

    assert (
        train.main(overrides(synthetic_root, out, "infer.chunk_size=4", "infer.chunk_overlap=1", "trainer.plots=true"))
        == 0
    )
    return os.path.realpath(os.path.join(out, "e2e", "latest")), out


# ------------------------------------------------------------------------------------------------ a real disk
@pytest.fixture
def small_disk(tmp_path):
    """A 24 MB tmpfs that really fills; skipped where it cannot be mounted (not root, no mount permission)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the writers are covered by failing writes instead")
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({result.stderr.strip()}); the writers are covered by failing writes instead"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk, leave: int) -> str:
    """Fill ``disk`` until ``leave`` bytes are free; returns the filler's path (remove it to free the space)."""
    path = os.path.join(disk, "filler")
    with open(path, "ab") as f:
        free = shutil.disk_usage(disk).free
        f.write(b"\0" * max(0, free - leave))
    return path


def full_during(monkeypatch, disk, owner, name: str, nth: int = 1) -> list:
    """``owner.name`` (a writer) finds ``disk`` full from its ``nth`` call on: the disk is filled just before that
    call and freed just after it, so the writer meets a real ENOSPC at the moment it writes and nothing else does.
    Returns the list of calls made (one entry each)."""
    real, calls = getattr(owner, name), []

    def writer(*args, **kwargs):
        calls.append(1)
        if len(calls) < nth:
            return real(*args, **kwargs)
        filler = fill(disk, 0)
        try:
            return real(*args, **kwargs)
        finally:
            os.unlink(filler)

    monkeypatch.setattr(owner, name, writer)
    return calls
