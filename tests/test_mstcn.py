"""MS-TCN's layout of an action segmentation dataset (datasets/mstcn.py): read in place to train and score a head
(data.features_format: mstcn, engine.evaluation.cross_validation), written by infer_chunked.py --features
--features-layout, read back identically and the way MS-TCN's own batch_gen.py reads it, and malformed files
refused with one line naming the file and the line."""

import json
import os
import subprocess

import numpy as np
import pytest
from conftest import run_in_process

from datasets.manifest import read_manifest
from datasets.mstcn import MsTcnVideos, bundle_names, read_mapping
from datasets.sample import SAMPLE_KEYS
from datasets.segmentation_task import generate_features
from engine.data.feature_files import FeaturesDataset, index_features

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "configs", "mstcn.yaml")


def run(*args):
    return run_in_process(list(args))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """6 videos of 160 frames, 16 features a frame, 2 splits of 3 test videos each, background as class 0."""
    return generate_features(str(tmp_path_factory.mktemp("mstcn") / "data"), videos=6, frames=160, dim=16, quiet=True)


def test_the_generated_set_is_in_ms_tcns_layout_with_a_background_class(dataset):
    assert sorted(os.listdir(dataset)) == ["features", "groundTruth", "mapping.txt", "splits"]
    assert open(os.path.join(dataset, "mapping.txt")).readline() == "0 background\n"
    assert sorted(os.listdir(os.path.join(dataset, "splits"))) == [
        f"{part}.split{n}.bundle" for part in ("test", "train") for n in (1, 2)
    ]
    test1, train1 = bundle_names(dataset, "test", 1), bundle_names(dataset, "train", 1)
    assert (
        len(test1) == 3
        and not set(test1) & set(train1)
        and set(test1) | set(train1) == set(bundle_names(dataset, "test", 1) + bundle_names(dataset, "test", 2))
    )
    features = np.load(os.path.join(dataset, "features", f"{test1[0]}.npy"))
    labels = open(os.path.join(dataset, "groundTruth", f"{test1[0]}.txt")).read().split("\n")[:-1]
    assert features.shape == (16, 160) and features.dtype == np.float32 and len(labels) == 160
    assert any("background" in open(os.path.join(dataset, "groundTruth", f"{n}.txt")).read() for n in test1 + train1)


def test_a_video_reads_as_ms_tcn_reads_it_every_sample_rate_th_frame_and_scored_on_every_frame(dataset):
    name = bundle_names(dataset, "train", 1)[0]
    classes = read_mapping(dataset)
    sample = MsTcnVideos(dataset, [name], classes, sample_rate=2)[0]
    features = np.load(os.path.join(dataset, "features", f"{name}.npy"))
    truth = [classes.index(line) for line in open(os.path.join(dataset, "groundTruth", f"{name}.txt")).read().split()]
    np.testing.assert_array_equal(sample["features"].numpy(), features[:, ::2].T)
    assert sample["chunk_labels"].tolist() == truth[::2] and sample["frame_labels"].tolist() == truth
    assert sample["windows"][:3].tolist() == [[0, 2], [2, 4], [4, 6]] and sample["windows"][-1].tolist() == [158, 160]


@pytest.fixture(scope="module")
def documented(tmp_path_factory):
    """docs/timelines.md's MS-TCN commands, run as written in a fresh workspace (doc_commands.py): the generated
    set, its cross-validation over 2 splits, eval.py on split 1's head."""
    from doc_commands import bash_blocks, fresh_workspace  # the docs commands run as written
    from doc_commands import run as run_as_written

    folder = fresh_workspace(tmp_path_factory)
    commands = bash_blocks("docs/timelines.md", "## MS-TCN's datasets: Breakfast, 50Salads, GTEA")[:3]
    assert commands[1].startswith("python -m engine.evaluation.cross_validation --config configs/mstcn.yaml")
    results = [run_as_written(command, folder) for command in commands]
    for command, result in zip(commands, results):
        assert result.returncode == 0, (command, result.stderr[-2000:])
    return folder, commands, results, run_as_written


def test_cross_validation_trains_every_split_and_reports_the_papers_columns_and_the_mean(documented):
    folder, _, _, _ = documented
    out = folder / "runs" / "segmentation" / "mstcn"
    summary = json.loads((out / "segmentation.json").read_text())
    assert sorted(summary["splits"]) == ["1", "2"]
    columns = ["F1@10", "F1@25", "F1@50", "Edit", "Acc"]
    for split in ("1", "2"):
        row = summary["splits"][split]
        assert list(row) == columns
        # the model at the end of training, scored on the split's 6 test videos: its run's last validation
        last = (out / "runs" / f"split{split}" / "latest" / "metrics.csv").read_text().splitlines()
        header, values = last[0].split(","), last[-1].split(",")
        assert values[header.index("epoch")] == "20" and values[header.index("val_num_clips")] == "6"
        assert row["Acc"] == pytest.approx(100 * float(values[header.index("val_seg_frame_acc")]))
        assert row["F1@50"] == pytest.approx(float(values[header.index("val_seg_f1@50")]))
    for column in columns:
        assert summary["mean"][column] == pytest.approx(
            (summary["splits"]["1"][column] + summary["splits"]["2"][column]) / 2
        )
    # 10 classes; a frame tells its look (3 of them), its label needs the look before: about half, per frame
    assert summary["mean"]["Acc"] > 55, summary["mean"]
    table = (out / "segmentation.md").read_text()
    assert "| split | videos (train / test) | F1@10 | F1@25 | F1@50 | Edit | Acc |" in table
    assert "| 1 | 6 / 6 |" in table and "| mean | 2 splits |" in table


def test_eval_py_scores_a_split_head_as_its_row_and_a_rerun_trains_nothing_again(documented):
    folder, commands, results, run_as_written = documented
    summary = json.loads((folder / "runs" / "segmentation" / "mstcn" / "segmentation.json").read_text())
    line = next(x for x in results[2].stdout.splitlines() if x.startswith("timelines"))
    assert f"frame acc {summary['splits']['1']['Acc'] / 100:.4f}" in line
    assert f"F1@50 {summary['splits']['1']['F1@50']:.1f}" in line
    again = run_as_written(commands[1], folder)
    assert again.returncode == 0 and again.stdout.count("trained already") == 2
    assert json.loads((folder / "runs" / "segmentation" / "mstcn" / "segmentation.json").read_text()) == summary
    last = folder / "runs" / "segmentation" / "mstcn" / "runs" / "split1" / "latest" / "checkpoints" / "last.pt"
    refused = run("infer_chunked.py", "--checkpoint", str(last), "--input", str(folder / "data" / "mstcn"))
    assert refused.returncode == 2 and "has no backbone to run videos with; eval.py" in refused.stderr


def test_each_datasets_preset_runs_as_documented_on_that_datasets_labels(tmp_path_factory):
    """docs/timelines.md's per-dataset commands, as written: the generated set with Breakfast's, 50Salads' and
    GTEA's label conventions, each cross-validated with its preset; GTEA's preset on Breakfast's labels is refused
    in one line before the first step."""
    from doc_commands import bash_blocks, fresh_workspace
    from doc_commands import run as run_as_written

    folder = fresh_workspace(tmp_path_factory)
    commands = bash_blocks("docs/timelines.md", "## MS-TCN's datasets: Breakfast, 50Salads, GTEA")[3:]
    assert len(commands) == 6
    for command in commands:
        result = run_as_written(command, folder)
        assert result.returncode == 0, (command, result.stderr[-2000:])
    first_and_last = {"breakfast": ("SIL", "SIL"), "50salads": ("action_start", "action_end"), "gtea": (None, None)}
    for name, (first, last) in first_and_last.items():
        root = folder / "data" / name
        classes = read_mapping(str(root))
        assert classes[0] == "SIL" if name == "breakfast" else classes[-1] in ("action_end", "background")
        labels = (root / "groundTruth" / "video_000.txt").read_text().splitlines()
        assert (labels[0], labels[-1]) == (first, last) or first is None
        summary = json.loads((folder / "runs" / "segmentation" / name / "segmentation.json").read_text())
        assert summary["config"] == f"configs/mstcn-{name}.yaml" and list(summary["splits"]) == ["1"]
    wrong = run_as_written(
        "python -m engine.evaluation.cross_validation --config configs/mstcn-gtea.yaml --root data/breakfast --splits 1 "
        "--out runs/wrong --set train.max_epochs=2",
        folder,
    )
    errors = [line for line in wrong.stderr.splitlines() if line.startswith("error:")]
    assert wrong.returncode == 2 and len(errors) == 1 and "Traceback" not in wrong.stderr, wrong.stderr
    assert "data.background_labels names background, not a class of this model (SIL, red," in errors[0]


def test_label_files_as_distributed_read_as_ms_tcn_reads_them(dataset, tmp_path):
    """Windows line ends, blank lines at the end of a ground truth, and a mapping with the background last (as
    GTEA's) or first (as Breakfast's): the same labels, by name, as the files written plainly."""
    from datasets.mstcn import read_ground_truth

    root = broken_copy(dataset, tmp_path)
    name = bundle_names(dataset, "train", 1)[0]
    classes = read_mapping(dataset)
    plain = [classes[i] for i in read_ground_truth(dataset, name, {c: i for i, c in enumerate(classes)})]
    reordered = [*classes[1:], classes[0]]  # background last
    (root / "mapping.txt").write_bytes("".join(f"{i} {c}\r\n" for i, c in enumerate(reordered)).encode())
    path = root / "groundTruth" / f"{name}.txt"
    path.write_bytes(("\r\n".join(plain) + "\r\n\r\n\r\n").encode())
    assert read_mapping(str(root)) == reordered
    read = read_ground_truth(str(root), name, {c: i for i, c in enumerate(reordered)})
    assert [reordered[i] for i in read] == plain
    lines = plain[:10] + [""] + plain[11:]  # a blank line inside is still an error, named
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(Exception, match=rf"{path} line 11: label '' is not in"):
        read_ground_truth(str(root), name, {c: i for i, c in enumerate(reordered)})


def broken_copy(dataset, tmp_path):
    root = tmp_path / "broken"
    subprocess.run(["cp", "-r", dataset, str(root)], check=True)
    return root


def train_error(root, tmp_path) -> str:
    done = run(
        "train.py",
        "--config",
        PRESET,
        "--set",
        f"data.features_dir={root}",
        "--set",
        f"trainer.output_dir={tmp_path / 'runs'}",
        "--set",
        "train.max_epochs=1",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]] and "Traceback" not in done.stderr, done.stderr  # the log's lines, then one
    return errors[0]


def test_a_ground_truth_shorter_than_its_features_names_both_files(dataset, tmp_path):
    root = broken_copy(dataset, tmp_path)
    name = bundle_names(str(root), "train", 1)[1]
    path = root / "groundTruth" / f"{name}.txt"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-5]))
    error = train_error(root, tmp_path)
    assert f"{path}: 155 lines for the 160 frames of {root}/features/{name}.npy" in error


def test_a_label_missing_from_mapping_txt_names_the_file_and_line(dataset, tmp_path):
    root = broken_copy(dataset, tmp_path)
    name = bundle_names(str(root), "test", 1)[0]
    path = root / "groundTruth" / f"{name}.txt"
    lines = path.read_text().splitlines(keepends=True)
    lines[41] = "purple\n"
    path.write_text("".join(lines))
    error = train_error(root, tmp_path)
    assert f"{path} line 42: label 'purple' is not in {root}/mapping.txt; add it there or correct the line" in error


def test_a_bundle_naming_a_missing_file_names_the_bundle_and_line(dataset, tmp_path):
    root = broken_copy(dataset, tmp_path)
    bundle = root / "splits" / "train.split1.bundle"
    bundle.write_text(bundle.read_text() + "video_999.txt\n")
    error = train_error(root, tmp_path)
    assert f"{bundle} line 4: 'video_999.txt' has no {root}/groundTruth/video_999.txt" in error
    missing_split = run("-m", "engine.evaluation.cross_validation", "--root", str(root), "--splits", "3")
    assert missing_split.returncode == 2 and f"{root}/splits has no split 3 (it has [1, 2])" in missing_split.stderr


def test_a_malformed_mapping_line_is_named(dataset, tmp_path):
    root = broken_copy(dataset, tmp_path)
    (root / "mapping.txt").write_text("0 background\n1 red green\n")
    assert f"{root}/mapping.txt line 2: '1 red green' is not 'index label'" in train_error(root, tmp_path)


@pytest.fixture(scope="module")
def written(trained_run, synthetic_root, tmp_path_factory):
    """The synthetic set's long video (with segments) through infer_chunked.py --features in both layouts."""
    out = tmp_path_factory.mktemp("both")
    manifest = os.path.join(synthetic_root, "long.jsonl")
    best = os.path.join(trained_run[0], "checkpoints", "best.pt")
    args = ["--checkpoint", best, "--input", manifest, "--chunk", "12", "--overlap", "4", "--features", str(out)]
    args += ["--features-layout", "both", "--features-dtype", "float32", "--features-bundle", "test.split1"]
    done = run("infer_chunked.py", *args)
    assert done.returncode == 0, done.stderr[-2000:]
    return str(out), manifest, args, done


def test_our_features_round_trip_through_ms_tcns_layout_identically(written):
    out, manifest, _, done = written
    assert "splits/test.split1.bundle lists 1 of the 1 videos, mapping.txt its classes" in done.stdout
    records = read_manifest(manifest)
    files, _ = index_features(out)
    classes = [line.split()[1] for line in open(os.path.join(out, "mapping.txt")).read().splitlines()]
    ours = FeaturesDataset(records, files, classes[:-1], "val", out)[0]  # the classes, then background
    assert classes[-1] == "background"
    name = bundle_names(out, "test", 1)[0]
    back = MsTcnVideos(out, [name], read_mapping(out), sample_rate=1)[0]
    assert set(ours) == set(back) and set(ours) <= SAMPLE_KEYS  # the sample type's keys, the same from both
    np.testing.assert_array_equal(back["features"].numpy(), ours["features"].numpy())
    covered = ours["chunk_labels"] >= 0
    assert covered.any()
    assert back["chunk_labels"][covered].tolist() == ours["chunk_labels"][covered].tolist()
    assert (back["chunk_labels"][~covered] == len(classes) - 1).all()  # no segment: background


def test_the_written_layout_loads_in_ms_tcns_own_loader_code_unchanged(written):
    """What MS-TCN's main.py and batch_gen.py do with a dataset folder, line for line."""
    out, _, _, _ = written
    features_path, gt_path, sample_rate = out + "/features/", out + "/groundTruth/", 1
    file_ptr = open(out + "/mapping.txt")
    actions = file_ptr.read().split("\n")[:-1]
    actions_dict = {a.split()[1]: int(a.split()[0]) for a in actions}
    list_of_examples = open(out + "/splits/test.split1.bundle").read().split("\n")[:-1]
    assert list_of_examples
    for vid in list_of_examples:
        features = np.load(features_path + vid.split(".")[0] + ".npy")
        content = open(gt_path + vid).read().split("\n")[:-1]
        classes = np.zeros(min(np.shape(features)[1], len(content)))
        for i in range(len(classes)):
            classes[i] = actions_dict[content[i]]
        assert features[:, ::sample_rate].shape[1] == len(content) == len(classes) > 1
        assert features.dtype == np.float32 and features.shape[0] > 1


def test_a_rerun_of_both_layouts_skips_and_ms_tcns_alone_recomputes(written, tmp_path):
    out, _, args, _ = written
    again = run("infer_chunked.py", *args)
    assert again.returncode == 0 and "1 skipped (already there)" in again.stdout
    alone = [a if a != "both" else "mstcn" for a in args]
    alone[alone.index("--features") + 1] = str(tmp_path / "alone")
    first, second = run("infer_chunked.py", *alone), run("infer_chunked.py", *alone)
    assert first.returncode == second.returncode == 0
    assert "records no settings" in second.stdout and not list((tmp_path / "alone").glob("*.npz"))
