"""Chunked training: the clip goes through the model chunk by chunk, each chunk recomputed in backward."""

import csv
import dataclasses
import os
import shutil

import pytest
import torch
from conftest import overrides
from torch import nn

import train
from artifacts.checkpoint import load_checkpoint
from config import ConfigError, load_config
from datasets.device_input import DeviceInputs
from engine.inference.chunks import aggregate_chunk_logits, chunk_labels, chunk_windows
from engine.training.chunked_forward import ChunkedTrainingForward, ChunkSpec
from engine.training.step import label_loss
from models import build_model
from models.temporal import HeadOutput

MEAN, STD = [0.45] * 3, [0.225] * 3


def small_model(seed=0, views=1, **changes):
    torch.manual_seed(seed)
    kpt = ["data.load_kpt=true"] if changes.get("input_type") == "rgb_kpt" else []
    cfg = load_config(None, ["model.width=4", *kpt, *[f"model.{k}={v}" for k, v in changes.items()]]).model
    return build_model(
        cfg, num_classes=3, num_views=views, kpt_shape=(5, 2) if changes.get("input_type") == "rgb_kpt" else None
    )


def clip_batch(length=24, batch=2, views=1, keypoints=False):
    generator = torch.Generator().manual_seed(7)
    shape = (batch, 3, length, 16, 16) if views == 1 else (batch, views, 3, length, 16, 16)
    inputs = {"video": torch.randint(0, 255, shape, generator=generator, dtype=torch.uint8)}
    if keypoints:
        inputs["kpt"] = torch.rand(batch, length, 5, 2, generator=generator)
    return inputs


def gradients_of(model, inputs, spec, aggregation="mean", labels=(0, 2), seed=5, autocast=False):
    """Parameter gradients of one chunked step (the RNG seeded: a step's draws are the same)."""
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize).train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outputs = forward(device_inputs.transfer(inputs), spec)  # with a temporal head its clip logits, else None
        logits = (
            outputs.clip
            if outputs.clip is not None
            else aggregate_chunk_logits(outputs.chunks.transpose(0, 1), aggregation)
        )
    nn.functional.cross_entropy(logits, torch.tensor(labels[: len(logits)])).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "case",
    [
        {"aggregation": "mean"},
        {"aggregation": "max", "overlap": 3},
        {"aggregation": "prob"},
        {"aggregation": "mean", "model": {"recompute_blocks": True}},  # both recomputations nested
    ],
)
def test_recomputed_chunks_give_the_gradients_of_the_same_chunks_kept_in_memory(case):
    model, kept = small_model(**case.get("model", {})), small_model(**case.get("model", {}))
    overlap = case.get("overlap", 0)
    inputs = clip_batch()
    recomputed = gradients_of(model, inputs, ChunkSpec(8, overlap, recompute=True), case["aggregation"])
    in_memory = gradients_of(kept, inputs, ChunkSpec(8, overlap, recompute=False), case["aggregation"])
    assert recomputed.keys() == in_memory.keys() and len(recomputed) > 0
    for name, grad in recomputed.items():
        torch.testing.assert_close(grad, in_memory[name], rtol=1e-5, atol=1e-7, msg=name)
    # and the chunking is real: the whole clip in one forward gives other gradients
    whole = gradients_of(small_model(**case.get("model", {})), inputs, ChunkSpec(-1))
    assert any(not torch.allclose(whole[n], recomputed[n], rtol=1e-3, atol=1e-6) for n in recomputed)


def test_autocast_holds_inside_each_recomputed_chunk():
    """The recomputation runs under the autocast state of the forward (bf16 on the CPU here): the same gradients
    as the chunks kept in memory, and different ones from fp32."""
    model, kept, full = small_model(), small_model(), small_model()
    inputs = clip_batch()
    recomputed = gradients_of(model, inputs, ChunkSpec(8, 0), autocast=True)
    in_memory = gradients_of(kept, inputs, ChunkSpec(8, 0, recompute=False), autocast=True)
    fp32 = gradients_of(full, inputs, ChunkSpec(8, 0))
    for name, grad in recomputed.items():
        torch.testing.assert_close(grad, in_memory[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.allclose(fp32[n], recomputed[n], rtol=1e-4, atol=1e-6) for n in recomputed)


@pytest.mark.parametrize("views,keypoints", [(2, False), (1, True)])
def test_chunks_carry_their_views_and_keypoints(views, keypoints):
    changes = {"view_fusion": "mean"} if views > 1 else {"input_type": "rgb_kpt"}
    model, kept = small_model(views=views, **changes), small_model(views=views, **changes)  # same seed, same weights
    inputs = clip_batch(views=views, keypoints=keypoints)
    recomputed = gradients_of(model, inputs, ChunkSpec(8, 2))
    in_memory = gradients_of(kept, inputs, ChunkSpec(8, 2, recompute=False))
    for name, grad in recomputed.items():
        torch.testing.assert_close(grad, in_memory[name], rtol=1e-5, atol=1e-7, msg=name)
    if keypoints:
        assert recomputed["kpt.stages.0.0.weight"].abs().sum() > 0  # the keypoint branch learned from its chunks


@pytest.mark.parametrize("size", [24, 25, 1000])
def test_a_chunk_as_long_as_the_clip_is_exactly_the_plain_step(size):
    model, plain = small_model(), small_model()
    inputs = clip_batch(length=24)
    chunked = gradients_of(model, inputs, ChunkSpec(size, 0))
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    plain.train().zero_grad()
    torch.manual_seed(5)
    nn.functional.cross_entropy(plain(device_inputs(inputs)), torch.tensor([0, 2])).backward()
    for name, p in plain.named_parameters():
        assert torch.equal(p.grad, chunked[name]), name


def test_recomputation_leaves_batchnorm_running_statistics_as_one_forward_left_them():
    inputs = clip_batch()
    recomputed, kept = small_model(), small_model()
    gradients_of(recomputed, inputs, ChunkSpec(8, 0, recompute=True))
    gradients_of(kept, inputs, ChunkSpec(8, 0, recompute=False))
    bn = dict(recomputed.named_buffers())
    for name, buffer in kept.named_buffers():
        torch.testing.assert_close(bn[name], buffer, rtol=1e-6, atol=1e-7, msg=name)
    assert bn["rgb.stages.0.1.num_batches_tracked"] == 3  # one update per chunk, not two


def test_gradient_checkpointing_counts_each_step_once():
    """model.recompute_blocks used to update BatchNorm statistics again in backward's recomputation."""
    model = small_model(recompute_blocks=True)
    gradients_of(model, clip_batch(), ChunkSpec(-1))
    plain = small_model()
    gradients_of(plain, clip_batch(), ChunkSpec(-1))
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=1e-6, atol=1e-7, msg=name)
    assert int(dict(model.named_buffers())["rgb.stages.1.1.num_batches_tracked"]) == 1


def test_gradient_checkpointing_compiles_and_counts_each_step_once():
    """trainer.compile with model.recompute_blocks: dynamo cannot trace checkpoint's context_fn (the frozen
    running statistics), so a compiled model checkpoints without it; its graph updates BatchNorm once anyway.
    aot_eager: the graph torch.compile builds, without generating kernels."""
    inputs = {"video": clip_batch()["video"].float()}
    compiled, plain = small_model(recompute_blocks=True), small_model(recompute_blocks=True)
    torch.compile(compiled, backend="aot_eager")(inputs).sum().backward()
    plain(inputs).sum().backward()
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(dict(compiled.named_buffers())[name], buffer, rtol=1e-6, atol=1e-7, msg=name)
    assert int(dict(compiled.named_buffers())["rgb.stages.1.1.num_batches_tracked"]) == 1
    for (name, a), b in zip(compiled.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_dense_chunk_labels_equal_a_hand_computation():
    # clip of 12 frames, chunks of 4 sharing 1: [0,4) [3,7) [6,10) [8,12)
    windows = chunk_windows(12, 4, 1)
    assert windows == [(0, 4), (3, 7), (6, 10), (8, 12)]
    frame_labels = torch.tensor(
        [
            [2, 2, 2, 1, 1, 1, 1, -1, -1, -1, -1, -1],  # segments 2 on [0,3), 1 on [3,7), then nothing
            [0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 0],
        ]
    )
    expected = torch.tensor(
        [
            [2, 0],  # [0,4): 2,2,2,1 -> 2 | 0,0,0,0 -> 0
            [1, 0],  # [3,7): 1,1,1,1 -> 1 | 0,0,0,3 -> 0
            [1, 3],  # [6,10): 1,-1,-1,-1 -> 1 | 3,3,3,3 -> 3
            [-1, 3],
        ]
    )  # [8,12): nothing labelled -> ignored | 3,3,3,0 -> 3
    assert torch.equal(chunk_labels(frame_labels, windows), expected)


def test_dense_loss_is_the_mean_over_counted_chunks(tmp_path):
    cfg = load_config(None, ["train.chunk_train_size=4", "train.chunk_train_overlap=1", "train.chunk_loss=dense"])
    chunk_logits = torch.randn(4, 2, 5)
    piece = {
        "video": torch.zeros(2, 3, 12, 1, 1),
        "label": torch.tensor([0, 0]),
        "frame_labels": torch.tensor([[2, 2, 2, 1, 1, 1, 1, -1, -1, -1, -1, -1], [0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 0]]),
    }
    loss = label_loss(
        HeadOutput(None, chunk_logits.transpose(0, 1)), piece, ChunkSpec(4, 1), cfg.train, nn.CrossEntropyLoss()
    )
    rows = [(0, 0, 2), (0, 1, 0), (1, 0, 1), (1, 1, 0), (2, 0, 1), (2, 1, 3), (3, 1, 3)]  # (chunk, clip, label)
    by_hand = sum(-chunk_logits[c, b].log_softmax(-1)[k] for c, b, k in rows) / len(rows)
    torch.testing.assert_close(loss, by_hand)


def test_chunk_train_aggregation_last_is_refused_with_its_reason():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.chunk_train_aggregation=last"])
    assert str(info.value) == (
        "--set train.chunk_train_aggregation=last: train.chunk_train_aggregation: 'last' means "
        "nothing in training (only the last chunk would learn); use mean, max or prob. "
        "Validation's infer.chunk_aggregation may stay last"
    )
    with pytest.raises(ConfigError, match="train.chunk_train_overlap=8 must be smaller than train.chunk_train_size=8"):
        load_config(None, ["train.chunk_train_size=8", "train.chunk_train_overlap=8"])


@pytest.mark.parametrize(
    "dense, head, precise, budget, sampled",
    [
        (False, "none", False, False, False),
        (True, "none", False, False, False),
        (True, "tcn", False, False, False),
        (False, "none", True, False, False),
        (False, "transformer", False, True, False),
        (False, "transformer", False, True, True),
        (True, "none", False, False, True),
    ],
)
def test_resume_at_an_epoch_end_is_exact_with_chunks(synthetic_root, tmp_path, dense, head, precise, budget, sampled):
    """From epoch_0001.pt of a 2-epoch run, put as last.pt of a fresh run: the same final weights and BatchNorm
    statistics (with a temporal head too: the tcn's dropout draws from the restored RNG; with precise BN: the
    statistics recomputed before each validation; with a budget: chunks kept unrecomputed; with train.grad_chunks:
    the same chunks drawn for each step)."""
    extra = [
        "train.chunk_train_size=4",
        "train.chunk_train_overlap=1",
        "train.keep_last_k=2",
        "infer.chunk_size=4",
    ] + (
        [
            "train.chunk_loss=dense",
            "data.train_manifest=long.jsonl",
            "data.val_manifest=long.jsonl",
            "data.max_video_frames=40",
        ]
        if dense
        else []
    )
    extra += ["train.precise_bn_batches=2"] if precise else []
    extra += ["train.grad_chunks=2"] if sampled else []
    extra += ["trainer.memory_budget_gb=2", "trainer.device=cpu"] if budget else []
    if head != "none":
        extra += [f"model.temporal_head={head}"]
    reference_dir = tmp_path / "reference"
    assert train.main(overrides(synthetic_root, reference_dir, *extra)) == 0
    checkpoints = os.path.join(reference_dir, "e2e", "latest", "checkpoints")
    reference = load_checkpoint(os.path.join(checkpoints, "last.pt"))
    assert reference.state.global_step > 0 and reference.config["train"]["chunk_train_size"] == 4
    # 8 frames in chunks of 4 sharing 1: 3 chunks, 2 of them with a gradient with train.grad_chunks
    assert reference.state.kept_chunks == ((2 if sampled else 3) if budget else 0)
    resumed_dir = tmp_path / "resumed" / "e2e" / "run"
    os.makedirs(resumed_dir / "checkpoints")
    shutil.copy(os.path.join(checkpoints, "epoch_0001.pt"), resumed_dir / "checkpoints" / "last.pt")
    shutil.copy(os.path.join(checkpoints, "..", "config.yaml"), resumed_dir / "config.yaml")  # a run directory
    os.symlink("run", tmp_path / "resumed" / "e2e" / "latest")
    assert train.main(overrides(synthetic_root, tmp_path / "resumed", *extra) + ["--resume", "auto"]) == 0
    resumed = load_checkpoint(str(resumed_dir / "checkpoints" / "last.pt"))
    assert resumed.state.global_step == reference.state.global_step
    assert any(key.startswith("temporal.") for key in reference.model) == (head != "none")
    for key, value in reference.model.items():
        torch.testing.assert_close(resumed.model[key], value, rtol=0, atol=0, msg=key)


# ------------------------------------------------------------------ the chunks the memory budget keeps


@pytest.mark.parametrize(
    "head, extra",
    [("none", {}), ("transformer", {}), ("none", {"recompute_blocks": True}), ("none", {"autocast": True})],
    ids=["plain", "temporal-head", "recomputed-blocks-inside", "autocast"],
)
@pytest.mark.parametrize("kept", [1, 2, 3])
def test_keeping_chunks_gives_the_gradients_of_recomputing_every_chunk(kept, head, extra):
    """3 chunks of 8 frames: keeping the last 1, 2 or all 3 chunks' activations changes no gradient against
    recomputing every one, with a temporal head, with recomputed blocks inside the chunks and under autocast (bf16
    on the CPU) too."""
    autocast = extra.get("autocast", False)
    changes = {k: v for k, v in extra.items() if k != "autocast"} | ({"temporal_head": head} if head != "none" else {})
    inputs = clip_batch()
    recompute_all = gradients_of(small_model(**changes), inputs, ChunkSpec(8, 0), autocast=autocast)
    keeping = gradients_of(small_model(**changes), inputs, ChunkSpec(8, 0, kept=kept), autocast=autocast)
    assert recompute_all.keys() == keeping.keys() and len(keeping) > 0
    for name, grad in keeping.items():
        torch.testing.assert_close(grad, recompute_all[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("kept, forwards", [(0, 6), (1, 5), (2, 4), (3, 3), (5, 3)])
def test_only_the_chunks_not_kept_run_their_forward_again(kept, forwards):
    """The module's forward calls of one step over 3 chunks: 3, plus one per recomputed chunk (the last chunks
    are the kept ones)."""
    from test_training_loop import NoBatchNorm

    model = NoBatchNorm()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize).train()
    outputs = forward(device_inputs.transfer(clip_batch(length=12)), ChunkSpec(4, 0, kept=kept))
    outputs.chunks.mean().backward()
    assert len(model.chunk_lengths) == forwards
    recomputed = [ChunkSpec(4, 0, kept=kept).recomputed(i, 3) for i in range(3)]
    assert recomputed == [i < 3 - min(kept, 3) for i in range(3)]


def test_the_kept_count_follows_the_budget():
    """The planner keeps the most chunks whose estimate fits: at each kept count's estimate (and just under the
    next one's) it keeps that many. Each chunk kept adds one chunk's activations, except the first: with every
    chunk recomputed the peak already holds one chunk's (its recomputation in backward), so one is kept for free."""
    from planner.project import config_training_estimate, most_chunks_kept

    cfg = load_config(None, ["model.width=8", "data.num_frames=32", "data.batch_size=2", "train.chunk_train_size=8"])
    peaks = [config_training_estimate(cfg, train.STEP, 32, 2, kept_chunks=k).peak for k in range(5)]
    assert peaks[0] == peaks[1] < peaks[2] < peaks[3] < peaks[4]
    steps = {peaks[k + 1] - peaks[k] for k in range(1, 4)}
    assert max(steps) - min(steps) < 0.01 * min(steps)  # one chunk's activations each
    for k in range(1, 5):
        assert most_chunks_kept(cfg, train.STEP, 32, 2, peaks[k])[0] == k
        if k < 4:
            assert most_chunks_kept(cfg, train.STEP, 32, 2, peaks[k + 1] - 1)[0] == k
    assert most_chunks_kept(cfg, train.STEP, 32, 2, peaks[0] - 1)[0] == 0
    assert most_chunks_kept(cfg, train.STEP, 32, 2, 10 * peaks[4])[0] == 4


def test_without_a_budget_every_chunk_is_recomputed(caplog):
    from core.runtime import Runtime
    from datasets.shape import DataShape
    from planner.batch_size import chunks_to_keep

    runtime, shape = Runtime(torch.device("cpu"), "32"), DataShape(3)
    chunked = ["model.width=8", "data.num_frames=32", "data.batch_size=2", "train.chunk_train_size=8"]
    with caplog.at_level("INFO", logger="longvideo"):
        assert chunks_to_keep(load_config(None, chunked), runtime, shape, train.STEP) == 0
    assert "training chunks without trainer.memory_budget_gb: every training chunk is recomputed" in caplog.text
    budget = [*chunked, "trainer.memory_budget_gb=100"]
    with caplog.at_level("INFO", logger="longvideo"):
        assert chunks_to_keep(load_config(None, budget), runtime, shape, train.STEP) == 4
    assert "keeping the activations of 4 of 4 training chunks, recomputing 0 in backward" in caplog.text


def test_the_oom_back_off_first_halves_the_chunks_kept(tmp_path, caplog):
    from test_training_loop import NoBatchNorm, make_run

    from engine.training.oom import OutOfMemoryError

    class OutOfMemoryOnce(NoBatchNorm):
        def forward(self, inputs):
            if not self.chunk_lengths:
                self.chunk_lengths.append(0)
                raise OutOfMemoryError("CUDA out of memory (simulated)")
            return super().forward(inputs)

    run, loader = make_run(OutOfMemoryOnce(), 2, 1, tmp_path, count=4, **{"train.chunk_train_size": 1})
    run.state.kept_chunks = 4  # 4 frames in chunks of 1: all kept, as a large budget decides
    assert run.chunk_spec().kept == 4
    with caplog.at_level("WARNING", logger="longvideo"):
        train.train_one_epoch(run, loader)
    assert "out of memory with the activations of 4 training chunks kept: now 2 kept" in caplog.text
    assert (run.state.kept_chunks, run.state.micro_splits, run.state.chunk_train_size) == (2, 1, None)
    assert run.state.global_step == 2  # the step was retried, none lost


def test_probe_memory_states_the_chunks_auto_keeps():
    from planner.estimate import usable_bytes
    from planner.memory_table import probe
    from planner.project import most_chunks_kept

    cfg = load_config(
        None,
        [
            "model.width=8",
            "data.num_frames=32",
            "data.batch_size=2",
            "train.chunk_train_size=8",
            "trainer.memory_budget_gb=0.02",
        ],
    )
    lines = []
    assert probe(cfg, train.STEP, False, [32], [2], out=lines.append, for_gpu=False, num_classes=10) == 0
    kept = most_chunks_kept(cfg, train.STEP, 32, 2, usable_bytes(0.02, cuda=False), num_classes=10)[0]
    assert 0 < kept < 4  # this budget holds some chunks, not all
    assert lines[-1].startswith(
        f"the memory budget at batch 2: keeps the activations of {kept} of 4 training chunks (estimated peak "
    )


# ------------------------------------------------------------------ train.grad_chunks: gradients through K chunks

HEAD = {"temporal_head": "transformer"}


def test_the_draw_takes_one_chunk_from_each_part_of_the_clip_weighted_by_the_part():
    draws = [ChunkSpec(4, 0, grad_chunks=3, draw=seed).graph_chunks(10) for seed in range(200)]
    for drawn in draws:  # parts [0, 3), [3, 7), [7, 10)
        assert [(0 <= c < 3, 3 <= c < 7, 7 <= c < 10) for c in sorted(drawn)] == [
            (True, False, False),
            (False, True, False),
            (False, False, True),
        ]
        assert [drawn[c] for c in sorted(drawn)] == [3.0, 4.0, 3.0]  # sums to 10 chunks
    assert set().union(*draws) == set(range(10))  # every chunk is drawn across steps
    assert ChunkSpec(4, 0, grad_chunks=3, draw=5).graph_chunks(10) == draws[5]  # the same step draws the same
    assert ChunkSpec(4, 0, grad_chunks=3).graph_chunks(3) is None  # K >= n: every chunk, as all
    assert ChunkSpec(4, 0).graph_chunks(10) is None


@pytest.mark.parametrize("head", [False, True], ids=["aggregated", "temporal-head"])
def test_sampled_gradients_average_over_the_draws_to_the_gradient_of_every_chunk(head):
    """6 chunks, 2 with a gradient (one of the first three, one of the last three, each weighted 3): over the 9
    equally likely draws the gradients average to those of every chunk (the estimate is unbiased). The temporal
    head's own gradients are exact at every draw: it sees every chunk's features."""
    changes = HEAD if head else {}
    inputs = clip_batch(length=48)
    every = gradients_of(small_model(**changes), inputs, ChunkSpec(8, 0))
    seeds = {}
    for seed in range(500):
        seeds.setdefault(tuple(sorted(ChunkSpec(8, 0, grad_chunks=2, draw=seed).graph_chunks(6))), seed)
    assert len(seeds) == 9
    draws = [
        gradients_of(small_model(**changes), inputs, ChunkSpec(8, 0, grad_chunks=2, draw=s)) for s in seeds.values()
    ]
    for name, grad in every.items():
        torch.testing.assert_close(sum(d[name] for d in draws) / len(draws), grad, rtol=1e-4, atol=1e-6, msg=name)
        if name.startswith("temporal."):
            for drawn in draws:
                torch.testing.assert_close(drawn[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    backbone = "rgb.stages.0.0.weight"
    assert not torch.allclose(draws[0][backbone], every[backbone], rtol=1e-2)  # one draw alone is not the mean


@pytest.mark.parametrize(
    "changes, autocast",
    [({}, True), ({"recompute_blocks": True}, False), (HEAD, True)],
    ids=["autocast", "recomputed-blocks-inside", "head-autocast"],
)
def test_recomputing_the_drawn_chunks_gives_the_gradients_of_keeping_them(changes, autocast):
    """The same draw of 2 chunks among 6, recomputed in backward or kept: the same gradients, under autocast (bf16
    on the CPU), with recomputed blocks inside the chunks, with a head."""
    inputs = clip_batch(length=48)
    spec = ChunkSpec(8, 0, grad_chunks=2, draw=4)
    recomputed = gradients_of(small_model(**changes), inputs, spec, autocast=autocast)
    kept = gradients_of(small_model(**changes), inputs, dataclasses.replace(spec, recompute=False), autocast=autocast)
    assert recomputed.keys() == kept.keys() and len(kept) > 0
    for name, grad in kept.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("kept, forwards", [(0, 6), (1, 5), (2, 4)])
def test_only_the_drawn_chunks_build_a_graph_and_only_they_are_recomputed(kept, forwards):
    """4 chunks, 2 with a gradient: 4 forwards, plus one per drawn chunk recomputed (``kept`` counts the drawn
    chunks); the other chunks hold no graph."""
    from test_training_loop import NoBatchNorm

    model = NoBatchNorm()
    device_inputs = DeviceInputs(torch.device("cpu"), MEAN, STD)
    forward = ChunkedTrainingForward(model, device_inputs.normalize).train()
    spec = ChunkSpec(4, 0, kept=kept, grad_chunks=2, draw=1)
    inputs = device_inputs.transfer(clip_batch(length=16))
    outputs = forward(inputs, spec)
    outputs.chunks.mean().backward()
    assert len(model.chunk_lengths) == forwards
    chunks = forward(inputs, dataclasses.replace(spec, recompute=False)).chunks  # [B, 4, K]
    reaches = [
        bool(torch.autograd.grad(chunks[:, i].sum(), model.conv.weight, retain_graph=True)[0].abs().sum() > 0)
        for i in range(4)
    ]
    assert [i for i, reached in enumerate(reaches) if reached] == sorted(spec.graph_chunks(4))


def test_chunks_without_a_gradient_update_batchnorm_as_every_chunk_does():
    """Train-mode BatchNorm in every chunk, drawn or not: the running statistics after a step are those of the
    step with every chunk's gradient, and so are the features the head or the loss sees."""
    inputs = clip_batch(length=48)
    every, sampled = small_model(), small_model()
    gradients_of(every, inputs, ChunkSpec(8, 0))
    gradients_of(sampled, inputs, ChunkSpec(8, 0, grad_chunks=2, draw=3))
    buffers = dict(sampled.named_buffers())
    for name, buffer in every.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, rtol=1e-6, atol=1e-7, msg=name)
    assert buffers["rgb.stages.0.1.num_batches_tracked"] == 6


def test_the_planner_counts_the_activations_of_the_drawn_chunks_only():
    from planner.project import config_training_estimate, graph_chunk_count, most_chunks_kept

    shape = ["model.width=8", "data.num_frames=64", "data.batch_size=2", "train.chunk_train_size=8"]
    every, sampled = load_config(None, shape), load_config(None, [*shape, "train.grad_chunks=2"])
    assert (graph_chunk_count(every, 64), graph_chunk_count(sampled, 64)) == (8, 2)
    peak = {
        (name, kept): config_training_estimate(cfg, train.STEP, 64, 2, kept_chunks=kept).peak
        for name, cfg in (("every", every), ("sampled", sampled))
        for kept in (0, 2, 8)
    }
    assert peak["sampled", 0] == pytest.approx(peak["every", 0], rel=0.01)  # one chunk's activations either way
    assert peak["sampled", 2] == pytest.approx(peak["every", 2], rel=0.01)
    assert peak["sampled", 8] == peak["sampled", 2] < peak["every", 8]  # no more than 2 chunks hold a graph
    assert most_chunks_kept(sampled, train.STEP, 64, 2, 10**12)[0] == 2


def test_grad_chunks_without_training_chunks_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train.grad_chunks=4 draws training chunks, but train.chunk_train_size"):
        load_config(None, ["train.grad_chunks=4"])
    with pytest.raises(ConfigError, match="train.grad_chunks"):
        load_config(None, ["train.chunk_train_size=8", "train.grad_chunks=0"])
    assert load_config(None, ["train.chunk_train_size=8", "train.grad_chunks=4"]).train.grad_chunks == 4
    # a head on features has no backbone to sample: the key is accepted and changes nothing there
    assert load_config(None, ["data.features_dir=/features", "train.grad_chunks=4"]).train.grad_chunks == 4


def test_with_gradients_through_half_the_chunks_the_backbone_still_learns_motion(tmp_path):
    """The synthetic motion task (6 classes; no frame tells the class, so the backbone must learn): 96 clips of 16
    frames in 4 training chunks, 20 epochs. With train.grad_chunks 2 the run learns (0.458 here with today's
    defaults, rising from chance over the epochs; the bar is more than twice chance, not that figure); a frozen
    random backbone, the head alone, stays at chance (0.167 at every epoch)."""
    from datasets.synthetic import generate

    root = str(tmp_path / "data")
    generate(
        root, seed=3, size=32, num_train=96, num_val=48, num_test=6, short_frames=24, num_long=1, long_frames=40,
        num_multiview=0, quiet=True,
    )  # fmt: skip
    accuracy = {}
    runs = {"sampled": ["train.grad_chunks=2", "train.max_epochs=20"]}
    runs["frozen"] = ["model.freeze_backbone=true", "train.max_epochs=3"]  # at chance from its first epoch
    for name, extra in runs.items():
        out = tmp_path / name
        chunks = ["data.num_frames=16", "data.frame_stride=1", "train.chunk_train_size=4", "infer.chunk_size=4"]
        assert train.main(overrides(root, out, *chunks, *extra)) == 0
        with open(os.path.join(out, "e2e", "latest", "metrics.csv")) as f:
            accuracy[name] = max(float(row["val_video_acc"]) for row in csv.DictReader(f))
    assert accuracy["frozen"] <= 0.25 and accuracy["sampled"] >= 0.35, accuracy


def test_a_micro_batch_split_carries_keys_of_the_sample_type():
    from datasets.sample import SAMPLE_KEYS
    from engine.training.step import MODEL_KEYS

    assert set(MODEL_KEYS) <= SAMPLE_KEYS
