"""Running megatron-core on a machine without CUDA (posttrain's CPU tests): every workaround
in one place, applied only when ``torch.cuda.is_available()`` is False.

megatron-core 0.16 assumes a GPU in a handful of places that are not about computing:

1. Buffers placed with ``device=torch.cuda.current_device()`` (grad buffers of its
   ``DistributedDataParallel``, the global memory buffer of tensor-parallel gathers, the
   rotary-embedding frequencies, pipeline send/receive buffers). :func:`apply` makes
   ``torch.cuda.current_device()`` return ``"cpu"``.
2. Small tensors created with a literal ``device="cuda"`` (token counters in the pipeline
   schedules, the default causal mask, the optimizer's loss-scale and norm scalars) and
   ``.cuda()`` calls; and type checks of parameters against ``"torch.cuda.FloatTensor"``
   names in its optimizers. :func:`cuda_as_cpu` is a torch function mode that, while
   active, turns CUDA devices in any torch call into the CPU, makes ``Tensor.cuda()``
   return the tensor itself and reports ``Tensor.type()`` under the CUDA name of the same
   dtype. The worker enters it around every call into megatron-core.
3. ``torch.cuda.synchronize``, ``torch.cuda.empty_cache`` (no device to wait for or free).
   :func:`apply` makes them no-ops.
4. The RNG tracker: megatron-core seeds CUDA generators per parallel region (dropout in
   tensor-parallel regions). :func:`seed_rng` installs its inference tracker instead, whose
   regions use the default generator; posttrain converts only models without dropout, so
   no random number is drawn inside those regions.
5. The all-to-all token dispatcher of mixtures of experts copies its token counts to the host
   on a side CUDA stream (``torch.cuda.Stream``, ``torch.cuda.stream``, events).
   :func:`apply` gives it a stream whose waits and events do nothing (there is one stream of
   work on the CPU).
6. The same copies return the counts as numpy arrays, the split sizes ``all_to_all_single``
   takes, only for tensors that were on a GPU; :func:`apply` makes them do so for CPU tensors.

Nothing here changes a number megatron-core computes: the same kernels run on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def needed() -> bool:
    """True on a machine (or in a process) without CUDA."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Patch the process-wide ``torch.cuda`` functions megatron-core calls (items 1, 3 and 5
    above) and its dispatcher's copies to the host (item 6). Idempotent; does nothing where
    CUDA is available."""
    global _APPLIED
    if _APPLIED or not needed():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    _host_split_sizes()
    _APPLIED = True


class _HostEvent:
    def synchronize(self) -> None:
        pass


class _HostStream:
    """Item 5: the one stream of work of a CPU process."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _host_split_sizes() -> None:
    """Item 6."""
    from megatron.core.transformer.moe import token_dispatcher

    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(to_host)
    def host_counts(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and isinstance(tensor, torch.Tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = host_counts


def seed_rng(seed: int) -> None:
    """megatron-core's model-parallel seeding (call after its parallel state exists): CUDA
    generators on a GPU, the inference tracker (default generator) without CUDA."""
    from megatron.core import tensor_parallel

    if needed():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
        torch.manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.split(":")[0] == "cuda"


def _to_cpu(value: Any) -> Any:
    return "cpu" if _is_cuda(value) else value


#: CUDA tensor type names by dtype, for ``Tensor.type()``.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
}


class _CudaAsCpu(TorchFunctionMode):
    """Item 2 of the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _to_cpu(kwargs["device"])}
        if func is torch.Tensor.to or func is torch.Tensor.new_empty:
            args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """While active (on this thread), CUDA devices in torch calls mean the CPU (item 2).
    A no-op context where CUDA is available."""
    if not needed():
        yield
        return
    with _CudaAsCpu():
        yield


def cuda_as_cpu_method(method):
    """Decorator: run ``method`` inside :func:`cuda_as_cpu`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with cuda_as_cpu():
            return method(*args, **kwargs)

    return wrapper
