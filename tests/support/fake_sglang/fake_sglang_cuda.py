"""Stand-in GPUs for the fake SGLang engine on the CPU (not part of SGLang: this models what torch's
CUDA tensors carry). A module of its own beside the ``sglang`` package: the fake's pickles name its
functions, and it stays imported when ``fake_sglang()`` (tests) drops the ``sglang`` modules.

A CPU tensor is *on* a fake GPU once :func:`place` names its storage's GPU; every view of that
storage is on it too. The fake's ``MultiprocessingSerializer`` writes the GPU into what it
serialises, as SGLang's ``monkey_patch_torch_reductions`` (``srt/utils/patch_torch.py``) writes the
device's UUID into a CUDA tensor's IPC handle, and the receiving scheduler checks it. A tensor
rebuilt from such a handle is *received*: torch refuses to share it again ("Attempted to send CUDA
tensor received from another process", ``THPStorage_shareCuda``), and so does the fake.

GPU ``index`` of the devices a process sees is :func:`uuid_of` (the adapter and SGLang's scheduler
processes see the same devices: the schedulers inherit ``CUDA_VISIBLE_DEVICES``). Tests stand
these in for torch's calls (``device_uuid``, ``ipc_rebuild``, copies to ``cuda:i``).
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# storage (StorageImpl address) -> (GPU uuid, received, weak ref that tells a freed storage)
_PLACED: dict[int, tuple[str, bool, StorageWeakRef]] = {}


def uuid_of(index: int) -> str:
    """The UUID of fake GPU ``index``."""
    return f"GPU-fake-{int(index)}"


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def place(tensor: torch.Tensor, uuid: str, received: bool = False) -> torch.Tensor:
    """Put ``tensor``'s storage on the fake GPU ``uuid`` (``received``: mapped from another
    process's memory). Returns ``tensor``."""
    storage = tensor.untyped_storage()
    _PLACED[storage._cdata] = (uuid, received, StorageWeakRef(storage))
    return tensor


def _entry(tensor: torch.Tensor):
    found = _PLACED.get(_key(tensor))
    if found is None or found[2].expired():
        return None
    return found


def device_of(tensor: torch.Tensor) -> str | None:
    """The fake GPU ``tensor`` is on, or None (the CPU)."""
    found = _entry(tensor)
    return None if found is None else found[0]


def is_received(tensor: torch.Tensor) -> bool:
    found = _entry(tensor)
    return found is not None and found[1]


def rebuild_on(uuid: str, rebuild, args) -> torch.Tensor:
    """Unpickle a tensor that was on fake GPU ``uuid``: it is on that GPU, received."""
    return place(rebuild(*args), uuid, received=True)


def reduce_placed(tensor: torch.Tensor):
    """``reducer_override`` of the fake's serializer: a tensor on a fake GPU travels with its GPU;
    one received from another process is refused, as torch refuses to share it again."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = device_of(tensor)
    if uuid is None:
        return NotImplemented
    if is_received(tensor):
        raise RuntimeError("Attempted to send CUDA tensor received from another process; this is not currently "
                           "supported. Consider cloning before sending.")
    return rebuild_on, (uuid, *reduce_tensor(tensor))
