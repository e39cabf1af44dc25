"""The device memory of one training step (or one chunked inference forward), estimated on any machine.

The project's real step runs on fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes and
dtypes, no data, no memory) while :class:`LiveBytes`, a dispatch mode, counts the bytes of every live storage,
each rounded up to the CUDA caching allocator's 512-byte blocks, and records the peak and what was alive then.

What is modelled: parameters and buffers, gradients (fp32, kept between micro-batches under accumulation), the
optimizer state (AdamW: 2 tensors per parameter; SGD with momentum: 1) and the parameter-sized temporaries of
torch's foreach optimizer step, the uint8 clip on the device and everything the forward and backward allocate:
activations saved for backward, recomputed ones (gradient checkpointing, chunked training), temporaries.
Mixed precision follows CUDA's autocast: the step runs on fake *CPU* tensors (backward on fake CUDA tensors asks
the driver for a device, pytorch/pytorch#92627) and :class:`CudaAutocast` casts as CUDA's autocast does
(CPU autocast's own policy differs: it also casts pooling and norms to fp32).

What is not: the CUDA context (outside PyTorch's allocator; 0.3-0.5 GB, so ``CUDA_CONTEXT_BYTES`` is set aside
from a budget), cuDNN's workspaces and the caching allocator's fragmentation (``SAFETY_MARGIN`` of what is left).
The estimate compares with ``torch.cuda.max_memory_allocated()``; reserved memory is higher by fragmentation.
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes
MiB, GiB = 2 ** 20, 2 ** 30
CUDA_CONTEXT_BYTES = GiB // 2  # the CUDA context and cuBLAS/cuDNN handles: outside the allocator's figures
SAFETY_MARGIN = 0.10  # of what is left: cuDNN workspaces and the allocator's fragmentation, not modelled
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}  # state tensors per parameter (SGD: momentum buffer)


def usable_bytes(budget_gb: float, cuda: bool = True) -> int:
    """The part of a ``budget_gb`` GiB budget a step may fill: on a GPU the CUDA context set aside, then the
    margin of what is left."""
    context = CUDA_CONTEXT_BYTES if cuda else 0
    return int((budget_gb * GiB - context) * (1 - SAFETY_MARGIN))


def margin_text(budget_gb: float, cuda: bool = True) -> str:
    context = (f"{CUDA_CONTEXT_BYTES / GiB:.1f} GiB set aside for the CUDA context, then " if cuda else "")
    return (f"{usable_bytes(budget_gb, cuda) / GiB:.2f} GiB usable of trainer.memory_budget_gb={budget_gb:g}: "
            f"{context}a {SAFETY_MARGIN:.0%} margin for cuDNN workspaces and fragmentation")


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages (each counted once, however many views share it) and the peak.

    Storages created by ops while the mode is active are tracked automatically; tensors made before it
    (parameters, inputs) are added with :meth:`track`. A storage stops counting when it is freed.
    """

    def __init__(self):
        super().__init__()
        self.entries: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak = 0
        self.alive_at_peak: set[int] = set()

    @staticmethod
    def storage_key(tensor: torch.Tensor) -> int:
        return id(tensor.untyped_storage())

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.entries:
            return
        size = math.ceil(storage.nbytes() / BLOCK) * BLOCK
        self.entries[key] = (weakref.ref(storage, lambda _, key=key: self._freed(key)), size)
        self.current += size
        if self.current > self.peak:
            self.peak = self.current
            self.alive_at_peak = set(self.entries)

    def _freed(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def reset_peak(self) -> None:
        self.peak = self.current
        self.alive_at_peak = set(self.entries)

    def alive_bytes_at_peak(self, keys: set[int]) -> int:
        """Bytes of the storages among ``keys`` (still alive now) that were alive at the peak."""
        return sum(self.entries[k][1] for k in keys & self.alive_at_peak if k in self.entries)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


# CUDA autocast's policy (torch/csrc/autograd/autocast_mode.cpp, the CUDA lists), by op name: ops that run in
# the lower precision, and ops that run in fp32. Every other op runs in the dtype of its inputs.
LOWER_PRECISION_OPS = {
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution",
    "_convolution", "conv_tbc", "linear", "matmul", "mm", "bmm", "addmm", "addmv", "addr", "baddbmm", "addbmm",
    "chain_matmul", "multi_dot", "prelu", "scaled_dot_product_attention", "_scaled_dot_product_attention",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "einsum",
}
FP32_OPS = {
    "softmax", "log_softmax", "layer_norm", "group_norm", "norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "cross_entropy", "nll_loss", "binary_cross_entropy_with_logits", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "logsumexp", "cumsum", "cumprod", "prod", "dist",
    "pdist", "cdist", "renorm", "upsample_trilinear3d", "upsample_bilinear2d", "interpolate",
}


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast's casts on tensors of any device (fake CPU tensors here), seen above autograd so the casts
    are recorded in the graph as autocast's are. Casts of parameters are cached during the forward, as autocast
    caches the lower-precision copies of leaf tensors that need grad until its context exits. Keep the mode
    active through backward (with :meth:`end_forward` called first): recomputation (checkpointing) re-runs Python
    forwards there, each under a fresh autocast context in CUDA's case, so nothing is cached then."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.caching = True

    def end_forward(self) -> None:
        self.cache.clear()
        self.caching = False

    def _cast(self, value, dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype):
            return value
        cacheable = self.caching and value.is_leaf and value.requires_grad and dtype == self.dtype
        if cacheable and id(value) in self.cache:
            return self.cache[id(value)][1]
        cast = value.to(dtype)
        if cacheable:
            self.cache[id(value)] = (value, cast)  # the original kept so its id is not reused
        return cast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = self.dtype if name in LOWER_PRECISION_OPS else torch.float32 if name in FP32_OPS else None
        if target is not None:
            args = tuple(self._cast_all(a, target) for a in args)
            kwargs = {k: self._cast_all(v, target) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _cast_all(self, value, dtype):
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        return self._cast(value, dtype)


@dataclass
class StepEstimate:
    """Bytes at the peak of one step, and what was alive then."""
    peak: int
    parameters: int  # and buffers
    gradients: int
    optimizer_state: int
    inputs: int
    activations: int  # and temporaries: the rest
    before_step: int = 0  # alive when the measured step began (parameters, optimizer state, inputs, ...)

    def row(self) -> dict:
        return {k: v / 2 ** 20 for k, v in self.__dict__.items()}


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=False)


class _FullPrecision(contextlib.nullcontext):
    def __enter__(self):
        return self

    def end_forward(self) -> None:
        pass


def _on_meta(build_model: Callable[[], nn.Module], fake: bool) -> nn.Module | None:
    """Built on the meta device (no memory, no initialization: some initializers, e.g. truncated normal, read
    values, which fake tensors cannot), outside the fake mode; None for a real run."""
    if not fake:
        return None
    with torch.device("meta"):
        return build_model()


def _with_storage(model: nn.Module | None, build_model: Callable[[], nn.Module]) -> nn.Module:
    """Inside the fake mode: the meta model's parameters and buffers replaced by fake CPU tensors of the same
    shapes and dtypes (tied tensors stay tied); a real model is built as it is."""
    if model is None:
        return build_model()
    made: dict[int, torch.Tensor] = {}

    def fake_like(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            made[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
        return made[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = fake_like(tensor)
    return model


def _precision_context(precision: str):
    dtype = {"16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return CudaAutocast(dtype) if dtype is not None else _FullPrecision()


def estimate_training_step(build_model: Callable[[], nn.Module], make_inputs: Callable[[], dict],
                           step_loss: Callable[[nn.Module, dict], torch.Tensor], precision: str = "32",
                           optimizer: str = "adamw", accumulate: int = 1, fake: bool = True,
                           on_step_start: Callable[[], None] | None = None) -> StepEstimate:
    """Peak device bytes of one training step in its steady state (optimizer state present; under gradient
    accumulation the gradients of earlier micro-batches alive through the forward).

    ``build_model()`` returns the model to train (built inside the fake mode, so its parameters are fake),
    ``make_inputs()`` the batch as it sits on the device, ``step_loss(model, inputs)`` the loss of one forward.
    ``precision``: "32", "16" or "bf16" (CUDA's autocast policy). ``fake=False`` runs on real CPU tensors (to
    check the estimate against a step that really allocates). The optimizer step is modelled, not run (a fake
    step cannot read its step counter): its state, then one parameter-sized set of temporaries as torch's
    foreach implementation on CUDA makes. ``on_step_start`` is called as the measured step begins (a benchmark
    resets the process's peak memory there).
    """
    meta = _on_meta(build_model, fake)
    with (_fake_mode() if fake else contextlib.nullcontext()):
        model = _with_storage(meta, build_model)
        tracker = LiveBytes()
        with tracker:
            params = [p for p in model.parameters()]
            for tensor in [*params, *model.buffers()]:
                tracker.track(tensor)
            trained = [p for p in params if p.requires_grad]
            states = [torch.zeros_like(p) for p in trained for _ in range(OPTIMIZER_STATES[optimizer])]
            inputs = make_inputs()
            for value in tree_leaves(inputs):
                if isinstance(value, torch.Tensor):
                    tracker.track(value)

            def forward_backward():
                with _precision_context(precision) as autocast:
                    loss = step_loss(model, inputs)
                    autocast.end_forward()
                    # backward from the loss's gradient edge, not loss.backward(): that is a torch function, run
                    # with the function modes off, and the forwards recomputed in backward must see the casts
                    edge = torch.autograd.graph.get_gradient_edge(loss)
                    torch.autograd.backward(edge, grad_tensors=torch.ones_like(loss))
                del loss

            if accumulate > 1:
                forward_backward()  # the gradients of the group's earlier micro-batches
            tracker.reset_peak()
            before_step = tracker.current
            if on_step_start is not None:
                on_step_start()
            forward_backward()
            temporaries = [torch.empty_like(p) for p in trained]  # foreach: a parameter-sized set at once
            del temporaries
            keys = {
                "parameters": {tracker.storage_key(t) for t in [*params, *model.buffers()]},
                "gradients": {tracker.storage_key(p.grad) for p in trained if p.grad is not None},
                "optimizer_state": {tracker.storage_key(t) for t in states},
                "inputs": {tracker.storage_key(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)},
            }
            sizes = {name: tracker.alive_bytes_at_peak(group) for name, group in keys.items()}
            peak = tracker.peak
    return StepEstimate(peak=peak, activations=peak - sum(sizes.values()), before_step=before_step, **sizes)


def estimate_inference(build_model: Callable[[], nn.Module], make_inputs: Callable[[], dict],
                       forward: Callable[[nn.Module, dict], torch.Tensor], precision: str = "32",
                       fake: bool = True) -> int:
    """Peak device bytes of one inference forward (no graph kept): parameters, inputs and the largest set of
    activations alive at once."""
    meta = _on_meta(build_model, fake)
    with (_fake_mode() if fake else contextlib.nullcontext()):
        model = _with_storage(meta, build_model).eval()
        tracker = LiveBytes()
        with tracker:
            for tensor in [*model.parameters(), *model.buffers()]:
                tracker.track(tensor)
            inputs = make_inputs()
            for value in tree_leaves(inputs):
                if isinstance(value, torch.Tensor):
                    tracker.track(value)
            with torch.inference_mode(), _precision_context(precision):
                out = forward(model, inputs)
            del out
            return tracker.peak


# ------------------------------------------------------------------------------------ the project's step

class ProjectStep:
    """train.py's training step for a config, as the estimate and the CUDA measurement both run it: the
    classifier of ``build_model``, the chunked training forward (``train.chunk_train_size``) and the loss.
    ``train.chunk_loss: dense`` is run as ``clip`` (the loss sees [chunks, batch, classes] logits either way: no
    memory to speak of)."""

    def __init__(self, cfg: dict, num_classes: int = 10, num_views: int = 1, kpt_shape: tuple | None = None):
        from chunked_forward import ChunkSpec
        train_cfg = cfg["train"]
        self.cfg, self.num_classes, self.num_views, self.kpt_shape = cfg, num_classes, num_views, kpt_shape
        self.spec = ChunkSpec(train_cfg["chunk_train_size"], train_cfg["chunk_train_overlap"])
        self.loss_cfg = {**train_cfg, "chunk_loss": "clip"}
        self.criterion = nn.CrossEntropyLoss(label_smoothing=train_cfg["label_smoothing"])

    def classifier(self) -> nn.Module:
        from models import build_model
        return build_model({**self.cfg["model"], "pretrained": None}, self.num_classes, self.num_views,
                           self.kpt_shape)

    def inputs(self, frames: int, batch: int, device) -> dict:
        return _step_inputs(self.cfg, frames, batch, self.num_views, self.kpt_shape, device)

    def loss(self, classifier: nn.Module, inputs: dict, device) -> torch.Tensor:
        """The forward and loss of train.py's step; frames normalized on ``device`` per chunk."""
        from chunked_forward import ChunkedTrainingForward
        from datasets.transforms import InputPreparer
        from train import training_loss
        data = self.cfg["data"]
        forward = ChunkedTrainingForward(classifier, InputPreparer(device, data["mean"], data["std"]).normalize)
        model_inputs = {k: v for k, v in inputs.items() if k in ("video", "kpt")}
        return training_loss(forward(model_inputs, self.spec), inputs, self.spec, self.loss_cfg, self.criterion)


def config_training_estimate(cfg: dict, num_frames: int | None = None, batch_size: int | None = None,
                             num_classes: int = 10, num_views: int = 1, kpt_shape: tuple | None = None,
                             precision: str | None = None, fake: bool = True) -> StepEstimate:
    """One training step of a config as train.py runs it (``ProjectStep``), with the preset's precision,
    checkpointing, AdamW/SGD state and accumulation, the uint8 clip (views, keypoints) on the device."""
    frames = num_frames or cfg["data"]["num_frames"]
    if frames < 1:
        raise ValueError("num_frames -1 (every frame of the window): give the clip length to estimate")
    batch = batch_size or cfg["data"]["batch_size"]
    step, device = ProjectStep(cfg, num_classes, num_views, kpt_shape), torch.device("cpu")
    return estimate_training_step(lambda: step.classifier().train(), lambda: step.inputs(frames, batch, device),
                                  lambda model, inputs: step.loss(model, inputs, device),
                                  precision or cfg["trainer"]["precision"], cfg["train"]["optimizer"],
                                  cfg["train"]["accumulate_grad_batches"], fake=fake)


def measure_training_step_cuda(cfg: dict, num_frames: int, batch_size: int, num_classes: int = 10,
                               num_views: int = 1, kpt_shape: tuple | None = None,
                               precision: str | None = None) -> dict | None:
    """The same step on the GPU, really allocated: a warm-up step first (cuDNN's algorithm search with
    ``cudnn.benchmark``, the optimizer state), then the measured one. {"allocated", "reserved"} peak bytes of
    the measured step, or None if it ran out of memory."""
    from runtime import Runtime
    from train import build_optimizer

    device = torch.device("cuda")
    runtime = Runtime(device, precision or cfg["trainer"]["precision"])
    step = ProjectStep(cfg, num_classes, num_views, kpt_shape)
    classifier = optimizer = inputs = None
    try:
        classifier = step.classifier().to(device).train()
        optimizer = build_optimizer(classifier, cfg["train"])
        scaler = runtime.grad_scaler()
        inputs = step.inputs(num_frames, batch_size, device)

        def forward_backward():
            with runtime.autocast():
                loss = step.loss(classifier, inputs, device)
            scaler.scale(loss).backward()

        def optimizer_step():
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

        forward_backward()
        optimizer_step()
        if cfg["train"]["accumulate_grad_batches"] > 1:
            forward_backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        optimizer_step()
        torch.cuda.synchronize()
        return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del classifier, optimizer, inputs
        torch.cuda.empty_cache()


def _step_inputs(cfg: dict, frames: int, batch: int, num_views: int, kpt_shape, device) -> dict:
    """A batch as it sits on the device: uint8 frames ([B, (V,) C, T, H, W]), float keypoints, labels."""
    height, width = cfg["data"]["img_size"]
    inputs = {"label": torch.zeros(batch, dtype=torch.long, device=device)}
    if cfg["model"]["input_type"] in ("rgb", "rgb_kpt"):
        shape = (batch, 3, frames, height, width) if num_views == 1 else (batch, num_views, 3, frames, height, width)
        inputs["video"] = torch.zeros(shape, dtype=torch.uint8, device=device)
    if cfg["model"]["input_type"] in ("kpt", "rgb_kpt"):
        inputs["kpt"] = torch.zeros(batch, frames, *(kpt_shape or (17, 3)), device=device)
    return inputs


def largest_batch(cfg: dict, num_frames: int, usable: int, limit: int = 1024, **shape) -> tuple[int, list]:
    """The largest micro-batch whose estimate fits ``usable`` bytes (0 if not even 1), by doubling then
    bisection (the estimate grows with the batch), and the (batch, estimate) pairs tried."""
    tried = []

    def fits(batch: int) -> bool:
        estimate = config_training_estimate(cfg, num_frames, batch, **shape)
        tried.append((batch, estimate))
        return estimate.peak <= usable

    return _largest(fits, limit), tried


def _largest(fits, limit: int) -> int:
    """The largest n in [1, limit] with fits(n) (0 if none), for a fits() that stays false once false: doubling,
    then bisection."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# ------------------------------------------------------------------------------ train.py --probe-memory

def probe(cfg: dict, cuda: bool, frames_grid: list[int] | None = None, batch_grid: list[int] | None = None,
          out=print, for_gpu: bool = True, **shape) -> int:
    """The table of ``train.py --probe-memory``: estimated peak per num_frames x batch_size, gradient
    checkpointing off and on (with CUDA: measured beside the estimate for the preset's setting), then the
    largest batch within the budget at the preset's clip (``for_gpu``: the CUDA context set aside from it).
    Rows are printed as they are computed."""
    data, model_cfg = cfg["data"], cfg["model"]
    frames = clip_frames(cfg)
    batch = data["batch_size"] if isinstance(data["batch_size"], int) else 8
    frames_grid = frames_grid or sorted({max(1, round(frames * f)) for f in (0.5, 0.75, 1, 1.25, 1.5)})
    batch_grid = batch_grid or sorted({max(1, round(batch * f)) for f in (2 / 3, 1, 4 / 3)})
    precision = cfg["trainer"]["precision"]
    out(f"peak device memory of one training step: {model_cfg['backbone']} at {data['img_size'][0]}x"
        f"{data['img_size'][1]}, precision {precision}, {cfg['train']['optimizer']}, chunk_train_size "
        f"{cfg['train']['chunk_train_size']}, accumulate_grad_batches {cfg['train']['accumulate_grad_batches']}")
    out(f"estimated{'' if cuda else ', no GPU'} (torch {torch.__version__.split('+')[0]}, fake tensors, CUDA's "
        f"autocast policy): peak allocated memory, without the CUDA context, cuDNN workspaces and fragmentation")
    preset_ckpt = model_cfg["grad_checkpointing"]
    header = f"{'num_frames':>10s} {'batch':>5s} {'ckpt off MiB':>12s} {'ckpt on MiB':>11s}"
    if cuda:
        header += f" | measured (ckpt {'on' if preset_ckpt else 'off'}): {'allocated':>9s} {'reserved':>9s} {'est/alloc':>9s}"
    out(header)
    start = time.perf_counter()
    for num_frames in frames_grid:
        for batch_size in batch_grid:
            estimates = {ckpt: config_training_estimate(_with(cfg, "model.grad_checkpointing", ckpt), num_frames,
                                                        batch_size, **shape).peak for ckpt in (False, True)}
            line = f"{num_frames:>10d} {batch_size:>5d} {estimates[False] / MiB:>12.0f} {estimates[True] / MiB:>11.0f}"
            if cuda:
                measured = measure_training_step_cuda(cfg, num_frames, batch_size, **shape)
                if measured is None:
                    line += f" | {'':>25s} {'OOM':>9s}"
                else:
                    line += (f" | {'':>25s} {measured['allocated'] / MiB:>9.0f} {measured['reserved'] / MiB:>9.0f} "
                             f"{estimates[preset_ckpt] / measured['allocated']:>8.2f}x")
            out(line)
    out(f"({len(frames_grid) * len(batch_grid) * 2} estimates in {time.perf_counter() - start:.0f} s)")
    budget = cfg["trainer"]["memory_budget_gb"]
    if not budget:
        out("trainer.memory_budget_gb is not set: no largest batch computed")
        return 0
    usable = usable_bytes(budget, cuda=for_gpu)
    best, _ = largest_batch(cfg, frames, usable, **shape)
    out(margin_text(budget, cuda=for_gpu))
    out(f"largest batch at num_frames={frames} (checkpointing {'on' if preset_ckpt else 'off'}, as in the preset) "
        f"that fits: {best if best else 'none: even 1 clip does not fit'}")
    return 0


def clip_frames(cfg: dict) -> int:
    """The clip length to estimate: data.num_frames, or for -1 (every frame of the window) the sample window."""
    frames = cfg["data"]["num_frames"]
    if frames > 0:
        return frames
    return cfg["data"]["max_video_frames"] or 32


def _with(cfg: dict, dotted: str, value) -> dict:
    """A validated copy of ``cfg`` with one key changed (config.apply_flags)."""
    from config import apply_flags
    return apply_flags(cfg, {dotted: (f"{dotted}: {value}", value)})


def nothing_fits(cfg: dict, frames: int, one_clip: int, usable: int, budget: float, cuda: bool, shape: dict) -> str:
    """The one-line error when even 1 clip does not fit: which switch would, each with its estimate."""
    data, model_cfg, train_cfg = cfg["data"], cfg["model"], cfg["train"]
    height, width = data["img_size"]
    options = []
    if not model_cfg["grad_checkpointing"]:
        options.append(("model.grad_checkpointing: true", _with(cfg, "model.grad_checkpointing", True), frames))
    chunk = 16 if frames > 16 else None
    if chunk and (train_cfg["chunk_train_size"] == -1 or train_cfg["chunk_train_size"] > chunk):
        chunked = _with(_with(cfg, "train.chunk_train_size", chunk), "train.chunk_train_overlap", 0)
        options.append((f"train.chunk_train_size: {chunk}", chunked, frames))
    if frames > 1:
        options.append((f"data.num_frames: {frames // 2}", cfg, frames // 2))
    smaller = [max(1, height * 3 // 4), max(1, width * 3 // 4)]
    options.append((f"data.img_size: {smaller}", _with(cfg, "data.img_size", smaller), frames))
    parts = []
    for name, changed, clip in options:
        peak = config_training_estimate(changed, clip, 1, **shape).peak
        parts.append(f"{name} {peak / GiB:.2f} GiB{' (fits)' if peak <= usable else ''}")
    return (f"data.batch_size: even 1 clip of {frames} frames at {height}x{width} is estimated at "
            f"{one_clip / GiB:.2f} GiB, over the {margin_text(budget, cuda)}. Estimated for 1 clip with one change: "
            + "; ".join(parts))


# ------------------------------------------------------------------------------- inference: --batch auto

def config_inference_estimate(cfg: dict, chunk_frames: int, windows: int, num_classes: int = 10,
                              num_views: int = 1, kpt_shape: tuple | None = None, precision: str = "32",
                              fake: bool = True) -> int:
    """Peak device bytes of one inference forward of ``windows`` chunks of ``chunk_frames`` frames, as
    infer_chunked.py runs it: the uint8 chunks on the device, normalized, through the model in eval mode."""
    from datasets.transforms import InputPreparer

    data, device = cfg["data"], torch.device("cpu")
    frames, step = max(chunk_frames, 1), ProjectStep(cfg, num_classes, num_views, kpt_shape)

    def make_inputs():
        return {k: v for k, v in step.inputs(frames, windows, device).items() if k != "label"}

    def forward(model, inputs):
        prepare = InputPreparer(device, data["mean"], data["std"])
        return model(prepare(inputs))

    return estimate_inference(step.classifier, make_inputs, forward, precision, fake=fake)


def largest_inference_batch(cfg: dict, chunk_frames: int, usable: int, limit: int = 256, **shape) -> int:
    """The most chunks per forward whose estimate fits ``usable`` bytes (0 if not even 1)."""
    def fits(windows: int) -> bool:
        return config_inference_estimate(cfg, chunk_frames, windows, **shape) <= usable

    return _largest(fits, limit)
