"""The GPU presets are recipes: pretrained weights named, with their normalization; augmentation on; inference chunks
the length the model trained on; a temporal head on long windows. Named weights load from torch's hub cache without
network, and without network or cache the error is one line that says where to put the file."""

import glob
import os
import urllib.error

import pytest
import torch
from conftest import ROOT

from config import ConfigError, load_config
from config.schema import NAMED_WEIGHTS
from models import build_model
from models.pretrained import PretrainedError

GPU_PRESETS = sorted(
    os.path.basename(path)
    for path in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
    if load_config(path).trainer.memory_budget_gb
)


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_is_a_recipe(preset):
    cfg = load_config(os.path.join(ROOT, "configs", preset))
    assert cfg.model.pretrained is not None, "trains from scratch"
    assert cfg.data.augment, "no augmentation"
    trained_on = cfg.train.chunk_train_size if cfg.train.chunk_train_size != -1 else cfg.data.num_frames
    assert cfg.infer.chunk_size == trained_on, "inference chunks of another length than the training ones"
    if cfg.data.max_video_frames and cfg.train.chunk_train_size != -1:
        assert cfg.model.temporal_head != "none", "chunks of long windows averaged, no temporal head"
    if cfg.model.pretrained in NAMED_WEIGHTS:
        weights = NAMED_WEIGHTS[cfg.model.pretrained][cfg.model.backbone]
        assert (cfg.data.mean, cfg.data.std) == (weights["mean"], weights["std"])


@pytest.mark.parametrize("backbone", sorted(NAMED_WEIGHTS["kinetics400"]))
def test_named_weights_carry_torchvision_s_own_normalization(backbone):
    from torchvision.models import get_model_weights

    transforms = get_model_weights(backbone).KINETICS400_V1.transforms()  # no download: the recipe's numbers
    weights = NAMED_WEIGHTS["kinetics400"][backbone]
    assert (list(transforms.mean), list(transforms.std)) == (weights["mean"], weights["std"])
    cfg = load_config(None, [f"model.backbone={backbone}", "model.pretrained=true"])
    assert cfg.data.mean == weights["mean"]  # true for a torchvision video backbone: the same weights


def test_a_normalization_given_is_kept_and_weights_of_another_backbone_are_one_line():
    cfg = load_config(None, ["model.backbone=r3d_18", "model.pretrained=kinetics400", "data.mean=[0.5,0.5,0.5]"])
    assert cfg.data.mean == [0.5, 0.5, 0.5] and cfg.data.std == NAMED_WEIGHTS["kinetics400"]["r3d_18"]["std"]
    assert load_config(None).data.mean == [0.45, 0.45, 0.45]  # no named weights: the default
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.backbone=tiny3d", "model.pretrained=kinetics400"])
    assert str(info.value) == (
        "--set model.pretrained=kinetics400: model.pretrained: kinetics400: torchvision has these weights for r3d_18, "
        "mc3_18, r2plus1d_18, s3d, mvit_v2_s, swin3d_t, not for model.backbone: tiny3d; give a weights file, or null"
    )


def test_named_weights_load_from_the_hub_cache_and_without_it_say_where_to_put_the_file(tmp_path, monkeypatch):
    from torchvision.models import get_model_weights
    from torchvision.models._api import WeightsEnum

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    weights = get_model_weights("mc3_18").KINETICS400_V1
    cache = tmp_path / "torch" / "hub" / "checkpoints"

    def offline(self, *args, **kwargs):
        if not (cache / os.path.basename(self.url)).exists():
            raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
        return torch.load(cache / os.path.basename(self.url), weights_only=True)

    monkeypatch.setattr(WeightsEnum, "get_state_dict", offline)
    model_cfg = load_config(None, ["model.backbone=mc3_18", "model.pretrained=kinetics400"]).model
    with pytest.raises(PretrainedError) as info:
        build_model(model_cfg, 5)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "model.pretrained: kinetics400: could not download torchvision's mc3_18 weights (<urlopen error [Errno -3] "
        f"Temporary failure in name resolution>); fetch {weights.url} on a machine with network and put it in "
        f"{cache}/ here (read from there without network)"
    )
    from torchvision.models.video import mc3_18

    torch.manual_seed(0)
    fetched = mc3_18().state_dict()  # the file as torchvision publishes it: its own module names, its classifier
    cache.mkdir(parents=True)
    torch.save(fetched, cache / os.path.basename(weights.url))
    model = build_model(model_cfg, 5)
    for name, value in model.rgb.net.state_dict().items():
        if not name.startswith("fc."):
            assert torch.equal(value, fetched[name]), name


@pytest.mark.parametrize(
    "preset", [p for p in GPU_PRESETS if load_config(os.path.join(ROOT, "configs", p)).trainer.channels_last_3d]
)
def test_a_preset_s_channels_last_layout_reaches_the_model_and_its_input(preset):
    """The layout train.py gives a 3D CNN on CUDA (trainer.channels_last_3d), as the planner estimates it: every 3D
    convolution's weight and the normalized clip in channels_last_3d (the CUDA run itself: tests/test_cuda.py)."""
    import train
    from planner.project import ProjectStep

    cfg = load_config(os.path.join(ROOT, "configs", preset))  # the step builds it without its weights
    step = ProjectStep(cfg, train.STEP, num_classes=5, gpu=True)
    with torch.device("meta"):
        model = step.classifier()
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) for m in convs)
    assert not ProjectStep(cfg, train.STEP, num_classes=5, gpu=False).channels_last  # a CPU run keeps its layout
    from datasets.device_input import DeviceInputs

    normalize = DeviceInputs(torch.device("cpu"), cfg.data.mean, cfg.data.std, step.channels_last).normalize
    clip = normalize({"video": torch.zeros(2, 3, 4, 8, 8, dtype=torch.uint8)})["video"]
    assert clip.is_contiguous(memory_format=torch.channels_last_3d) and not clip.is_contiguous()
