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
from a budget), what the step allocates on a GPU beyond the estimate (0.86-1.01x of allocated measured) and the
caching allocator's fragmentation (``SAFETY_MARGIN`` of what is left). The estimate compares with
``torch.cuda.max_memory_allocated()``; reserved memory is higher by fragmentation.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from core.runtime import AUTOCAST_DTYPES

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes
MiB, GiB = 2**20, 2**30
CUDA_CONTEXT_BYTES = GiB // 2  # the CUDA context and cuBLAS/cuDNN handles: outside the allocator's figures
# of what is left: what the estimate misses on a GPU and the allocator's fragmentation. Measured on an H200
# (bench/RESULTS.md, GPU suite): the estimate was 0.86-1.01x of max_memory_allocated over the GPU presets, and
# every batch ran with the allocator capped at the budget less the context up to 0.90 of that cap; at 0.10 the
# largest batch of gtx1650 and long-video-16gb ran out of memory under that cap. At 0.22 the lowest ratio puts a
# batch at 0.91 of the cap.
SAFETY_MARGIN = 0.22
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}  # state tensors per parameter (SGD: momentum buffer)


def usable_bytes(budget_gb: float, cuda: bool = True) -> int:
    """The part of a ``budget_gb`` GiB budget a step may fill: on a GPU the CUDA context set aside, then the
    margin of what is left."""
    context = CUDA_CONTEXT_BYTES if cuda else 0
    return int((budget_gb * GiB - context) * (1 - SAFETY_MARGIN))


def margin_text(budget_gb: float, cuda: bool = True) -> str:
    context = f"{CUDA_CONTEXT_BYTES / GiB:.1f} GiB set aside for the CUDA context, then " if cuda else ""
    return (
        f"{usable_bytes(budget_gb, cuda) / GiB:.2f} GiB usable of trainer.memory_budget_gb={budget_gb:g}: "
        f"{context}a {SAFETY_MARGIN:.0%} margin for what a GPU allocates beyond the estimate and fragmentation"
    )


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages (each counted once, however many views share it) and the peak.

    Storages created by ops while the mode is active are tracked automatically; tensors made before it
    (parameters, inputs) are added with :meth:`track`. A storage stops counting when it is freed.
    """

    def __init__(self):
        super().__init__()
        # id of a live storage -> (its weak reference, its bytes, its serial): an id is reused once its storage
        # is freed, so what was alive at the peak is remembered by serial, which a later storage never shares
        self.entries: dict[int, tuple[weakref.ref, int, int]] = {}
        self.serials = itertools.count()
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
        self.entries[key] = (weakref.ref(storage, lambda _, key=key: self._freed(key)), size, next(self.serials))
        self.current += size
        if self.current > self.peak:
            self.reset_peak()

    def _freed(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def reset_peak(self) -> None:
        self.peak = self.current
        self.alive_at_peak = {serial for _, _, serial in self.entries.values()}

    def alive_bytes_at_peak(self, keys: set[int]) -> int:
        """Bytes of the storages among ``keys`` (still alive now) that were alive at the peak."""
        alive = [self.entries[k] for k in keys if k in self.entries]
        return sum(size for _, size, serial in alive if serial in self.alive_at_peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


# CUDA autocast's policy (torch/csrc/autograd/autocast_mode.cpp, the CUDA lists), by op name: ops that run in
# the lower precision, and ops that run in fp32. Every other op runs in the dtype of its inputs.
LOWER_PRECISION_OPS = {
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "_convolution",
    "conv_tbc",
    "linear",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "addmv",
    "addr",
    "baddbmm",
    "addbmm",
    "chain_matmul",
    "multi_dot",
    "prelu",
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "einsum",
}
FP32_OPS = {
    "softmax",
    "log_softmax",
    "layer_norm",
    "group_norm",
    "norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "cross_entropy",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "logsumexp",
    "cumsum",
    "cumprod",
    "prod",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "upsample_trilinear3d",
    "upsample_bilinear2d",
    "interpolate",
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
        return {k: v / 2**20 for k, v in self.__dict__.items()}


def _fake_mode():
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
    dtype = AUTOCAST_DTYPES[precision]
    return CudaAutocast(dtype) if dtype is not None else _FullPrecision()


def estimate_training_step(
    build_model: Callable[[], nn.Module],
    make_inputs: Callable[[], dict],
    step_loss: Callable[[nn.Module, dict], torch.Tensor],
    precision: str = "32",
    optimizer: str = "adamw",
    accumulate: int = 1,
    fake: bool = True,
    on_step_start: Callable[[], None] | None = None,
    average_bucket: int = 0,
    ddp_buckets: bool = False,
) -> StepEstimate:
    """Peak device bytes of one training step in its steady state (optimizer state present; under gradient
    accumulation the gradients of earlier micro-batches alive through the forward).

    ``build_model()`` returns the model to train (built inside the fake mode, so its parameters are fake),
    ``make_inputs()`` the batch as it sits on the device, ``step_loss(model, inputs)`` the loss of one forward.
    ``precision``: "32", "16" or "bf16" (CUDA's autocast policy). ``fake=False`` runs on real CPU tensors (to
    check the estimate against a step that really allocates). The optimizer step is modelled, not run (a fake
    step cannot read its step counter): its state, then one parameter-sized set of temporaries as torch's
    foreach implementation on CUDA makes. ``on_step_start`` is called as the measured step begins (a benchmark
    resets the process's peak memory there). ``average_bucket``: under torchrun, the largest bucket the
    gradients are averaged through after backward (``average_gradients`` of engine/training/oom.py; at most the
    gradients' size), alive beside them. ``ddp_buckets``: DistributedDataParallel's gradient buckets
    (train.ddp_sync: during_backward), gradient-sized and alive from the start; the gradients are views of them once a
    backward synced, but the forward that makes the peak already has them whole, so they are counted beside the
    gradients.
    """
    meta = _on_meta(build_model, fake)
    with _fake_mode() if fake else contextlib.nullcontext():
        model = _with_storage(meta, build_model)
        tracker = LiveBytes()
        with tracker:
            params = [p for p in model.parameters()]
            for tensor in [*params, *model.buffers()]:
                tracker.track(tensor)
            trained = [p for p in params if p.requires_grad]
            states = [torch.zeros_like(p) for p in trained for _ in range(OPTIMIZER_STATES[optimizer])]
            buckets = [torch.empty_like(p) for p in trained] if ddp_buckets else []  # noqa: F841 (alive, counted)
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
            if average_bucket:  # the gradients averaged across processes through one bucket, then freed
                gradient_bytes = sum(p.numel() * p.element_size() for p in trained)
                bucket = torch.empty(min(average_bucket, gradient_bytes), dtype=torch.uint8)
                del bucket
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


def estimate_inference(
    build_model: Callable[[], nn.Module],
    make_inputs: Callable[[], dict],
    forward: Callable[[nn.Module, dict], torch.Tensor],
    precision: str = "32",
    fake: bool = True,
) -> int:
    """Peak device bytes of one inference forward (no graph kept): parameters, inputs and the largest set of
    activations alive at once."""
    meta = _on_meta(build_model, fake)
    with _fake_mode() if fake else contextlib.nullcontext():
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
