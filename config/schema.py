"""Every configuration key, once: one dataclass per section (``ModelConfig``, ``DataConfig``, ``TrainConfig``,
``InferConfig``, ``TrainerConfig``) under ``Config``, each field with its type, default, range and meaning (a
``Key`` in the field's metadata). ``SCHEMA`` is the same declaration as a mapping, for validation and --print-config;
``configs/base.yaml`` is written from it (config/reference.py) for readers.

The YAML is the user's interface; code below the scripts takes the typed section it uses (``cfg.data``), never the
configuration by string keys."""

from __future__ import annotations

import copy
import difflib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from config.data_schema import DataConfig
from config.keys import choice, section_keys, setting
from core.metric_names import Monitored

# The RGB backbones a config may name. The schema owns the names; models/ registers one builder for each, and
# registering a name missing here fails at import (so config never imports the model registry above it).
BACKBONES = (
    "tiny3d",
    "vgg3d",
    "r3d_18",
    "mc3_18",
    "r2plus1d_18",
    "s3d",
    "swin3d_t",
    "mvit_v2_s",
    "resnet18",
    "resnet34",
    "resnet50",
)
# Backbones of optional packages (models/external.py): "timm/<model name>", "hf/<local directory or hub name>".
EXTERNAL_BACKBONES = {"timm/": "timm", "hf/": "transformers"}
# Weights model.pretrained may name: the backbones torchvision has them for, each with the normalization its weights
# were trained with (torchvision's weights.transforms(): data.mean and data.std left null take it). true for one of
# these backbones is torchvision's default weights, the same Kinetics-400 ones.
_KINETICS_CNN = {"mean": [0.43216, 0.394666, 0.37645], "std": [0.22803, 0.22145, 0.216989]}
DEFAULT_NORMALIZATION = {"mean": [0.45, 0.45, 0.45], "std": [0.225, 0.225, 0.225]}
NAMED_WEIGHTS = {
    "kinetics400": {
        "r3d_18": _KINETICS_CNN,
        "mc3_18": _KINETICS_CNN,
        "r2plus1d_18": _KINETICS_CNN,
        "s3d": _KINETICS_CNN,
        "mvit_v2_s": DEFAULT_NORMALIZATION,
        "swin3d_t": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
    }
}
Norm = Literal["batch", "frozen", "sync", "group"]  # model.norm: models/norms.py converts BatchNorm to each
NORMS = get_args(Norm)


@dataclass
class ModelConfig:
    """model: the network: backbone, input, normalization layers and the temporal head."""

    backbone: str = setting(
        "tiny3d",
        "str",
        "model name from the registry (python -m models --list), timm/<name> (a timm image model on every frame) "
        "or hf/<directory or hub name> (a transformers video model: VideoMAE, V-JEPA 2)",
    )
    model_class_num: int | None = setting(
        None, "int", "number of classes; null = from data.class_names or the training labels", minimum=2, nullable=True
    )
    input_type: Literal["rgb", "kpt", "rgb_kpt"] = choice("rgb", "what the model sees")
    view_fusion: Literal["none", "late", "mean", "concat"] = choice("none", "how camera views are combined")
    recompute_blocks: bool = setting(
        False,
        "bool",
        "recompute each block's activations in backward (a 3D CNN's stages, a transformer's layers): less memory "
        "for about a third more compute; the memory planner says when a preset needs it",
    )
    freeze_backbone: bool = setting(
        False,
        "bool",
        "the RGB backbone is not trained: no gradients, no optimizer state, its BatchNorm in eval mode, chunks "
        "forward without a graph (the end-to-end form of training on features: model.pretrained gives it weights)",
    )
    adapter: Literal["none", "block", "side", "lora"] = choice(
        "none",
        "small trained modules on a frozen RGB backbone (its weights neither trained nor saved): block (a "
        "bottleneck with a temporal convolution after each block; the gradient flows through the frozen blocks), "
        "side (modules beside the backbone reading some of its blocks; the backbone runs without a "
        "graph), lora (peft's low-rank updates of the linear layers a transformer's forward calls, or of a CNN's 3D "
        "convolutions); none: the backbone trains, or stays fixed with model.freeze_backbone",
    )
    width: int = setting(32, "int", "base channel width of the small models (tiny3d, keypoint branch)", minimum=1)
    pretrained: Any = setting(
        None,
        "any",
        "null (from scratch), kinetics400 (torchvision's Kinetics-400 weights of r3d_18, mc3_18, r2plus1d_18, s3d, "
        "mvit_v2_s or swin3d_t, downloaded once; data.mean and data.std follow them), true (the library's default "
        "weights: torchvision's, timm's, Hugging Face's), or a local weights file (torchvision's .pth files work as "
        "they are)",
    )
    norm: Norm = choice(
        "batch",
        "the BatchNorm layers of every backbone: batch (statistics of each "
        "micro-batch or training chunk), frozen (the pretrained running statistics, never updated: "
        "fine-tuning at batch 1-2), sync (statistics over every torchrun process; BatchNorm on one) "
        "or group (GroupNorm: per sample, for training from scratch)",
    )
    temporal_head: Literal["none", "attention", "transformer", "tcn"] = choice(
        "none",
        "the model over a clip's chunk features: none (chunk logits "
        "aggregated by infer.chunk_aggregation, blind to order), attention (attention "
        "pooling with positions), transformer (an encoder over the chunks, then that "
        "pooling) or tcn (MS-TCN's multi-stage dilated convolutions, linear in length)",
    )
    chunk_reconstruction: float = setting(
        0.0,
        "float",
        "with a temporal head and an RGB backbone that trains: the weight of an auxiliary loss where a linear decoder "
        "from each chunk's features predicts the chunk's mean colour in 4 x 2 x 2 bins of time and space, relative "
        "to its clip's mean chunk, so the features keep what tells the chunks "
        "apart when the label alone does not ask for it; 1.0 for labels that relate far events told apart by colour "
        "(configs/long-range-relations.yaml); 0: none",
        minimum=0.0,
    )


@dataclass
class TrainConfig:
    """train: what the training loop does: how long, what each step computes (its batches, training chunks, loss
    and gradients), the optimizer and its schedule, when it validates and what it checkpoints."""

    objective: Literal["labels", "motion"] = choice(
        "labels",
        "labels: the manifest's labels; motion: the videos alone, no label read (each training chunk gets a "
        "pasted moving patch whose direction the model reads back): a backbone pretrained on footage without "
        "labels, for model.pretrained (docs/pretraining.md)",
    )
    max_epochs: int = setting(10, "int", "training epochs", minimum=1)
    check_val_every_n_epoch: int = setting(1, "int", "validate every N epochs (and after the last)", minimum=1)

    chunk_train_size: int = setting(
        -1,
        "int",
        "frames per chunk of a training clip, each chunk recomputed in backward (but the last ones, as many as "
        "trainer.memory_budget_gb holds) so training memory no longer grows with the clip; -1 = the whole clip in "
        "one forward",
        minimum=1,
        also=(-1,),
    )
    chunk_train_overlap: int = setting(0, "int", "frames shared by consecutive training chunks", minimum=0)
    ddp_sync: Literal["agreed", "during_backward"] = choice(
        "agreed",
        "several processes: agreed averages the gradients after each "
        "accumulation group, once every rank agreed on its out-of-memory back-off (an OOM on one "
        "rank is survived; the all-reduce comes after backward); during_backward all-reduces during "
        "backward (DistributedDataParallel's hooks; an OOM on one rank stops "
        "every rank, last.pt as the last checkpoint left it)",
    )
    grad_chunks: int | str = setting(
        "all",
        "int",
        "training chunks of a clip the gradient flows through: all, or K drawn at random each step (one from each "
        "of K equal parts of the clip, its gradient weighted by the part's size); the others run forward without a "
        "graph and enter the temporal head or the aggregation detached (less time a frame, the memory of K chunks)",
        minimum=1,
        also=("all",),
    )
    feature_bank: Literal["off", "host", "disk"] = choice(
        "off",
        "with grad_chunks K: keep each training sample's chunk features between epochs (host: in memory; disk: "
        "memory-mapped in the run directory) and compute only the K drawn chunks a step, reading the others from "
        "the bank (TALLFormer); each sample must be the same frames every epoch: no data.augment, and each "
        "training clip is placed as evaluation places it (centred in its window); one process",
    )
    chunk_train_aggregation: Literal["mean", "max", "prob"] = choice(
        "mean",
        "how the chunk logits of a training clip become its prediction for the loss (chunk_loss: clip)",
        refused=(
            (
                "last",
                "'last' means nothing in training (only the last chunk "
                "would learn); use mean, max or prob. Validation's "
                "infer.chunk_aggregation may stay last",
            ),
        ),
    )
    chunk_loss: Literal["clip", "dense"] = choice(
        "clip",
        "clip: one loss per clip on the aggregated chunk logits; dense: one "
        "loss per chunk against the label covering most of its frames (segments)",
    )
    accumulate_grad_batches: int = setting(1, "int", "micro-batches per optimizer step", minimum=1)
    global_batch_size: int | None = setting(
        None,
        "int",
        "clips per optimizer step over all processes, kept by "
        "data.batch_size: auto and --fit-budget through accumulate_grad_batches; "
        "null = batch_size x accumulate_grad_batches x processes as written",
        minimum=1,
        nullable=True,
    )
    optimizer: Literal["adamw", "sgd"] = choice("adamw", "optimizer")
    lr: float = setting(0.001, "float", "peak learning rate", minimum=0.0)
    min_lr: float = setting(0.0, "float", "learning rate at the end of the cosine schedule", minimum=0.0)
    weight_decay: float = setting(0.05, "float", "decoupled weight decay (AdamW) or L2 (SGD)", minimum=0.0)
    warmup_epochs: float = setting(0.0, "float", "linear warm-up length in epochs (fractions allowed)", minimum=0.0)
    grad_clip: float | None = setting(
        None, "float", "clip the gradient norm to this value (after unscaling); null = off", minimum=0.0, nullable=True
    )
    temporal_warmup_epochs: float = setting(
        2.0,
        "float",
        "temporal head on: the linear warm-up lasts at least this many epochs (train.warmup_epochs when longer)",
        minimum=0.0,
    )
    temporal_grad_clip: float | None = setting(
        1.0,
        "float",
        "temporal head on: clip the whole model's gradient norm "
        "to this value unless train.grad_clip is set; null = off",
        minimum=0.0,
        nullable=True,
    )
    precise_bn_batches: int = setting(
        0,
        "int",
        "before each validation, recompute the BatchNorm running statistics as "
        "the true mean and variance over this many training batches (precise BN); 0 = "
        "off",
        minimum=0,
    )
    seed: int = setting(0, "int", "seed for weights, sampling and clip placement", minimum=0)
    checkpoint_every_steps: int = setting(
        0, "int", "also write last.pt every N optimizer steps; 0 = epoch ends only", minimum=0
    )
    keep_last_k: int = setting(2, "int", "epoch checkpoints kept besides last.pt and best.pt", minimum=0)
    monitor: Monitored = choice(
        "val_video_acc",
        "metric that picks best.pt (higher is better); the val_seg_* "
        "timeline scores need a validation manifest with segments",
    )

    @property
    def reads_labels(self) -> bool:
        """Whether the run reads the manifest's labels: train.objective: motion reads the videos alone."""
        return self.objective == "labels"


@dataclass
class InferConfig:
    """infer: how a trained model runs over a clip or a whole video: validation during training, eval.py and
    infer_chunked.py. (The seed guides' train.chunk_infer_size, train.chunk_overlap, train.chunk_aggregation and
    train.video_batch_size still work: RENAMED_KEYS.)"""

    chunk_size: int = setting(
        -1, "int", "frames per inference chunk (one forward pass); -1 = the whole clip at once", minimum=1, also=(-1,)
    )
    chunk_overlap: int = setting(0, "int", "frames shared by consecutive inference chunks", minimum=0)
    chunk_aggregation: Literal["mean", "max", "last", "prob"] = choice(
        "mean",
        "without a temporal head: how chunk logits become one prediction",
    )
    chunks_per_forward: int = setting(
        1, "int", "inference chunks in one forward call (throughput against memory)", minimum=1
    )
    head_chunks: int | str = setting(
        "auto",
        "int",
        "temporal head: the most chunks one pass of the head sees for a chunk's output (the timeline); over a "
        "longer video it runs over spans of that many chunks overlapping by half (the video's label sees every "
        "chunk). auto = its longest training clip; -1 = the whole video at once",
        minimum=-1,
        also=("auto",),
    )


@dataclass
class TrainerConfig:
    """trainer: where the loop runs and what it reports: the device, precision, memory budget, compilation and
    memory layout, several processes, the output directory, logs and plots."""

    log_every: int = setting(20, "int", "log (and record memory) every N optimizer steps", minimum=1)

    precision: str = setting(
        "32", "precision", "32 | 16 | bf16 (also 16-mixed, bf16-mixed); amp = 16 on CUDA, bf16 on CPU"
    )
    device: str = setting("auto", "str", "auto (cuda if available), cpu, cuda or cuda:N")
    output_dir: str = setting("runs", "str", "where run directories are created")
    memory_budget_gb: float | None = setting(
        None, "float", "the device memory this preset is sized for (--probe-memory uses it)", minimum=0.0, nullable=True
    )
    compile: bool = setting(False, "bool", "torch.compile the model")
    channels_last_3d: bool = setting(False, "bool", "channels_last_3d memory format for 3D CNNs on CUDA")
    process_group_timeout_s: float = setting(
        600.0,
        "float",
        "several processes: a collective that waits longer "
        "than this (a rank that died or stopped) ends every rank with an error "
        "instead of a hang",
        minimum=1.0,
    )
    tensorboard: Literal["auto", True, False] = choice(
        "auto",
        "also write every scalar of metrics.csv and memory.csv as TensorBoard events in <run>/tb/: auto (when the "
        "tensorboard package is installed; nothing said when it is not), true (an error without the package) or "
        "false",
    )
    plots: bool = setting(
        True,
        "bool",
        "draw training_curves.png and confusion_matrix.png when the run ends; false for sweeps of many short runs "
        "nobody looks at one by one (metrics.csv holds the same figures; matplotlib's import and the drawing take "
        "a second or two a run)",
    )
    memory_snapshot: Literal["off", "on_oom"] = choice(
        "off",
        "on_oom: on CUDA, record the allocator's history (each allocation's stack: slower allocations, host memory "
        "for up to 100,000 entries) and, at an out-of-memory error in a training step (backed off or fatal), write "
        "memory_snapshot.pickle to the run directory, for pytorch.org/memory_viz; off: record nothing",
    )
    stall_timeout_s: float | None = setting(
        180.0,
        "float",
        "several processes (torchrun): a rank that makes no progress for this long (joining the group, the weights "
        "broadcast, training and validation batches after its first step; waits for data not counted) says where "
        "it waits and ends, so torchrun restarts the group from last.pt; null = off (only "
        "process_group_timeout_s bounds a collective)",
        minimum=1.0,
        nullable=True,
    )


@dataclass
class Config:
    """A whole validated configuration: ``load_config`` (a preset and --set) or ``saved_config`` (a checkpoint's)
    build it; ``to_dict`` gives the YAML's mapping back."""

    experiment: str = setting(
        "default", "str", "run name: results go to <trainer.output_dir>/<experiment>/<timestamp>/"
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """From a validated mapping (config.validation.validate's result)."""
        return cls(
            experiment=values["experiment"],
            **{name: section(**copy.deepcopy(values[name])) for name, section in SECTIONS.items()},
        )


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "infer": InferConfig,
    "trainer": TrainerConfig,
}
SCHEMA: dict[str, Any] = {
    "experiment": next(f.metadata["key"] for f in fields(Config) if f.name == "experiment"),
    **{name: section_keys(section) for name, section in SECTIONS.items()},
}


def defaults() -> dict:
    def build(node):
        return {k: build(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in node.items()}

    return build(SCHEMA)


def flat_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        keys.extend(flat_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [prefix + name])
    return keys


ALL_KEYS = flat_keys(SCHEMA)


def did_you_mean(dotted: str) -> str:
    leaf = dotted.rsplit(".", 1)[-1]
    candidates = difflib.get_close_matches(dotted, ALL_KEYS, n=1, cutoff=0.6)
    if not candidates:  # a key put in the wrong section: match on its last part
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in ALL_KEYS}
        close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.7)
        candidates = [by_leaf[close[0]]] if close else []
    return f"; did you mean '{candidates[0]}'?" if candidates else ""
