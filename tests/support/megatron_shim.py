"""Run megatron-core's CUDA code paths on the CPU, for tests on machines without a GPU.

megatron-core calls CUDA directly in its forward/backward, its DDP wrapper, its pipeline
schedules and its optimizer (``device="cuda"``, ``torch.cuda.current_device()``, CUDA streams
and events, the CUDA RNG tracker, ``grad.type() == "torch.cuda.FloatTensor"`` asserts).
:func:`cpu_device_shim` makes those calls land on the CPU for the duration of a ``with``
block, so that the production code path (the one that runs on GPUs) is what the tests
exercise:

* a :class:`~torch.overrides.TorchFunctionMode` rewrites CUDA device requests (``device=``
  arguments, ``Tensor.cuda()``, ``Tensor.to("cuda")``, integer device ordinals) to the CPU
  and drops ``pin_memory``; ``Tensor.type()`` of a CPU tensor answers with the CUDA type name
  (``torch.cuda.FloatTensor``), which is what Megatron's type checks expect;
* ``torch.cuda`` device, stream, event, synchronisation, memory and RNG functions become
  no-ops or their CPU equivalents (``torch.cuda.is_available()`` stays False, so the
  trainer picks gloo and the CPU);
* Megatron's CUDA RNG state getters/setters (``tensor_parallel.random``) use the CPU
  generator.

It lives in the tests only and is applied inside each spawned test rank, or (through
:func:`shim_trainer_class`, called by ``megatron_cpu_site/sitecustomize.py``) around every
method of the Megatron trainer in the Ray actors of an end-to-end run; nothing in the
package imports it. Everything it patches is restored when the block exits.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an ordinal means CUDA


def _map(value):
    return _CPU if _is_cuda(value) else value


class _CudaToCpu(TorchFunctionMode):
    """Every CUDA device request becomes a CPU one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if func in (torch.Tensor.is_pinned, torch.Tensor.pin_memory):
            return False if func is torch.Tensor.is_pinned else args[0]
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:  # t.to("cuda"), t.to(0), t.to(device, dtype)
            args = tuple(_map(a) for a in args)
        return func(*args, **kwargs)


class _NullStream:
    """Stands for a CUDA stream or event: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def query(self):
        return True

    def record_event(self, *args, **kwargs):  # an event to synchronise with later (MoE token dispatch)
        return _NullStream()

    def elapsed_time(self, other):
        return 0.0


def _cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(state, *args, **kwargs):
    torch.set_rng_state(state)


@contextlib.contextmanager
def cpu_device_shim() -> Iterator[None]:
    """Within the block megatron-core's CUDA calls run on the CPU (see the module docstring)."""
    from megatron.core.tensor_parallel import random as mrandom

    cuda = torch.cuda
    patches = {
        (cuda, "current_device"): lambda: 0,
        (cuda, "device_count"): lambda: 1,
        (cuda, "set_device"): lambda *a, **k: None,
        (cuda, "synchronize"): lambda *a, **k: None,
        (cuda, "empty_cache"): lambda: None,
        (cuda, "Stream"): _NullStream,
        (cuda, "Event"): _NullStream,
        (cuda, "current_stream"): lambda *a, **k: _NullStream(),
        (cuda, "default_stream"): lambda *a, **k: _NullStream(),
        (cuda, "stream"): lambda *a, **k: contextlib.nullcontext(),
        (cuda, "set_stream"): lambda *a, **k: None,
        (cuda, "memory_allocated"): lambda *a, **k: 0,
        (cuda, "memory_reserved"): lambda *a, **k: 0,
        (cuda, "max_memory_allocated"): lambda *a, **k: 0,
        (cuda, "manual_seed"): lambda *a, **k: None,
        (cuda, "manual_seed_all"): lambda *a, **k: None,
        (cuda, "get_rng_state"): _cpu_rng_state,
        (cuda, "set_rng_state"): _set_cpu_rng_state,
        (mrandom, "_get_cuda_rng_state"): _cpu_rng_state,
        (mrandom, "_set_cuda_rng_state"): _set_cpu_rng_state,
    }
    # A mode is popped while its own handler runs, and torch.autograd.backward is itself
    # dispatched through the mode: re-enter it around the autograd engine, so that the
    # backward functions (and activation recomputation inside them) see it too.
    engine_run = torch.autograd.graph._engine_run_backward

    def run_backward_in_mode(*args, **kwargs):
        with _CudaToCpu():
            return engine_run(*args, **kwargs)

    # the MoE token dispatcher moves its split sizes "to the CPU" (as numpy arrays: the alltoall
    # takes them as lists of ints) only from CUDA tensors; here they already are on the CPU
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    patches[(moe_utils, "maybe_move_tensor_to_cpu")] = move_to_cpu
    # with expert tensor parallelism the MoE dispatcher all-gathers (and reduce-scatters back) uneven token
    # counts over the expert-tensor-parallel ranks (tensor_parallel.mappings, output_split_sizes), which
    # NCCL takes and gloo refuses: pad to the largest, as the collective would need, and cut
    import torch.distributed as dist

    real_all_gather, real_all_reduce = dist.all_gather, dist.all_reduce

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] if t.dim() else 0 for t in tensor_list]
        if tensor.dim() == 0 or len(set(sizes + [tensor.shape[0]])) == 1:
            return real_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        # the largest count over the group (every rank's own input, so that all pad alike)
        top = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        real_all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        longest = int(top.item())
        padded = tensor.new_zeros(longest, *tensor.shape[1:])
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in tensor_list]
        real_all_gather(parts, padded, group=group)
        for out, part, n in zip(tensor_list, parts, sizes):
            out.copy_(part[:n])
        return None

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        longest = max(t.shape[0] for t in input_list)
        stacked = torch.stack([torch.cat([t, t.new_zeros(longest - t.shape[0], *t.shape[1:])]) for t in input_list])
        real_all_reduce(stacked, op=op, group=group)
        output.copy_(stacked[dist.get_rank(group)][:output.shape[0]])
        return None

    patches[(dist, "all_gather")] = all_gather
    patches[(dist, "reduce_scatter")] = reduce_scatter
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        patches[(token_dispatcher, "maybe_move_tensor_to_cpu")] = move_to_cpu
    patches[(torch.autograd, "_engine_run_backward")] = run_backward_in_mode
    patches[(torch.autograd.graph, "_engine_run_backward")] = run_backward_in_mode
    with contextlib.ExitStack() as stack:
        for (owner, name), value in patches.items():
            stack.enter_context(mock.patch.object(owner, name, value))
        stack.enter_context(_CudaToCpu())
        yield


# --------------------------------------------------------------------------- end-to-end runs

_inside = threading.local()


def _shimmed(method):
    """``method`` run inside the shim; a generator is drained inside it (into a list). A shimmed method
    called from another (``train_sft`` -> ``train`` -> ``compute_grads``) runs in the caller's shim: a nested
    shim's exit would take the CUDA-to-CPU mode away from the rest of the caller."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        if getattr(_inside, "depth", 0):
            out = method(*args, **kwargs)
            return list(out) if inspect.isgenerator(out) else out
        _inside.depth = 1
        try:
            with cpu_device_shim():
                out = method(*args, **kwargs)
                return list(out) if inspect.isgenerator(out) else out
        finally:
            _inside.depth = 0

    return run


def shim_trainer_class(cls) -> None:
    """Make every public method of ``cls`` (and ``__init__``), its own or inherited from chatlearn's
    base classes (``Trainer.train``, ``compute_logprobs``, ...), run inside the shim; each once."""
    names = {name for klass in cls.__mro__ if klass.__module__.startswith("chatlearn.")
             for name, member in vars(klass).items()
             if inspect.isfunction(member) and (name == "__init__" or not name.startswith("_"))}
    for name in sorted(names):
        setattr(cls, name, _shimmed(getattr(cls, name)))
