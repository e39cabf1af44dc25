import ast
import os

import pytest
import torch
import yaml
from conftest import run_in_process, run_python

from config import ALL_KEYS, SCHEMA, ConfigError, defaults, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml"))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, "x.yaml", "data:\n  batch_szie: 4\n")
    assert error_of(path) == f"{path}: unknown key 'data.batch_szie'; did you mean 'data.batch_size'?"


def test_unknown_key_in_the_wrong_section_suggests_the_right_one(tmp_path):
    path = write(tmp_path, "x.yaml", "model:\n  max_video_frames: 100\n")
    assert error_of(path) == f"{path}: unknown key 'model.max_video_frames'; did you mean 'data.max_video_frames'?"


def test_unknown_key_reports_the_inheriting_file_not_the_base(tmp_path):
    write(tmp_path, "base.yaml", "data:\n  batch_size: 4\n")
    child = write(tmp_path, "child.yaml", "base: base.yaml\ninfer:\n  chunk_agregation: mean\n")
    assert error_of(child) == f"{child}: unknown key 'infer.chunk_agregation'; did you mean 'infer.chunk_aggregation'?"


def test_wrong_type_and_impossible_values(tmp_path):
    path = write(tmp_path, "x.yaml", "data:\n  batch_size: -4\n")
    assert error_of(path) == f"{path}: data.batch_size must be an integer >= 1 (or auto), got -4"
    path = write(tmp_path, "y.yaml", "data:\n  batch_size: four\n")
    assert error_of(path) == f"{path}: data.batch_size must be an integer >= 1 (or auto), got 'four'"
    path = write(tmp_path, "z.yaml", "infer:\n  chunk_size: 0\n")
    assert error_of(path) == f"{path}: infer.chunk_size must be an integer >= 1 (or -1), got 0"


def test_overlap_must_be_smaller_than_chunk(tmp_path):
    path = write(tmp_path, "x.yaml", "infer:\n  chunk_size: 32\n  chunk_overlap: 32\n")
    assert error_of(path) == (
        f"{path}: infer.chunk_overlap=32 must be smaller than infer.chunk_size=32 "
        f"(or set chunk_size: -1 for no chunking)"
    )
    # -1 means no chunking: any overlap is irrelevant and allowed
    assert load_config(write(tmp_path, "y.yaml", "infer:\n  chunk_size: -1\n  chunk_overlap: 8\n"))


def test_choice_error_lists_the_choices(tmp_path):
    path = write(tmp_path, "x.yaml", "infer:\n  chunk_aggregation: avg\n")
    assert error_of(path) == f"{path}: infer.chunk_aggregation: 'avg' is not one of mean, max, last, prob"


def test_unknown_backbone_lists_the_registered_ones(tmp_path):
    path = write(tmp_path, "x.yaml", "model:\n  backbone: resnet9000\n")
    message = error_of(path)
    assert message.startswith(f"{path}: model.backbone: unknown model 'resnet9000'; known: ")
    assert "tiny3d" in message and "r3d_18" in message


def test_set_overrides_are_typed_by_yaml_and_checked():
    cfg = load_config(
        None,
        ["data.batch_size=8", "data.img_size=[120, 160]", "trainer.precision=bf16-mixed", "data.max_video_frames=null"],
    )
    assert cfg.data.batch_size == 8
    assert cfg.data.img_size == [120, 160]
    assert cfg.trainer.precision == "bf16"
    assert cfg.data.max_video_frames is None
    assert (
        error_of(None, ["data.batch_size=-1"])
        == "--set data.batch_size=-1: data.batch_size must be an integer >= 1 (or auto), got -1"
    )
    assert (
        error_of(None, ["data.batch_size"]) == "--set data.batch_size: expected KEY=VALUE, e.g. --set data.batch_size=8"
    )


def test_precision_aliases_and_use_amp():
    for given, normal in (("16-mixed", "16"), (16, "16"), ("bf16-mixed", "bf16"), (32, "32"), ("32-true", "32")):
        assert load_config(None, [f"trainer.precision={given}"]).trainer.precision == normal
    assert load_config(None, use_amp=True).trainer.precision == "amp"
    assert (
        error_of(None, ["trainer.precision=8"])
        == "--set trainer.precision=8: trainer.precision: 8 is not one of 32, 16, bf16, 16-mixed, bf16-mixed, amp"
    )


def test_inheritance_deep_merges_and_detects_loops(tmp_path):
    write(tmp_path, "parent.yaml", "data:\n  batch_size: 4\n  num_frames: 8\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\ndata:\n  batch_size: 2\n")
    cfg = load_config(child)
    assert (cfg.data.batch_size, cfg.data.num_frames, cfg.data.img_size) == (2, 8, [112, 112])
    a = write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: a.yaml\n")
    assert "inheritance loops back" in error_of(a)


def test_missing_and_invalid_yaml(tmp_path):
    assert (
        error_of(str(tmp_path / "nope.yaml"))
        == f"{tmp_path / 'nope.yaml'}: config file not found; presets live in configs/ (e.g. configs/quickstart.yaml)"
    )
    path = write(tmp_path, "bad.yaml", "data:\n  batch_size: [1, 2\n")
    assert error_of(path).startswith(f"{path}: line ")


def test_base_yaml_is_the_schema_written_out_with_every_keys_meaning():
    from config.reference import base_yaml

    with open(os.path.join(ROOT, "configs", "base.yaml")) as f:
        text = f.read()
    assert text == base_yaml(), "configs/base.yaml differs from the schema: run python -m config.reference"
    assert yaml.safe_load(text) == defaults()
    lines = text.splitlines()
    at = lines.index("  chunk_loss: clip")  # a choice: its meaning and values in the comment above it
    assert lines[at - 1].endswith("(one of clip, dense)") and lines[at - 2].startswith("  # clip: one loss per clip")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_validates_and_states_its_memory_budget(preset):
    path = os.path.join(ROOT, "configs", preset)
    cfg = load_config(path)
    assert set(cfg.to_dict()) == set(SCHEMA)
    if preset != "base.yaml":
        assert "memory budget" in open(path).read().lower()


def test_rtx5080_preset_has_the_documented_shape():
    cfg = load_config(os.path.join(ROOT, "configs", "rtx5080.yaml"))
    assert cfg.data.img_size == [160, 210]
    assert (cfg.data.num_frames, cfg.data.batch_size, cfg.trainer.precision) == (40, 12, "16")


def test_print_config_prints_the_resolved_config_and_exits_0():
    result = run_in_process(
        ["train.py", "--config", "configs/rtx5080.yaml", "--use_amp", "--set", "data.batch_size=3", "--print-config"]
    )
    assert result.returncode == 0, result.stderr
    cfg = yaml.safe_load(result.stdout)
    assert cfg["data"]["batch_size"] == 3 and cfg["trainer"]["precision"] == "amp"


def test_cli_config_error_is_one_line_and_exit_code_2(tmp_path):
    path = write(
        tmp_path, "x.yaml", "base: " + os.path.join(ROOT, "configs", "base.yaml") + "\ndata:\n  batch_szie: 4\n"
    )
    result = run_in_process(["train.py", "--config", path])
    assert result.returncode == 2
    assert result.stderr == f"error: {path}: unknown key 'data.batch_szie'; did you mean 'data.batch_size'?\n"
    assert result.stdout == ""
    # the tests' in-process runs report as the script's own process does: the same code, output and exit code
    for args in (["train.py", "--config", path], ["eval.py", "--chekpoint", "x"], ["train.py", "--print-config"]):
        alone, here = run_python(args), run_in_process(args)
        assert (here.returncode, here.stdout, here.stderr) == (alone.returncode, alone.stdout, alone.stderr), args


def test_the_pyav_decoder_without_pyav_installed_is_a_config_error(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "av" else real_find_spec(name, *a)
    )
    path = write(tmp_path, "x.yaml", "data:\n  decoder: pyav\n")
    assert error_of(path) == (
        f"{path}: data.decoder: pyav needs PyAV, which is not installed; pip install av, or set data.decoder: opencv"
    )
    assert load_config(path, ["data.load_rgb=false", "data.load_kpt=true", "model.input_type=kpt"])  # no video


def test_a_renamed_key_keeps_working_under_its_old_name_with_a_notice(tmp_path, caplog):
    import logging  # only this test reads the log

    path = write(tmp_path, "old.yaml", "data:\n  max_video_frames: 100\n  video_chunk_overlap: 20\n")
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        cfg = load_config(path, ["data.video_chunk_overlap=30"])
    assert cfg.data.sample_window_overlap == 30 and not hasattr(cfg.data, "video_chunk_overlap")
    notices = [r.getMessage() for r in caplog.records]
    assert notices == [
        f"{path}: data.video_chunk_overlap is now called data.sample_window_overlap (the old name still works)",
        "--set data.video_chunk_overlap=30: data.video_chunk_overlap is now called "
        "data.sample_window_overlap (the old name still works)",
    ]
    # its errors name the new key where it came from
    assert error_of(write(tmp_path, "bad.yaml", "data:\n  max_video_frames: 10\n  video_chunk_overlap: 10\n")) == (
        f"{tmp_path}/bad.yaml: data.sample_window_overlap=10 must be smaller than data.max_video_frames=10"
    )
    assert "are the same key" in error_of(
        write(tmp_path, "both.yaml", "data:\n  video_chunk_overlap: 1\n  sample_window_overlap: 2\n")
    )


def test_a_removed_key_is_one_line_naming_what_became_of_it(tmp_path, caplog):
    """A preset with a key that no longer exists: at the value every run now has, said once and the run goes on; at
    another value, one line naming it and what became of it (exit 2 from the scripts); a checkpoint's config at the
    fixed value is read silently."""
    import logging

    from config import saved_config

    path = write(tmp_path, "old.yaml", "model:\n  temporal_head: transformer\n  temporal_contrast: true\n")
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        cfg = load_config(path)
    assert cfg.model.temporal_head == "transformer"
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: model.temporal_contrast was removed (the transformer head always sees each chunk's contrast); "
        f"the key can go"
    ]
    other = write(tmp_path, "other.yaml", "model:\n  temporal_contrast: false\n")
    assert error_of(other) == (
        f"{other}: model.temporal_contrast was removed (the transformer head always sees each chunk's contrast), so "
        f"model.temporal_contrast: False cannot be honoured; remove the key"
    )
    result = run_python(["train.py", "--config", "configs/cpu.yaml", "--set", "model.dropout=0.5", "--print-config"])
    assert result.returncode == 2 and result.stderr == (
        "error: --set model.dropout=0.5: model.dropout was removed (the classifier has no dropout), so "
        "model.dropout: 0.5 cannot be honoured; remove the key\n"
    )
    old = defaults()
    old["train"]["label_smoothing"] = 0.0  # a checkpoint's saved config, from before the key went
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        assert saved_config(old).train.lr == defaults()["train"]["lr"]
    assert not caplog.records


def test_a_checkpoint_config_with_the_old_name_loads_silently(caplog):
    from config import saved_config

    old = defaults()
    old["data"]["video_chunk_overlap"] = old["data"].pop("sample_window_overlap") + 4
    assert saved_config(old).data.sample_window_overlap == 4 and not caplog.records


SEED_GUIDE_INFERENCE_KEYS = {
    "train.chunk_infer_size": ("infer.chunk_size", 32),
    "train.chunk_overlap": ("infer.chunk_overlap", 8),
    "train.chunk_aggregation": ("infer.chunk_aggregation", "max"),
    "train.video_batch_size": ("infer.chunks_per_forward", 3),
}


def test_the_seed_guides_inference_keys_under_train_move_to_the_infer_section_with_a_notice(tmp_path, caplog):
    import logging

    lines = "".join(f"  {old.split('.')[1]}: {value}\n" for old, (_, value) in SEED_GUIDE_INFERENCE_KEYS.items())
    path = write(tmp_path, "seed.yaml", "train:\n  lr: 0.01\n" + lines)
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        cfg = load_config(path, ["model.temporal_window=5"])
    assert (
        cfg.infer.chunk_size,
        cfg.infer.chunk_overlap,
        cfg.infer.chunk_aggregation,
        cfg.infer.chunks_per_forward,
        cfg.infer.head_chunks,
        cfg.train.lr,
    ) == (32, 8, "max", 3, 5, 0.01)
    assert [r.getMessage() for r in caplog.records] == [
        *(
            f"{path}: {old} is now called {new} (the old name still works)"
            for old, (new, _) in SEED_GUIDE_INFERENCE_KEYS.items()
        ),
        "--set model.temporal_window=5: model.temporal_window is now called infer.head_chunks (the old name still "
        "works)",
    ]
    # a --set of an old name overrides the preset's new one, and errors name the new key where it came from
    preset = write(tmp_path, "new.yaml", "infer:\n  chunk_size: 16\n  chunk_overlap: 4\n")
    assert load_config(preset, ["train.chunk_infer_size=8", "train.chunk_overlap=2"]).infer.chunk_size == 8
    with pytest.raises(ConfigError) as info:
        load_config(preset, ["train.chunk_overlap=16"])
    assert str(info.value) == (
        "--set train.chunk_overlap=16: infer.chunk_overlap=16 must be smaller than "
        "infer.chunk_size=16 (or set chunk_size: -1 for no chunking)"
    )
    both = write(tmp_path, "both.yaml", "train:\n  chunk_infer_size: 8\ninfer:\n  chunk_size: 16\n")
    assert error_of(both) == (
        f"{both}: train.chunk_infer_size and infer.chunk_size are the same key (renamed); keep infer.chunk_size"
    )


def test_infer_head_window_is_now_infer_head_chunks_with_a_notice_and_silently_in_a_saved_config(tmp_path, caplog):
    """A window is a frame range; the count of chunks a head sees at once was infer.head_window."""
    import logging

    from config import saved_config

    path = write(tmp_path, "old.yaml", "infer:\n  head_window: 12\n")
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        assert load_config(path).infer.head_chunks == 12
        assert load_config(None, ["infer.head_window=-1"]).infer.head_chunks == -1
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: infer.head_window is now called infer.head_chunks (the old name still works)",
        "--set infer.head_window=-1: infer.head_window is now called infer.head_chunks (the old name still works)",
    ]
    caplog.clear()
    old = defaults()
    old["infer"].pop("head_chunks")
    old["infer"]["head_window"] = 4
    assert saved_config(old).infer.head_chunks == 4 and not caplog.records


def test_ddp_sync_overlap_is_now_during_backward_with_a_notice_and_silently_in_a_saved_config(tmp_path, caplog):
    """Overlap is the frames windows share; the all-reduce during backward was train.ddp_sync: overlap."""
    import logging

    from config import saved_config

    path = write(tmp_path, "old.yaml", "train:\n  ddp_sync: overlap\n")
    with caplog.at_level(logging.WARNING, logger="longvideo"):
        assert load_config(path).train.ddp_sync == "during_backward"
        assert load_config(None, ["train.ddp_sync=agreed"]).train.ddp_sync == "agreed"
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: train.ddp_sync: overlap is now called during_backward (the old value still works)"
    ]
    caplog.clear()
    old = defaults()
    old["train"]["ddp_sync"] = "overlap"
    assert saved_config(old).train.ddp_sync == "during_backward" and not caplog.records


def test_a_checkpoint_config_from_before_the_infer_section_loads_silently_as_it_ran(caplog):
    from config import saved_config

    old = defaults()
    infer = old.pop("infer")
    old["model"]["temporal_window"] = 6
    for old_key, (new_key, value) in SEED_GUIDE_INFERENCE_KEYS.items():
        old["train"][old_key.split(".")[1]] = value
        infer.pop(new_key.split(".")[1])
    assert infer == {"head_chunks": "auto"}  # the section held nothing else
    cfg = saved_config(old)
    assert (
        cfg.infer.chunk_size,
        cfg.infer.chunk_overlap,
        cfg.infer.chunk_aggregation,
        cfg.infer.chunks_per_forward,
        cfg.infer.head_chunks,
    ) == (32, 8, "max", 3, 6)
    assert not caplog.records


SECTION_NAMES = {"model", "data", "train", "infer", "trainer"}
CONFIG_WORDS = SECTION_NAMES | {key.rsplit(".", 1)[-1] for key in ALL_KEYS}


def string_key_reads(source: str) -> list[str]:
    """``cfg["data"]``, ``data_cfg["batch_size"]``, ``run.cfg["train"]``: a config (a name ending in cfg, or a
    section's name) read by a string that is a section or a key. Records and checkpoints (``state["model"]``) are
    other names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and node.slice.value in CONFIG_WORDS
        ):
            continue
        value = node.value
        while isinstance(value, ast.Subscript):
            value = value.value
        name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
        if name.endswith("cfg") or name == "config" or name in SECTION_NAMES:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_config_reads_the_configuration_by_string_keys():
    assert sorted(
        string_key_reads(
            'x = cfg["data"]["batch_size"]\ny = run.cfg["train"]\nz = data_cfg["img_size"]\n'
            'w = state["model"]\nv = record["label"]'
        )
    ) == [
        "line 1: cfg['data']",
        "line 1: cfg['data']['batch_size']",
        "line 2: run.cfg['train']",
        "line 3: data_cfg['img_size']",
    ]
    sources = [
        os.path.join(folder, name)
        for top in ("artifacts", "bench", "core", "datasets", "engine", "models", "planner")
        for folder, _, names in os.walk(os.path.join(ROOT, top))
        for name in names
        if name.endswith(".py")
    ]
    sources += [os.path.join(ROOT, f"{script}.py") for script in ("train", "eval", "infer_chunked")]
    assert len(sources) > 80
    offenders = {
        os.path.relpath(path, ROOT): reads
        for path in sources
        for reads in [string_key_reads(open(path, encoding="utf-8").read())]
        if reads
    }
    assert offenders == {}


def test_config_messages_say_how_to_fix(tmp_path):
    (tmp_path / "child.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "child.yaml"))
    assert str(info.value) == (
        f"{tmp_path / 'child.yaml'}: base: missing.yaml not found ({tmp_path / 'missing.yaml'}); "
        f"a base is resolved relative to the file that names it: fix the 'base:' line, e.g. "
        f"base: base.yaml"
    )
    (tmp_path / "tabs.yaml").write_text("data:\n\tbatch_size: 4\n")
    with pytest.raises(ConfigError, match=r"tabs\.yaml: line 2 is not valid YAML .*; indent with spaces, not tabs$"):
        load_config(str(tmp_path / "tabs.yaml"))


def test_a_val_fraction_that_empties_a_side_is_refused(synthetic_root):
    from datasets.manifest import ManifestError
    from datasets.records import training_records

    data = load_config(None, [f"data.data_dir={synthetic_root}", "data.val_fraction=0.0001"]).data
    with pytest.raises(ManifestError) as info:
        training_records(data)
    assert str(info.value) == (
        "data.val_fraction=0.0001 leaves 18 training and 0 validation videos of 18; choose a fraction that leaves both"
    )


def test_a_global_batch_that_the_processes_cannot_share_is_refused():
    import train
    from core.runtime import Runtime
    from datasets.shape import DataShape
    from planner.batch_size import batch_for_budget

    cfg = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        ["trainer.memory_budget_gb=1", "data.batch_size=auto", "train.global_batch_size=15"],
    )
    with pytest.raises(ConfigError) as info:
        batch_for_budget(cfg, Runtime(torch.device("cpu"), "32", 0, 2), DataShape(6), train.STEP)
    assert str(info.value) == "train.global_batch_size=15 must be a multiple of the 2 processes"


def test_derive_is_a_validated_copy_and_names_why_a_change_is_refused():
    from config import derive

    cfg = load_config(None)
    changed = derive(cfg, {"model.recompute_blocks": True, "infer.chunk_size": 16}, "a test")
    assert (changed.model.recompute_blocks, changed.infer.chunk_size) == (True, 16)
    assert (cfg.model.recompute_blocks, cfg.infer.chunk_size) == (False, -1)  # the original is untouched
    with pytest.raises(ConfigError) as info:
        derive(cfg, {"infer.chunk_size": 8, "infer.chunk_overlap": 8}, "the planner's alternative")
    assert str(info.value) == (
        "the planner's alternative: infer.chunk_overlap=8 must be smaller than "
        "infer.chunk_size=8 (or set chunk_size: -1 for no chunking)"
    )
    with pytest.raises(ConfigError, match="^a test: unknown key 'model.temporal_heads'; did you mean"):
        derive(cfg, {"model.temporal_heads": 2}, "a test")


def test_the_inference_flags_become_overrides_keyed_by_the_config_key_they_set():
    import argparse

    from config import add_inference_flags, inference_overrides

    parser = argparse.ArgumentParser()
    add_inference_flags(parser, clips=True)
    args = parser.parse_args(
        ["--chunk", "16", "--overlap", "4", "--batch", "auto", "--head-chunks", "-1", "--crops", "3"]
    )
    assert inference_overrides(args) == {
        "infer.chunk_size": ("--chunk", 16),
        "infer.chunk_overlap": ("--overlap", 4),
        "infer.head_chunks": ("--head-chunks", -1),
        "data.test_crops": ("--crops", 3),
    }
    assert inference_overrides(parser.parse_args(["--batch", "3"])) == {"infer.chunks_per_forward": ("--batch", 3)}
    with pytest.raises(ConfigError, match=r"^--batch many: expected a number of chunks, or auto$"):
        parser.parse_args(["--batch", "many"])


def test_memory_snapshot_takes_off_as_yaml_writes_it_and_names_its_choices(tmp_path):
    assert load_config(write(tmp_path, "a.yaml", "trainer:\n  memory_snapshot: off\n")).trainer.memory_snapshot == "off"
    assert load_config(None, ["trainer.memory_snapshot=on_oom"]).trainer.memory_snapshot == "on_oom"
    path = write(tmp_path, "b.yaml", "trainer:\n  memory_snapshot: always\n")
    assert error_of(path) == f"{path}: trainer.memory_snapshot: 'always' is not one of off, on_oom"
