"""The temporal head learns long-range tasks with its defaults: small versions of python -m bench.long_range, each
a few training runs of the long-range preset at 16x16 (the slow tests of the head, in a file of their own so that
make test's workers share them)."""

import csv
import os

import torch
from long_range_probes import event_chunks, kinds_apart, linear_probe, train_head_alone
from torch import nn

import train
from config import load_config
from datasets.long_range_tasks import generate_long_range, generate_task
from engine.training.optim import build_optimizer, build_scheduler, max_grad_norm
from models.temporal import temporal_head

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITH_AND_WITHOUT_A_HEAD = {"none": ["model.temporal_head=none"], "transformer": ["model.temporal_head=transformer"]}


def best_accuracy(
    data: str, tmp_path, variants: dict, *settings: str, epochs: int = 10, chunk: int = 16, preset="long-range.yaml"
) -> dict:
    """The best validation accuracy of ``preset`` (the long-range preset unless named; 16x16, chunks of ``chunk``
    clip frames) on ``data`` with ``settings``, for each variant (its name and its own settings)."""
    config = os.path.join(ROOT, "configs", preset)
    experiment = load_config(config, []).experiment  # where train.py writes the run
    accuracy = {}
    for name, changes in variants.items():
        out = tmp_path / name
        args = [
            "--config",
            config,
            "--set",
            f"data.data_dir={data}",
            "--set",
            f"trainer.output_dir={out}",
            "--set",
            f"train.chunk_train_size={chunk}",
            "--set",
            f"infer.chunk_size={chunk}",
            "--set",
            f"train.max_epochs={epochs}",
            "--set",
            "data.img_size=16",
            "--set",
            "trainer.plots=false",
        ] + [item for s in (*settings, *changes) for item in ("--set", s)]
        assert train.main(args) == 0
        with open(os.path.join(out, experiment, "latest", "metrics.csv")) as f:
            accuracy[name] = max(float(row["val_clip_acc"]) for row in csv.DictReader(f))
    return accuracy


def small_family(tmp_path, task: str, videos: int) -> tuple[str, list[str]]:
    """A task family at the small shape of these tests (``videos`` training and 32 validation videos of 320 frames
    at 16x16, events of 8 frames at least 32 apart): its directory and the settings that train on it (the whole
    video at stride 4: 80 clip frames)."""
    data = generate_task(
        str(tmp_path / task),
        task,
        num_train=videos,
        num_val=32,
        frames=320,
        event_frames=8,
        min_gap=32,
        size=16,
        quiet=True,
    )
    settings = [f"data.{split}_manifest={task}_{split}.jsonl" for split in ("train", "val")]
    return data, settings + ["data.class_names=null", "data.num_frames=80"]


def test_on_the_order_task_the_transformer_head_learns_what_mean_pooled_chunks_cannot(tmp_path):
    """A small long-range setup (32 videos of 256 frames at 16x16, the whole video at stride 4 in 4 chunks of 16,
    6 epochs): the order-blind baseline stays near chance, the transformer head learns the order (python -m
    bench.long_range is the full comparison)."""
    data = generate_long_range(
        str(tmp_path / "order"), num_train=32, num_val=32, frames=256, event_frames=16, min_gap=80, size=16, quiet=True
    )
    accuracy = best_accuracy(data, tmp_path, WITH_AND_WITHOUT_A_HEAD, "data.num_frames=64", epochs=6)
    assert accuracy["none"] <= 0.70, accuracy
    assert accuracy["transformer"] >= 0.85 and accuracy["transformer"] >= accuracy["none"] + 0.2, accuracy


def test_at_32_chunks_the_head_learns_the_order_among_distractors(tmp_path):
    """Many short chunks: the first of a red and a green event among 2-4 blue ones (64 videos of 512 frames at
    16x16, the whole video at stride 4 in 32 chunks of 4 clip frames, 5 epochs)."""
    data = generate_task(
        str(tmp_path / "distractors"),
        "distractors",
        num_train=64,
        num_val=32,
        frames=512,
        event_frames=6,
        min_gap=24,
        size=16,
        quiet=True,
    )
    accuracy = best_accuracy(
        data,
        tmp_path,
        {"directional": []},
        "data.train_manifest=distractors_train.jsonl",
        "data.val_manifest=distractors_val.jsonl",
        "data.class_names=null",
        "data.num_frames=128",
        epochs=5,
        chunk=4,
    )
    assert accuracy["directional"] >= 0.75, accuracy


def shared_scene_events(count: int, chunks: int, generator: torch.Generator, scene: torch.Tensor):
    """``count`` clips of ``chunks`` chunk features: every chunk is ``scene`` plus a little noise, and A, B and 2-4
    C events (a unit step in feature 0, 1 or 2) fall on random chunks; the label is 0 when A came before B."""
    features = scene + 0.05 * torch.randn(count, chunks, scene.numel(), generator=generator)
    labels = torch.randint(0, 2, (count,), generator=generator)
    for i in range(count):
        colours = [2] * int(torch.randint(2, 5, (1,), generator=generator))
        first, second = torch.randperm(len(colours) + 2, generator=generator)[:2].sort().values.tolist()
        colours.insert(first, 0 if labels[i] == 0 else 1)
        colours.insert(second, 1 if labels[i] == 0 else 0)
        at = torch.randperm(chunks, generator=generator)[: len(colours)].sort().values
        for chunk, colour in zip(at.tolist(), colours):
            features[i, chunk, colour] += 1.0
    return features, labels


def test_the_head_picks_out_events_from_what_every_chunk_shares():
    """The head alone on chunk features (seconds, no backbone): 64 chunks that all share one feature vector, as the
    chunks of a long video share its scene, with the events of the distractors family added to a few; the label is
    which of A and B came first. With each chunk's contrast against its clip it learns the rule from 96 training
    clips."""
    generator = torch.Generator().manual_seed(0)
    scene = torch.randn(8, generator=generator)
    train_x, train_y = shared_scene_events(96, 64, generator, scene)
    val_x, val_y = shared_scene_events(200, 64, generator, scene)
    windows = torch.stack([torch.arange(64) * 16, torch.arange(64) * 16 + 16], dim=1)
    # the project's optimizer, schedule and clip for a head trained alone (train.lr is its rate): 12 epochs of 12
    # steps, a 1-epoch warm-up
    train_cfg = load_config(
        None, ["train.lr=0.001", "train.weight_decay=0.01", "train.warmup_epochs=1", "train.max_epochs=12"]
    ).train
    torch.manual_seed(0)
    head = temporal_head(8, 2)
    optimizer = build_optimizer(head, train_cfg)
    schedule = build_scheduler(optimizer, train_cfg, steps_per_epoch=12, has_temporal_head=True)
    best = 0.0
    for step in range(144):
        head.train()
        batch = torch.randint(0, 96, (8,))
        loss = nn.functional.cross_entropy(head(train_x[batch], windows).clip, train_y[batch])
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), max_grad_norm(train_cfg, has_temporal_head=True))
        optimizer.step()
        schedule.step()
        if step % 12 == 11:
            head.eval()
            with torch.no_grad():
                best = max(best, (head(val_x, windows).clip.argmax(1) == val_y).float().mean().item())
    assert best >= 0.8, best  # chance: 0.5


def test_the_head_alone_learns_a_relation_between_far_events_from_the_families_clips():
    """A relation family (datasets/long_range_tasks.py: does the last of four events, A, A, B, B, match the
    first's colour), as chunk features without a backbone: the head learns the relation from the 96 clips and 20
    epochs the families train with, at the long-range preset's rate (seconds)."""
    train_cfg = load_config(os.path.join(ROOT, "configs", "long-range.yaml"), ["train.max_epochs=20"]).train
    result = train_head_alone("match", seed=0, chunks=10, train_cfg=train_cfg)
    assert result["best"] >= 0.95, result


def test_a_relation_family_is_learnt_end_to_end_with_the_relations_preset(tmp_path):
    """A family other than the order task, and the hardest kind of it: the match family (does the last of four
    events, A, A, B, B, match the first's colour: the same label with A and B swapped, so an order-blind bag of
    chunks sees the same events under both labels, which tests/test_task_families.py checks of every family) end to
    end with configs/long-range-relations.yaml (the long-range preset and the chunk reconstruction; nothing else
    about the head set): 128 videos of 320 frames at 16x16, 10 chunks of 8 clip frames, 12 epochs."""
    data, settings = small_family(tmp_path, "match", videos=128)
    accuracy = best_accuracy(
        data, tmp_path, {"transformer": []}, *settings, epochs=12, chunk=8, preset="long-range-relations.yaml"
    )
    assert accuracy["transformer"] >= 0.9, accuracy


def test_the_chunk_reconstruction_keeps_a_relation_s_two_event_colours_apart_in_the_backbone(tmp_path):
    """The twice family (was the second attempt, events 3-4 of A, A, B, B, like the first): its label is the same
    with A and B swapped, so it gives the backbone no reason to tell them apart, and trained on it alone the
    backbone lets them drift together. With the chunk reconstruction (model.chunk_reconstruction: 1, as
    configs/long-range-relations.yaml sets it; 0, the default, against it) the two colours' centroids in the chunk
    features' contrast stay further apart. 64 videos of 320 frames at 16x16, 10 chunks of 8 clip frames, 6
    epochs."""
    from artifacts.checkpoint import load_checkpoint
    from config import saved_config
    from models import build_model

    data, settings = small_family(tmp_path, "twice", videos=64)
    clips, colours = event_chunks("twice", data, frames=80, chunk=8, videos=32)
    apart = {}
    for weight in (1, 0):
        run = tmp_path / f"weight_{weight}"
        best_accuracy(data, run, {"run": []}, *settings, f"model.chunk_reconstruction={weight}", epochs=6, chunk=8)
        saved = load_checkpoint(str(run / "run" / "long_range" / "latest" / "checkpoints" / "last.pt"))
        cfg = saved_config(saved.config)
        model = build_model(cfg.model, num_classes=2)
        model.load_state_dict(saved.model)
        apart[weight] = kinds_apart(model, clips, colours, 8, cfg.data.mean, cfg.data.std)
    assert apart[1]["accuracy"] >= 0.9, apart
    assert apart[1]["apart"] >= 1.15 * apart[0]["apart"], apart


def test_the_linear_probe_scores_rows_it_did_not_fit():
    """long_range_probes.linear_probe (bench.long_range --part separability's "linear"): two clouds apart along
    one of 16 features are told apart about as well as the best rule does (0.977: 2 standard deviations apart);
    two draws of one cloud are not, however well the probe fits its half."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(200, 16, generator=generator), torch.randn(200, 16, generator=generator)
    apart = b.clone()
    apart[:, 3] += 4.0
    assert linear_probe(a, apart) > 0.95
    assert 0.4 < linear_probe(a, b) < 0.6
