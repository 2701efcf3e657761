"""``sglang.srt.utils`` (SGLang 0.5.3 ``srt/utils/common.py``, re-exported by the package): the
serializer of ``update_weights_from_tensor``."""
from __future__ import annotations

import base64
import io
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

import fake_sglang_cuda as _fake_cuda


class _Pickler(ForkingPickler):
    """ForkingPickler, as SGLang's serializer; a tensor on a fake GPU travels with its GPU, as a CUDA
    tensor's IPC handle names its device (see :mod:`fake_sglang_cuda`)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return _fake_cuda.reduce_placed(obj)
        return NotImplemented


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        """``obj`` pickled by ForkingPickler (tensors by reference: CUDA IPC handles, shared memory);
        ``output_str``: as a base64 string instead of bytes."""
        buf = io.BytesIO()
        _Pickler(buf).dump(obj)
        output = buf.getvalue()
        if output_str:
            output = base64.b64encode(output).decode("utf-8")
        return output

    @staticmethod
    def deserialize(data):
        """The object :meth:`serialize` made (bytes, or its base64 string)."""
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return ForkingPickler.loads(data)
