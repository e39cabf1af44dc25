"""The device memory of one training step (or one chunked inference forward), estimated on any machine.

train.py's own step (its ``forward_backward`` and ``optimizer_step``, handed in by the script) runs on fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes and dtypes, no data, no memory) while :class:`LiveBytes`,
a dispatch mode, counts the bytes of every live storage, each rounded up to the CUDA caching allocator's 512-byte
blocks, and records the peak and what was alive then.

What it counts: parameters and buffers, gradients (kept between micro-batches under accumulation), the optimizer's
state and its step's temporaries (torch's foreach implementation, as on CUDA), the uint8 clip on the device and
everything the forward and backward allocate: activations saved for backward, recomputed ones (recomputed blocks,
chunked training), temporaries. Mixed precision follows CUDA's autocast: the step runs on fake *CPU* tensors
(backward on fake CUDA tensors asks the driver for a device, pytorch/pytorch#92627) and :class:`CudaAutocast` casts
as CUDA's autocast does (CPU autocast's own policy differs: it also casts pooling and norms to fp32). A value the
step reads back on the host (the scaler's inf/NaN check, a gradient norm's finiteness) is answered as a step that is
taken: nothing found, finite.

What it does not count: the CUDA context (outside PyTorch's allocator, so ``CUDA_CONTEXT_BYTES`` is set aside from a
budget), what the step allocates on a GPU beyond the estimate (cuDNN's workspaces among them) and the caching
allocator's fragmentation (``SAFETY_MARGIN`` of what is left). The estimate compares with
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
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from core.runtime import AUTOCAST_DTYPES

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes
MiB, GiB = 2**20, 2**30
CUDA_CONTEXT_BYTES = GiB // 2  # the CUDA context and cuBLAS/cuDNN handles: outside the allocator's figures
# of what is left: what the estimate misses on a GPU and the allocator's fragmentation, set from the lowest ratio of
# estimate to max_memory_allocated measured on the GPU presets (docs/memory-planner.md)
SAFETY_MARGIN = 0.22


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
    (parameters, inputs) are added with :meth:`track`. A storage stops counting when it is freed. Each storage gets
    a serial, never reused, so what was alive at the peak can be told after it was freed (``bytes_at_peak``).
    A value the step reads on the host that fake tensors do not have is answered as ``HOST_READS`` says.
    """

    def __init__(self):
        super().__init__()
        self.entries: dict[int, tuple[weakref.ref, int]] = {}  # id of a live storage -> (its weak reference, serial)
        self.sizes: dict[int, int] = {}  # serial -> bytes, of every storage tracked
        self.serials = itertools.count()
        self.current = 0
        self.peak = 0
        self.alive_at_peak: set[int] = set()

    def serial(self, tensor: torch.Tensor) -> int:
        """The serial of a tracked tensor's storage."""
        self.track(tensor)
        return self.entries[id(tensor.untyped_storage())][1]

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.entries:
            return
        size, serial = math.ceil(storage.nbytes() / BLOCK) * BLOCK, next(self.serials)
        self.entries[key] = (weakref.ref(storage, lambda _, key=key: self._freed(key)), serial)
        self.sizes[serial] = size
        self.current += size
        if self.current > self.peak:
            self.reset_peak()

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting a tensor's storage: one the real run keeps on the host."""
        self._freed(id(tensor.untyped_storage()))

    def _freed(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.current -= self.sizes[entry[1]]

    def reset_peak(self) -> None:
        self.peak = self.current
        self.alive_at_peak = {serial for _, serial in self.entries.values()}

    def bytes_at_peak(self, serials: set[int]) -> int:
        """Bytes of the storages among ``serials`` that were alive at the peak."""
        return sum(self.sizes[s] for s in serials & self.alive_at_peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except DataDependentOutputException:  # a value read on the host: fake tensors have none
            return HOST_READS[args[0].dtype == torch.bool]
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


# What a host read of a fake tensor answers: the step is one that is taken. A flag (a gradient norm's finiteness)
# reads True; a number (the scaler's count of inf/NaN gradients, its scale) reads 0.
HOST_READS = {True: True, False: 0}


# CUDA autocast's policy (torch/csrc/autograd/autocast_mode.cpp, the CUDA lists), by op name: ops that run in
# the lower precision, and ops that run in fp32. Every other op runs in the dtype of its inputs.
LOWER_PRECISION_OPS = set(
    """
    conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution _convolution conv_tbc
    linear matmul mm bmm addmm addmv addr baddbmm addbmm chain_matmul multi_dot prelu
    scaled_dot_product_attention _scaled_dot_product_attention lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    einsum
    """.split()
)
FP32_OPS = set(
    """
    softmax log_softmax layer_norm group_norm norm frobenius_norm nuclear_norm cosine_similarity cross_entropy
    nll_loss binary_cross_entropy_with_logits kl_div l1_loss smooth_l1_loss huber_loss mse_loss
    margin_ranking_loss soft_margin_loss triplet_margin_loss multi_margin_loss multilabel_margin_loss
    poisson_nll_loss cosine_embedding_loss hinge_embedding_loss acos asin cosh erfinv exp expm1 log log10 log2
    log1p reciprocal rsqrt sinh tan pow softplus logsumexp cumsum cumprod prod dist pdist cdist renorm
    upsample_trilinear3d upsample_bilinear2d interpolate
    """.split()
)


class CudaAutocast(TorchFunctionMode):
    """CUDA autocast's casts on tensors of any device (fake CPU tensors here), seen above autograd so the casts
    are recorded in the graph as autocast's are. Casts of parameters are cached during a forward
    (``start_forward`` .. ``end_forward``), as autocast caches the lower-precision copies of leaf tensors that need
    grad until its context exits. The mode stays active through the backward (``Tensor.backward`` runs with it
    pushed again): forwards recomputed there (checkpointing) are cast as torch.utils.checkpoint recomputes them,
    under the autocast state of their first run, each without a cache."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.caching = False

    def start_forward(self) -> None:
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
        if func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        name = getattr(func, "__name__", "")
        target = self.dtype if name in LOWER_PRECISION_OPS else torch.float32 if name in FP32_OPS else None
        if target is not None:
            args = tuple(self._cast_all(a, target) for a in args)
            kwargs = {k: self._cast_all(v, target) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _backward(self, tensor: torch.Tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        # a torch function runs with the function modes off: the mode is pushed again, and the backward started from
        # the tensor's gradient edge (a tensor argument would be a torch function call of its own)
        with self:
            edge = torch.autograd.graph.get_gradient_edge(tensor)
            grad = torch.ones_like(tensor) if gradient is None else gradient
            torch.autograd.backward(edge, grad_tensors=grad, retain_graph=retain_graph, create_graph=create_graph)

    def _cast_all(self, value, dtype):
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        return self._cast(value, dtype)


class EstimatedRuntime:
    """What the loop's step asks of its runtime (``core.runtime.Runtime``), for a step on fake CPU tensors: its
    ``autocast()`` casts as CUDA's autocast does (``CudaAutocast``), and ``active()`` keeps the casts on through the
    backward and the optimizer step."""

    def __init__(self, precision: str):
        self.precision = precision
        dtype = AUTOCAST_DTYPES[precision]
        self.casts = CudaAutocast(dtype) if dtype is not None else None

    @contextlib.contextmanager
    def autocast(self):
        if self.casts is None:
            yield
            return
        self.casts.start_forward()
        try:
            yield
        finally:
            self.casts.end_forward()

    def active(self):
        return self.casts if self.casts is not None else contextlib.nullcontext()

    def grad_scaler(self) -> torch.amp.GradScaler:
        # the loop's scaler (fp16 needs loss scaling), on the estimate's CPU tensors
        return torch.amp.GradScaler("cpu", enabled=self.precision == "16")


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
        if id(tensor) not in made:  # its strides too: a model in channels_last_3d keeps its layout
            empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
            made[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
        return made[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = fake_like(tensor)
    return model


def estimate_training_step(
    build_model: Callable[[], nn.Module],
    make_inputs: Callable[[], dict],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    forward_backward: Callable,
    optimizer_step: Callable,
    precision: str = "32",
    accumulate: int = 1,
    fake: bool = True,
    on_step_start: Callable[[], None] | None = None,
    average_bucket: int = 0,
    ddp_buckets: bool = False,
) -> StepEstimate:
    """Peak device bytes of one training step in its steady state (the optimizer's state present; under gradient
    accumulation the gradients of earlier micro-batches alive through the forward).

    ``build_model()`` returns the model to train (built inside the fake mode, so its parameters are fake),
    ``make_inputs()`` the batch as it sits on the device, ``make_optimizer(model)`` its optimizer;
    ``forward_backward(model, inputs, runtime, scaler, weight)`` runs one micro-batch's forward and backward and
    ``optimizer_step(model, optimizer, scaler)`` the step after them, as the loop runs them. ``precision``: "32",
    "16" or "bf16" (CUDA's autocast policy). ``fake=False`` runs on real CPU tensors (to check the estimate against a
    step that really allocates). The steady state comes from one optimizer step over zero gradients before the
    measured one. ``on_step_start`` is called as the measured step begins (a benchmark resets the process's peak
    memory there). ``average_bucket``: under torchrun, the largest bucket the gradients are averaged through after
    backward (``average_gradients`` of engine/training/oom.py; at most the gradients' size), alive beside them.
    ``ddp_buckets``: DistributedDataParallel's gradient buckets (train.ddp_sync: during_backward), gradient-sized and
    alive from the start; the gradients are views of them once a backward synced, but the forward that makes the
    peak already has them whole, so they are counted beside the gradients.
    """
    meta = _on_meta(build_model, fake)
    runtime = EstimatedRuntime(precision)
    with _fake_mode() if fake else contextlib.nullcontext():
        model = _with_storage(meta, build_model)
        tracker = LiveBytes()
        with tracker:
            params = [p for p in model.parameters()]
            parameters = {tracker.serial(t) for t in [*params, *model.buffers()]}
            trained = [p for p in params if p.requires_grad]
            optimizer, scaler = make_optimizer(model), runtime.grad_scaler()
            for p in trained:
                p.grad = torch.zeros_like(p)
            scaler.scale(torch.zeros(()))  # the scaler's scale, as the first scaled loss makes it
            optimizer_step(model, optimizer, scaler)  # the optimizer's state, as every step after the first has it
            states = set()
            for state in optimizer.state.values():
                for name, value in state.items():
                    if name == "step" and not value.dim():  # Adam's step count: a host tensor unless fused
                        tracker.forget(value)
                    elif isinstance(value, torch.Tensor):
                        states.add(tracker.serial(value))
            buckets = [torch.empty_like(p) for p in trained] if ddp_buckets else []  # noqa: F841 (alive, counted)
            inputs = make_inputs()
            given = {tracker.serial(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
            if accumulate > 1:
                with runtime.active():  # the gradients of the group's earlier micro-batches
                    forward_backward(model, inputs, runtime, scaler, 1 / accumulate)
            tracker.reset_peak()
            before_step = tracker.current
            if on_step_start is not None:
                on_step_start()
            with runtime.active():
                forward_backward(model, inputs, runtime, scaler, 1 / accumulate)
            gradients = {tracker.serial(p.grad) for p in trained if p.grad is not None}
            if average_bucket:  # the gradients averaged across processes through one bucket, then freed
                gradient_bytes = sum(p.numel() * p.element_size() for p in trained)
                bucket = torch.empty(min(average_bucket, gradient_bytes), dtype=torch.uint8)
                del bucket
            optimizer_step(model, optimizer, scaler)
            sizes = {
                name: tracker.bytes_at_peak(serials)
                for name, serials in (
                    ("parameters", parameters),
                    ("gradients", gradients),
                    ("optimizer_state", states),
                    ("inputs", given),
                )
            }
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
    runtime = EstimatedRuntime(precision)
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
            with torch.inference_mode(), runtime.active(), runtime.autocast():
                out = forward(model, inputs)
            del out
            return tracker.peak
