"""Every configuration key, once: one dataclass per section (``ModelConfig``, ``DataConfig``, ``TrainConfig``,
``InferConfig``, ``TrainerConfig``) under ``Config``, each field with its type, default, range and meaning (a
``Key`` in the field's metadata). ``SCHEMA`` is the same declaration as a mapping, for validation and --print-config;
``configs/base.yaml`` is written from it (config/reference.py) for readers.

The YAML is the user's interface; code below the scripts takes the typed section it uses (``cfg.data``), never the
configuration by string keys."""

from __future__ import annotations

import copy
import difflib
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_args, get_origin, get_type_hints

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
Norm = Literal["batch", "frozen", "sync", "group"]  # model.norm: models/norms.py converts BatchNorm to each
NORMS = get_args(Norm)
# what model.chunk_reconstruction_target may name (models/reconstruction.py computes each)
ReconstructionTarget = Literal["colour", "colour_edges_motion"]
RECONSTRUCTION_TARGETS = get_args(ReconstructionTarget)


@dataclass(frozen=True)
class Key:
    default: Any
    kind: str  # int, float, bool, str, list, choice (its values: the field's Literal), size, precision, any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    nullable: bool = False
    also: tuple = ()  # extra single values allowed outside [minimum, maximum], e.g. -1 for "all"
    refused: tuple = ()  # (value, why) pairs: values a user may expect to work, refused with their reason


def setting(default: Any, kind: str, help: str, **limits) -> Any:
    """A dataclass field declared by its ``Key``: the default (a fresh copy for a list), and the kind, range and
    meaning validation and the docs read."""
    key = Key(default, kind, help, **limits)
    if isinstance(default, list):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"key": key})
    return field(default=default, metadata={"key": key})


def choice(default: Any, help: str, **limits) -> Any:
    """A field whose allowed values are those of its ``Literal`` annotation (``SCHEMA`` reads them from it)."""
    return setting(default, "choice", help, **limits)


def _literal_values(annotation) -> tuple:
    """The values of a ``Literal[...]`` annotation, or of ``Literal[...] | None``."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return next(_literal_values(a) for a in get_args(annotation) if a is not type(None))


def section_keys(section) -> dict[str, Key]:
    """A section's fields by name, each as its ``Key``; a choice's values are those of its annotation."""
    hints = get_type_hints(section)
    keys = {}
    for f in fields(section):
        key = f.metadata["key"]
        if key.kind == "choice":
            key = replace(key, choices=_literal_values(hints[f.name]))
            if key.default not in key.choices and not (key.nullable and key.default is None):
                raise TypeError(f"{section.__name__}.{f.name}: default {key.default!r} is not one of {key.choices}")
        keys[f.name] = key
    return keys


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
    grad_checkpointing: bool = setting(False, "bool", "recompute each stage's activations in backward")
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
        "side (modules beside the backbone reading model.adapter_taps of its blocks; the backbone runs without a "
        "graph), lora (peft's low-rank updates of the linear layers a transformer's forward calls, or of a CNN's 3D "
        "convolutions); none: the backbone trains, or stays fixed with model.freeze_backbone",
    )
    adapter_width: int = setting(64, "int", "the block and side adapters' bottleneck width", minimum=1)
    adapter_rank: int = setting(8, "int", "model.adapter: lora: the rank of each layer's update", minimum=1)
    adapter_kernel: int = setting(
        3, "int", "frames (tokens in time) the adapters' temporal convolution spans (block, side)", minimum=1
    )
    adapter_taps: int = setting(
        4, "int", "model.adapter: side: the backbone blocks read, evenly spaced, the last among them", minimum=1
    )
    dropout: float = setting(0.0, "float", "dropout before the classifier", minimum=0.0, maximum=1.0)
    width: int = setting(32, "int", "base channel width of the small models (tiny3d, keypoint branch)", minimum=1)
    pretrained: Any = setting(
        None,
        "any",
        "null, a local weights file (torchvision's .pth files work as they are), or true for torchvision's download",
    )
    fusion: Literal["concat", "weighted"] = choice(
        "concat",
        "how RGB and keypoint features combine (rgb_kpt): concat, or weighted (a "
        "learned weighting of both, projected to one size)",
    )
    norm: Norm = choice(
        "batch",
        "the BatchNorm layers of every backbone: batch (statistics of each "
        "micro-batch or training chunk), frozen (the pretrained running statistics, never updated: "
        "fine-tuning at batch 1-2), sync (statistics over every torchrun process; BatchNorm on one) "
        "or group (GroupNorm: per sample, for training from scratch)",
    )
    norm_groups: int = setting(
        32,
        "int",
        "norm: group: groups per layer, lowered to the nearest divisor of its channels that leaves 2 channels a group",
        minimum=1,
    )
    norm_frozen_affine: bool = setting(
        False,
        "bool",
        "norm: frozen: also freeze the BatchNorm scale and shift (false: they train, as MMAction2's norm_eval)",
    )
    temporal_head: Literal["none", "attention", "transformer", "tcn"] = choice(
        "none",
        "the model over a clip's chunk features: none (chunk logits "
        "aggregated by infer.chunk_aggregation, blind to order), attention (attention "
        "pooling with positions), transformer (an encoder over the chunks, then that "
        "pooling) or tcn (MS-TCN's multi-stage dilated convolutions, linear in length)",
    )
    temporal_width: int = setting(64, "int", "temporal head: token width", minimum=2)
    temporal_layers: int = setting(2, "int", "temporal head (transformer): encoder layers", minimum=1)
    temporal_stages: int = setting(
        4, "int", "temporal head (tcn): stages, each refining the one before (MS-TCN: 4)", minimum=1
    )
    temporal_tcn_layers: int = setting(
        10,
        "int",
        "temporal head (tcn): dilated layers per stage; a receptive field of 2^layers chunks (MS-TCN: 10)",
        minimum=1,
    )
    temporal_head_init: str | None = setting(
        None,
        "str",
        "a checkpoint whose temporal head (e.g. one trained on features, data.features_dir) starts this run's head",
        nullable=True,
    )
    temporal_attention_heads: int = setting(
        4, "int", "temporal head: attention heads (must divide temporal_width)", minimum=1
    )
    temporal_attention: Literal["directional", "bidirectional"] = choice(
        "directional",
        "temporal head (transformer): directional (half the "
        "heads attend to earlier chunks, half to later ones: order is in the features "
        "from the first step) or bidirectional (every head attends to every chunk)",
    )
    temporal_input_norm: bool = setting(
        True,
        "bool",
        "temporal head (transformer): LayerNorm on each chunk's "
        "features before its projection, so a clip-wide shift or scale of the "
        "features (brightness, contrast) does not move the tokens",
    )
    temporal_contrast: bool = setting(
        True,
        "bool",
        "temporal head (transformer): each token also sees its chunk's "
        "difference from the clip's mean chunk, so what changes within a clip stands "
        "out of what every chunk shares",
    )
    temporal_running: bool = setting(
        True,
        "bool",
        "temporal head (transformer): each token also sees the running sum of its clip's contrast up to its "
        "chunk: how much of each kind of event has come so far (what came first, more of one than another)",
    )
    temporal_event_contrast: bool = setting(
        False,
        "bool",
        "temporal head (transformer): each token also sees the running sum of its clip's event contrast: each "
        "chunk's contrast against the mean of the clip's events (the chunks that differ from it more than its "
        "median chunk), so kinds of event that differ little beside how far any event lies from the background (a "
        "direction of motion, a rhythm) are counted as the running sum counts kinds that differ much; for a head "
        "over a backbone that does not train (frozen, features on disk)",
    )
    temporal_dropout: float = setting(
        0.0,
        "float",
        "temporal head (attention, transformer): dropout in attention, feed-forward and before its classifier",
        minimum=0.0,
        maximum=1.0,
    )
    temporal_tcn_dropout: float = setting(
        0.5, "float", "temporal head (tcn): dropout in each dilated layer (MS-TCN: 0.5)", minimum=0.0, maximum=1.0
    )
    chunk_reconstruction: float = setting(
        0.0,
        "float",
        "with a temporal head and an RGB backbone that trains: the weight of an auxiliary loss where a linear decoder "
        "from each chunk's features predicts the chunk's thumbnail (model.chunk_reconstruction_target) in 4 x 2 x 2 "
        "bins of time and space, relative to its clip's mean chunk, so the features keep what tells the chunks "
        "apart when the label alone does not ask for it; 1.0 for labels that relate far events told apart by colour "
        "(configs/long-range-relations.yaml); 0: none",
        minimum=0.0,
    )
    chunk_reconstruction_target: ReconstructionTarget = choice(
        "colour",
        "what the chunk reconstruction's thumbnail holds: colour (the mean colour of each bin) or "
        "colour_edges_motion (beside it, the grey frames' edge strength across and along the rows and their change "
        "from frame to frame, signed and its size)",
    )
    chunk_discrimination: float = setting(
        0.0,
        "float",
        "with a temporal head and features that train: the weight of an auxiliary loss where each training chunk "
        "is computed again from its even frames and from its odd frames, and each half must find its other half "
        "among the micro-batch's chunks (InfoNCE), so the features keep whatever tells the chunks apart (colour, "
        "motion, texture, a rhythm) when the label alone does not ask for it; each chunk with a gradient runs twice "
        "more at half its frames, forward and backward; 0: none",
        minimum=0.0,
    )
    chunk_discrimination_temperature: float = setting(
        0.2,
        "float",
        "the chunk discrimination's temperature: the cosine similarities are divided by it (lower: the nearest "
        "other chunks weigh more)",
        minimum=0.0,
        refused=((0, "it divides the similarities: give a value above 0 (0.2 unless you have a reason)"),),
    )


@dataclass
class DataConfig:
    """data: manifests, decoding, sample windows, clips, geometry and augmentation, and the DataLoader."""

    data_dir: str = setting("data/synthetic", "str", "directory the manifests are resolved against")
    val_fraction: float | None = setting(
        None,
        "float",
        "split this share of the training videos off as validation (by "
        "a hash of each video's path: the same split every run), instead of "
        "data.val_manifest",
        minimum=0.0,
        maximum=1.0,
        nullable=True,
    )
    train_manifest: str = setting("train.jsonl", "str", "training manifest (JSONL, CSV or a root/<class>/ folder)")
    val_manifest: str | None = setting("val.jsonl", "str", "validation manifest", nullable=True)
    test_manifest: str | None = setting("test.jsonl", "str", "test manifest", nullable=True)
    class_names: list | None = setting(
        None, "list", "class names in label order; null = sorted training labels", nullable=True
    )
    features_dir: str | None = setting(
        None,
        "str",
        "train the temporal head on the features files infer_chunked.py "
        "--features wrote here (one sample: one whole video; labels and segments from "
        "the manifests), instead of on video clips",
        nullable=True,
    )
    features_format: Literal["npz", "mstcn"] = choice(
        "npz",
        "npz: data.features_dir holds infer_chunked.py --features files, labels from the manifests; mstcn: it "
        "is a dataset root in MS-TCN's layout (features/*.npy [D, T], groundTruth/*.txt, mapping.txt, "
        "splits/*.bundle: Breakfast, 50Salads, GTEA), read in place, data.frame_stride its sample_rate",
    )
    features_split: int = setting(
        1,
        "int",
        "features_format: mstcn: the cross-validation split N: splits/train.splitN.bundle trains, "
        "test.splitN.bundle validates",
        minimum=1,
    )
    background_labels: list = setting(
        [],
        "list",
        "labels left out of the segments the timeline scores count (edit, "
        "F1@k), as the field's bg_class; frame accuracy counts every frame",
    )
    batch_size: int | str = setting(
        8,
        "int",
        "clips per training micro-batch; auto = the largest whose estimated "
        "memory fits trainer.memory_budget_gb (train.py --probe-memory shows the "
        "estimates)",
        minimum=1,
        also=("auto",),
    )
    num_workers: int = setting(2, "int", "DataLoader worker processes", minimum=0)
    prefetch_factor: int = setting(
        2,
        "int",
        "batches each DataLoader worker loads ahead (with num_workers > 0); host "
        "memory holds num_workers x prefetch_factor batches (train.py --probe-memory)",
        minimum=1,
    )
    img_size: list[int] = setting(
        112, "size", "the model's frame size, after resize and crop: N (square) or [height, width]"
    )
    resize: Literal["short_side", "stretch"] = choice(
        "short_side",
        "short_side: keep the aspect ratio (short side to data.short_side), "
        "then crop to img_size; stretch: decode straight to img_size",
    )
    short_side: int | None = setting(
        None,
        "int",
        "decoded short side (resize: short_side); null = the least that holds the img_size crop",
        minimum=1,
        nullable=True,
    )
    test_clips: int = setting(
        1,
        "int",
        "temporal clips per sample window at evaluation, evenly spaced (first at the "
        "window's start, last at its end; 1: centred), each times data.test_crops; the "
        "video-level result averages them all",
        minimum=1,
    )
    test_crops: int = setting(
        1,
        "int",
        "spatial crops per clip at evaluation: 1 (centre) or 3 (along the long side)",
        minimum=1,
        maximum=3,
        refused=((2, "use 1 (the centre) or 3 (start, centre, end of the long side)"),),
    )
    augment: bool = setting(
        False, "bool", "training augmentation: random resized crop, flip, colour jitter (never at evaluation)"
    )
    crop_scale: list = setting(
        [0.35, 1.0], "list", "augment: area share of the decoded frame a random crop covers [min, max]"
    )
    crop_ratio: list = setting(
        [0.75, 1.3333], "list", "augment: aspect ratio of a random crop, relative to img_size's [min, max]"
    )
    flip: bool = setting(
        True,
        "bool",
        "augment: horizontal flip with probability 0.5 (it turns a movement to the right into one to the left: a label "
        "that names a side or a direction needs data.flip_label_pairs, or false)",
    )
    color_jitter: float = setting(
        0.0,
        "float",
        "augment: brightness, contrast and saturation factors in [1-s, 1+s]; 0 = off",
        minimum=0.0,
        maximum=1.0,
    )
    flip_label_pairs: list | None = setting(
        None,
        "list",
        "augment: classes that swap when a clip is flipped, [[swipe_left, swipe_right], ...]",
        nullable=True,
    )
    kpt_coords: Literal["normalized", "pixels"] = choice(
        "normalized",
        "keypoint x, y: normalized (0..1 of the frame) or pixels (of the stored frame)",
    )
    kpt_flip_pairs: list | None = setting(
        None,
        "list",
        "augment + flip + keypoints: joint indices that swap in a flip, [[5, 6], ...]; [] if no joint has a side",
        nullable=True,
    )
    num_frames: int = setting(
        16, "int", "frames per clip; -1 = every frame of the sample window", minimum=1, also=(-1,)
    )
    frame_stride: int = setting(1, "int", "distance between the decoded frames of a clip", minimum=1)
    load_rgb: bool = setting(True, "bool", "decode video frames")
    load_kpt: bool = setting(False, "bool", "load per-frame keypoints")
    max_video_frames: int | None = setting(
        None,
        "int",
        "split videos into sample windows of at most this many frames; null = whole videos",
        minimum=1,
        nullable=True,
    )
    sample_window_overlap: int = setting(0, "int", "frames shared by consecutive sample windows", minimum=0)
    decoder: Literal["auto", "opencv", "pyav"] = choice(
        "auto",
        "video decoder: auto (the faster exact one for each codec and access "
        "pattern, measured by bench/loader.py), opencv, or pyav (same frames and pixels; also "
        "reads AV1)",
    )
    autorotate: bool = setting(
        True,
        "bool",
        "frames as a viewer sees them: the container's display rotation or mirror "
        "(a phone held upright) applied by every decoder; false = as stored",
    )
    on_bad_video: Literal["raise", "skip"] = choice(
        "raise",
        "a video that cannot be read: stop, or log it and use another sample",
    )
    sample_timeout_s: float | None = setting(
        300.0,
        "float",
        "seconds one sample (or a file's header at indexing, or a "
        "group of inference chunks) may take to load before it counts as a bad "
        "video (a stalled mount); null = no deadline",
        minimum=0.001,
        nullable=True,
    )
    index_cache: str | None = setting(
        None, "str", "JSON cache of video metadata; null = <trainer.output_dir>/.video_index.json", nullable=True
    )
    prepared_dir: str | None = setting(
        None,
        "str",
        "folder of prepared copies (python -m datasets.prepare): each video re-encoded at this config's decode "
        "size with short GOPs, read instead of its source when its copy matches the source and these settings; "
        "null = read the sources",
        nullable=True,
    )
    prepared_gop: int = setting(
        16, "int", "a prepared copy's frames between keyframes (1 = every frame a keyframe)", minimum=1
    )
    prepared_crf: int = setting(
        18,
        "int",
        "a prepared copy's x264 constant quality: 0 = lossless, higher = smaller files",
        minimum=0,
        maximum=51,
    )
    mean: list = setting([0.45, 0.45, 0.45], "list", "per-channel mean (RGB, 0..1) for normalization on the device")
    std: list = setting([0.225, 0.225, 0.225], "list", "per-channel std (RGB, 0..1)")
    pin_memory: bool = setting(True, "bool", "page-locked host batches for non_blocking copies (CUDA only)")


@dataclass
class TrainConfig:
    """train: the optimization, the training chunks, and checkpoints."""

    chunk_train_size: int = setting(
        -1,
        "int",
        "frames per chunk of a training clip, each chunk recomputed in backward "
        "(train.recompute) so training memory no longer grows with the clip; -1 = the "
        "whole clip in one forward",
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
    recompute: Literal["auto", "all"] = choice(
        "auto",
        "training chunks: all recomputes every chunk's activations in "
        "backward (the memory of one chunk, each forward run twice); auto keeps the activations "
        "of as many chunks as trainer.memory_budget_gb holds (decided before the first step) "
        "and recomputes only the rest; without a budget auto recomputes every chunk, as all",
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
    momentum: float = setting(0.9, "float", "SGD momentum", minimum=0.0, maximum=1.0)
    warmup_epochs: float = setting(0.0, "float", "linear warm-up length in epochs (fractions allowed)", minimum=0.0)
    grad_clip: float | None = setting(
        None, "float", "clip the gradient norm to this value (after unscaling); null = off", minimum=0.0, nullable=True
    )
    temporal_lr_scale: float = setting(
        1.0,
        "float",
        "temporal head: its learning rate is train.lr times this (its own "
        "parameter groups, the same schedule); 1 = the backbone's",
        minimum=0.0,
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
    temporal_refit_epochs: int = setting(
        0,
        "int",
        "temporal head on, a backbone that trains: the last this many of trainer.max_epochs train a new head "
        "on the backbone as the epochs before leave it, frozen (its own warm-up and cosine); best.pt keeps "
        "whichever phase validated better; 0 = off",
        minimum=0,
    )
    label_smoothing: float = setting(0.0, "float", "cross-entropy label smoothing", minimum=0.0, maximum=1.0)
    precise_bn_batches: int = setting(
        0,
        "int",
        "before each validation, recompute the BatchNorm running statistics as "
        "the true mean and variance over this many training batches (precise BN); 0 = "
        "off",
        minimum=0,
    )
    seed: int = setting(0, "int", "seed for weights, sampling and clip placement", minimum=0)
    log_every: int = setting(20, "int", "log (and record memory) every N optimizer steps", minimum=1)
    checkpoint_every_steps: int = setting(
        0, "int", "also write last.pt every N optimizer steps; 0 = epoch ends only", minimum=0
    )
    keep_last_k: int = setting(2, "int", "epoch checkpoints kept besides last.pt and best.pt", minimum=0)
    checkpoint_frozen_weights: bool = setting(
        False,
        "bool",
        "with model.adapter: checkpoints hold the frozen backbone's weights too; false: the adapters and the head, "
        "with the fingerprint of model.pretrained's weights, which resume and evaluation load again",
    )
    monitor: Monitored = choice(
        "val_video_acc",
        "metric that picks best.pt (higher is better); the val_seg_* "
        "timeline scores need a validation manifest with segments",
    )


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
        "temporal head: the most chunks a chunk's output (the timeline) "
        "sees; over a longer video, windows of that many overlapping by half (the "
        "video's label sees every chunk). auto = its longest training clip; -1 = the "
        "whole video",
        minimum=-1,
        also=("auto",),
    )


@dataclass
class TrainerConfig:
    """trainer: the device, precision, memory budget, epochs and where runs go."""

    precision: str = setting(
        "32", "precision", "32 | 16 | bf16 (also 16-mixed, bf16-mixed); amp = 16 on CUDA, bf16 on CPU"
    )
    max_epochs: int = setting(10, "int", "training epochs", minimum=1)
    check_val_every_n_epoch: int = setting(1, "int", "validate every N epochs (and after the last)", minimum=1)
    device: str = setting("auto", "str", "auto (cuda if available), cpu, cuda or cuda:N")
    output_dir: str = setting("runs", "str", "where run directories are created")
    memory_budget_gb: float | None = setting(
        None, "float", "the device memory this preset is sized for (--probe-memory uses it)", minimum=0.0, nullable=True
    )
    compile: bool = setting(False, "bool", "torch.compile the model")
    channels_last_3d: bool = setting(False, "bool", "channels_last_3d memory format for 3D CNNs on CUDA")
    allow_tf32: bool = setting(True, "bool", "TF32 matmuls and convolutions on Ampere and newer")
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
    max_nonfinite_steps: int = setting(20, "int", "consecutive non-finite losses that stop the run", minimum=1)
    leak_check_epochs: int = setting(3, "int", "epochs of steady memory growth before the leak warning", minimum=1)
    leak_tolerance_mb: float = setting(
        256.0, "float", "total growth (MB) over those epochs that triggers it", minimum=0.0
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
