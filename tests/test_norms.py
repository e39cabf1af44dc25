"""model.norm (batch, frozen, sync, group) and precise BN (train.precise_bn_batches)."""

import dataclasses
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import overrides
from test_training_loop import make_run
from torch import nn

import train
from artifacts.checkpoint import load_checkpoint
from config import load_config
from core.errors import ConfigError
from engine.training.precise_bn import precise_batch_norm
from models import ModelConfigError, build_model, registered_names
from models.norms import FrozenBatchNorm, SyncBatchNorm, batch_norms, convert_norms, group_count


def model_cfg(**changes):
    return load_config(
        None, [f"model.{k}={v}" for k, v in changes.items()] + ["model.width=4", "data.load_kpt=true"]
    ).model


def config_error(*sets: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(sets))
    return str(info.value)


# ------------------------------------------------------------------------------------------------- group

NO_BATCH_NORM = {"swin3d_t", "mvit_v2_s"}  # LayerNorm transformers


@pytest.mark.parametrize("name", sorted(set(registered_names()) - NO_BATCH_NORM))
def test_group_converts_every_batch_norm_of_each_backbone_which_still_trains(name):
    reference = build_model(model_cfg(backbone=name), 3)
    model = build_model(model_cfg(backbone=name, norm="group"), 3)
    before = dict(reference.named_modules())
    converted = {n: m for n, m in model.named_modules() if isinstance(m, nn.GroupNorm)}
    assert not batch_norms(model) and converted
    assert set(converted) == {n for n, m in before.items() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    for norm in converted.values():
        assert norm.num_channels % norm.num_groups == 0
        assert norm.num_groups == group_count(norm.num_channels, 32)
    shape = (max(1, model.rgb.min_frames), 32, 32)
    logits = model({"video": torch.randn(2, 3, *shape)})
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_group_converts_the_keypoint_branch_and_counts_divide_odd_channel_numbers():
    model = build_model(model_cfg(input_type="rgb_kpt", norm="group"), 4, kpt_shape=(5, 3))
    assert not batch_norms(model) and any(isinstance(m, nn.GroupNorm) for m in model.kpt.modules())
    logits = model({"video": torch.randn(2, 3, 4, 16, 16), "kpt": torch.rand(2, 4, 5, 3)})
    logits.sum().backward()
    assert group_count(144, 32) == 24 and group_count(230, 32) == 23 and group_count(512, 32) == 32
    assert group_count(16, 32) == 8 and group_count(7, 4) == 1 and group_count(1, 32) == 1


def test_a_group_count_is_the_largest_divisor_of_the_channels_up_to_the_wanted_one():
    assert all(group_count(c, 8) == math.gcd(8, c) for c in (16, 32, 64, 128, 256, 512))


@pytest.mark.parametrize("name", sorted(NO_BATCH_NORM))
@pytest.mark.parametrize("norm", ["frozen", "group"])
def test_a_backbone_without_batch_norm_refuses_other_norms(name, norm, tmp_path):
    cfg = model_cfg(backbone=name, norm=norm, pretrained=tmp_path / "w.pt")
    with pytest.raises(ModelConfigError, match=f"model.norm: {norm}: {name} has no BatchNorm layer to convert"):
        build_model(dataclasses.replace(cfg, pretrained=None), 3)


# ------------------------------------------------------------------------------------------------ frozen


def pretrained_tiny3d(path) -> str:
    """A tiny3d state dict whose BatchNorm statistics are not the initial ones."""
    torch.manual_seed(3)
    model = build_model(model_cfg(), 3)
    for norm in batch_norms(model):
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
        norm.weight.data.uniform_(0.5, 1.5)
    torch.save(model.state_dict(), path)
    return str(path)


def test_frozen_keeps_the_statistics_bit_identical_and_trains_the_affine(tmp_path):
    cfg = model_cfg(norm="frozen", pretrained=pretrained_tiny3d(tmp_path / "w.pt"))
    model = build_model(cfg, 3)
    norms = batch_norms(model.rgb)
    assert norms and all(isinstance(m, FrozenBatchNorm) for m in norms)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert before["rgb.stages.0.1.running_mean"].abs().sum() > 0  # the pretrained statistics, loaded
    run, batches = make_run(model, 2, 1, tmp_path / "run", count=6, **{"train.chunk_train_size": 2})
    run.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    train.train_one_epoch(run, batches)
    assert run.state.global_step == 3
    after = model.state_dict()
    for key, value in before.items():
        norm_key = key.startswith("rgb.") and key.rsplit(".", 1)[1] in (
            "running_mean",
            "running_var",
            "num_batches_tracked",
        )
        if norm_key and isinstance(model.get_submodule(key.rsplit(".", 1)[0]), FrozenBatchNorm):
            assert torch.equal(after[key], value), key
    changed = [
        not torch.equal(w, before[name + ".weight"])
        for name, w in ((n, m.weight) for n, m in model.named_modules() if isinstance(m, FrozenBatchNorm))
    ]
    assert all(changed)
    assert not torch.equal(after["rgb.stages.0.0.weight"], before["rgb.stages.0.0.weight"])  # the convolutions learn


def test_frozen_normalizes_with_the_running_statistics_in_training_mode():
    norm = FrozenBatchNorm(3)
    norm.running_mean.copy_(torch.tensor([1.0, 2.0, 3.0]))
    norm.running_var.copy_(torch.tensor([4.0, 1.0, 0.25]))
    x = torch.randn(2, 3, 4, 5, 5)
    expected = (x - norm.running_mean.view(1, 3, 1, 1, 1)) / (norm.running_var.view(1, 3, 1, 1, 1) + norm.eps).sqrt()
    torch.testing.assert_close(norm.train()(x), expected)


# -------------------------------------------------------------------------------------------- config errors


def test_unknown_norm_and_impossible_combinations_are_config_errors_naming_key_and_fix():
    assert config_error("model.norm=layer") == (
        "--set model.norm=layer: model.norm: 'layer' is not one of batch, frozen, sync, group"
    )
    message = config_error("model.norm=frozen")
    assert "model.norm: frozen" in message and "model.pretrained is null" in message and "norm: group" in message
    message = config_error("model.norm=group", "model.pretrained=true")
    assert "model.norm: group" in message and "model.pretrained: null" in message
    message = config_error(
        "model.norm=frozen",
        "model.pretrained=w.pt",
        "model.input_type=kpt",
        "data.load_kpt=true",
        "data.load_rgb=false",
    )
    assert "keypoint branch" in message
    for norm, extra in (("group", []), ("frozen", ["model.pretrained=w.pt"])):
        message = config_error(f"model.norm={norm}", "train.precise_bn_batches=4", *extra)
        assert message.startswith("--set train.precise_bn_batches=4: ") and "precise_bn_batches: 0" in message


def test_group_with_pretrained_batch_norm_weights_is_refused_at_loading(tmp_path):
    cfg = model_cfg(norm="group", pretrained=pretrained_tiny3d(tmp_path / "w.pt"))
    with pytest.raises(ModelConfigError) as info:
        build_model(cfg, 3)
    assert "holds BatchNorm statistics" in str(info.value) and "norm: frozen" in str(info.value)


# --------------------------------------------------------------------------------------------------- sync


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync_rank(rank: int, port: int, x: torch.Tensor, weights: dict, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        norm = SyncBatchNorm(3)
        norm.load_state_dict(weights)
        part = x.tensor_split(2)[rank].clone().requires_grad_()
        y = norm(part)
        (y * torch.arange(1.0, 1 + y.numel()).view_as(y) / y.numel()).sum().backward()
        torch.save(
            {
                "y": y.detach(),
                "grad": part.grad,
                "weight_grad": norm.weight.grad,
                "bias_grad": norm.bias.grad,
                "running_mean": norm.running_mean,
                "running_var": norm.running_var,
            },
            out.format(rank),
        )
    finally:
        torch.distributed.destroy_process_group()


def test_sync_under_two_gloo_processes_gives_the_statistics_of_the_concatenated_batch(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, 6, 6) * torch.tensor([1.0, 3.0, 0.5]).view(1, 3, 1, 1, 1) + 2  # 3 + 2 clips
    reference = nn.BatchNorm3d(3)
    reference.weight.data.uniform_(0.5, 2)
    reference.bias.data.uniform_(-1, 1)
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    out = str(tmp_path / "rank{}.pt")
    mp.start_processes(_sync_rank, args=(free_port(), x, weights, out), nprocs=2, start_method="spawn")
    ranks = [torch.load(out.format(r), weights_only=True) for r in range(2)]
    whole = x.clone().requires_grad_()
    y = reference(whole)
    parts = y.tensor_split(2)
    (sum((p * torch.arange(1.0, 1 + p.numel()).view_as(p) / p.numel()).sum() for p in parts)).backward()
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), y.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks]), whole.grad, rtol=1e-4, atol=1e-6)
    for r in ranks:
        torch.testing.assert_close(r["running_mean"], reference.running_mean)
        torch.testing.assert_close(r["running_var"], reference.running_var)
    torch.testing.assert_close(ranks[0]["weight_grad"] + ranks[1]["weight_grad"], reference.weight.grad)
    torch.testing.assert_close(ranks[0]["bias_grad"] + ranks[1]["bias_grad"], reference.bias.grad)


def test_sync_on_one_process_is_batch_norm_and_converts_with_the_weights():
    model = build_model(model_cfg(norm="sync"), 3)
    assert batch_norms(model) and not any(isinstance(m, SyncBatchNorm) for m in model.modules())
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_norms(model, "sync") == len(batch_norms(model)) == 3
    assert all(isinstance(m, SyncBatchNorm) for m in batch_norms(model))
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    x = {"video": torch.randn(2, 3, 4, 16, 16)}
    plain = build_model(model_cfg(), 3)
    plain.load_state_dict(reference)
    torch.testing.assert_close(model(x), plain(x))  # no process group: BatchNorm's arithmetic


# ----------------------------------------------------------------------------------------------- precise BN


class TwoNorms(nn.Module):
    """bn2(2 * bn1(video) + 1), pooled, classified: each BatchNorm input computable by hand."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bn1, self.bn2 = nn.BatchNorm3d(3), nn.BatchNorm3d(3)
        self.bn1.weight.data.uniform_(0.5, 2)
        self.bn1.bias.data.uniform_(-1, 1)
        self.fc = nn.Linear(3, 3)

    def forward(self, inputs):
        return self.fc(self.bn2(2 * self.bn1(inputs["video"]) + 1).mean(dim=(2, 3, 4)))


def test_precise_bn_gives_the_exact_mean_and_variance_over_the_batches_chunks_and_micro_batches(tmp_path):
    model = TwoNorms()
    run, loader = make_run(model, 4, 1, tmp_path, count=12, **{"train.chunk_train_size": 2})
    run.state.micro_splits = 2  # as after an out-of-memory back-off: 2 clips per forward
    batches = list(loader)  # 3 batches of 4 clips of 4 frames
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert precise_batch_norm(run, iter(batches), limit=2) == 2
    assert torch.equal(torch.get_rng_state(), rng)
    # by hand: every (batch, micro-batch, chunk) call; bn1 sees the normalized frames, bn2 bn1's output
    bn1_inputs, bn2_inputs = [], []
    for batch in batches[:2]:
        for piece in batch["video"].tensor_split(2):
            for start in (0, 2):  # training chunks [0, 2) and [2, 4)
                x = run.inputs.normalize({"video": piece[:, :, start : start + 2]})["video"]
                var, mean = torch.var_mean(x, dim=(0, 2, 3, 4), correction=0, keepdim=True)
                shape = (1, 3, 1, 1, 1)
                y = (x - mean) / (var + model.bn1.eps).sqrt() * weights["bn1.weight"].view(shape) + weights[
                    "bn1.bias"
                ].view(shape)
                bn1_inputs.append(x.transpose(0, 1).reshape(3, -1))
                bn2_inputs.append((2 * y + 1).transpose(0, 1).reshape(3, -1))
    for norm, inputs in ((model.bn1, bn1_inputs), (model.bn2, bn2_inputs)):
        everything = torch.cat(inputs, dim=1).double()
        torch.testing.assert_close(norm.running_mean.double(), everything.mean(dim=1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm.running_var.double(), everything.var(dim=1), rtol=1e-5, atol=1e-6)
    after = model.state_dict()
    for key, value in weights.items():
        if "running" not in key:
            assert torch.equal(after[key], value), key  # weights and num_batches_tracked untouched


def test_precise_bn_leaves_frozen_layers_alone(tmp_path):
    model = TwoNorms()
    model.bn1 = FrozenBatchNorm(3)
    run, loader = make_run(model, 4, 1, tmp_path, count=4)
    precise_batch_norm(run, iter(loader), limit=1)
    assert torch.equal(model.bn1.running_mean, torch.zeros(3)) and torch.equal(model.bn1.running_var, torch.ones(3))
    assert not torch.equal(model.bn2.running_mean, torch.zeros(3))


def test_precise_bn_in_a_run_changes_only_the_running_statistics(synthetic_root, tmp_path):
    """Training normalizes with batch statistics and the pass leaves the run's random state alone: with precise BN
    on, the weights are bit-identical to a run without it; the statistics are not, and one line says so."""
    common = ["train.max_epochs=1", "train.chunk_train_size=4"]
    assert train.main(overrides(synthetic_root, tmp_path / "off", *common)) == 0
    assert train.main(overrides(synthetic_root, tmp_path / "on", *common, "train.precise_bn_batches=3")) == 0
    off, on = (
        load_checkpoint(str(tmp_path / name / "e2e" / "latest" / "checkpoints" / "last.pt")) for name in ("off", "on")
    )
    statistics = [k for k in off.model if "running_" in k]
    assert statistics
    for key, value in off.model.items():
        if key in statistics:
            assert not torch.equal(on.model[key], value), key
        else:
            assert torch.equal(on.model[key], value), key
    log = open(os.path.join(tmp_path, "on", "e2e", "latest", "train.log")).read()
    assert "precise BN: running statistics of 3 BatchNorm layers recomputed over 3 batches" in log
