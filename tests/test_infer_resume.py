"""infer_chunked.py --output over many videos: killed (kill -9) mid-run and run again, every video is written once,
and the files equal an uninterrupted run's; a rerun with other settings is refused in one line; the CSV holds the
JSON lines' predictions."""

import csv
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, error_lines, run_python

# infer_chunked.py with a kill -9 at the chosen write: the JSON line of the DIE_AT-th video is never written, while
# its frame rows (written before it) are
KILLED_RUN = r"""
import os, signal, sys
import engine.inference.video_outputs as outputs
import infer_chunked

real, lines = outputs.append_whole, []

def append_whole(path, data):
    if path.endswith(".jsonl"):
        lines.append(path)
        if len(lines) == int(os.environ["DIE_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
    real(path, data)

outputs.append_whole = append_whole
sys.argv = ["infer_chunked.py", *sys.argv[1:]]
sys.exit(infer_chunked.main())
"""


@pytest.fixture(scope="module")
def videos(synthetic_root, tmp_path_factory):
    """A manifest of 13 videos: the val and test clips and the long annotated one (timeline scores)."""
    manifest = tmp_path_factory.mktemp("resume") / "videos.jsonl"
    lines = []
    for name in ("val.jsonl", "long.jsonl", "test.jsonl"):
        for line in open(os.path.join(synthetic_root, name)):
            entry = json.loads(line)
            entry["video"] = os.path.join(synthetic_root, entry["video"])
            lines.append(json.dumps(entry))
    manifest.write_text("\n".join(lines) + "\n")
    return str(manifest), [json.loads(line)["video"] for line in lines]


def infer(checkpoint, manifest, output, *extra, killed_at=None):
    args = ["--checkpoint", checkpoint, "--input", manifest, "--timeline", "--output", str(output), *extra]
    if killed_at is None:
        return run_python(["infer_chunked.py", *args])
    env = {**os.environ, "DIE_AT": str(killed_at), "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def without_timings(path):
    rows = [json.loads(line) for line in open(path)]
    for row in rows:
        row.pop("decode_s"), row.pop("compute_s")
    return rows


def test_a_killed_run_goes_on_where_it_stopped_and_writes_every_video_once(trained_run, videos, tmp_path):
    run_dir, _ = trained_run
    checkpoint = os.path.join(run_dir, "checkpoints", "best.pt")
    manifest, paths = videos
    whole = infer(checkpoint, manifest, tmp_path / "whole.jsonl")
    assert whole.returncode == 0, whole.stderr
    for die_at in (8, 3):  # after the long video, and before it
        out = tmp_path / f"killed_{die_at}.jsonl"
        killed = infer(checkpoint, manifest, out, killed_at=die_at)
        assert killed.returncode == -signal.SIGKILL
        assert len(open(out).readlines()) == die_at - 1
        frame_videos = {row["video"] for row in csv.DictReader(open(tmp_path / f"killed_{die_at}_frames.csv"))}
        assert len(frame_videos) == die_at  # the killed video's frame rows were written, its JSON line not
        again = infer(checkpoint, manifest, out)
        assert again.returncode == 0, again.stderr
        assert f"resuming: {die_at - 1} videos are in {out} already; they are skipped" in again.stdout
        assert [row["video"] for row in without_timings(out)] == paths  # every video once, in order
        assert without_timings(out) == without_timings(tmp_path / "whole.jsonl")
        for suffix in (".csv", "_frames.csv", "_scores.json"):
            stem = str(out)[: -len(".jsonl")]
            assert open(stem + suffix).read() == open(str(tmp_path / "whole") + suffix).read(), suffix


def test_a_torn_last_line_and_a_failed_video_run_again(trained_run, videos, tmp_path):
    run_dir, _ = trained_run
    checkpoint = os.path.join(run_dir, "checkpoints", "best.pt")
    manifest, paths = videos
    out = tmp_path / "p.jsonl"
    assert infer(checkpoint, manifest, out, "--max-videos", "4").returncode == 0
    rows = open(out).readlines()
    failed = json.dumps({"video": paths[1], "error": "cannot read it (a stalled mount)"}) + "\n"
    out.write_text(rows[0] + failed + "".join(rows[2:3]) + rows[3][:20])  # video 2 failed, video 4 cut short
    again = infer(checkpoint, manifest, out, "--max-videos", "5")
    assert again.returncode == 0, again.stderr
    assert "resuming: 2 videos are in" in again.stdout
    assert sorted(row["video"] for row in without_timings(out)) == sorted(paths[:5])
    assert all("error" not in row for row in without_timings(out))


def test_a_rerun_with_other_settings_is_refused_and_the_csv_holds_the_predictions(trained_run, videos, tmp_path):
    run_dir, _ = trained_run
    checkpoint = os.path.join(run_dir, "checkpoints", "best.pt")
    manifest, _ = videos
    out = tmp_path / "p.jsonl"
    assert infer(checkpoint, manifest, out, "--max-videos", "3", "--topk", "2").returncode == 0
    before = open(out).read()
    other = infer(checkpoint, manifest, out, "--max-videos", "3", "--topk", "2", "--chunk", "6")
    assert other.returncode == 2
    assert error_lines(other.stderr) == [
        f"error: --output {out}: holds 3 videos of another run (its chunk differ from this run's); give another "
        f"--output, or delete the file to start over"
    ]
    assert open(out).read() == before  # nothing the user had is lost
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert list(rows[0]) == ["video", "label", "predicted", "probability", "predicted_2", "probability_2"]
    for row, line in zip(rows, map(json.loads, open(out)), strict=True):
        assert row["video"] == line["video"] and row["label"] == line["label"]
        assert [row["predicted"], row["predicted_2"]] == [t["label"] for t in line["topk"]]
        assert [float(row["probability"]), float(row["probability_2"])] == [t["prob"] for t in line["topk"]]
    assert infer(checkpoint, manifest, tmp_path / "p.csv").returncode == 2  # --output names the JSON lines file
