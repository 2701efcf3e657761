"""``sglang.srt.model_executor.model_runner`` (SGLang 0.5.3 to 0.5.10; from 0.5.16 the two live in
``srt/model_executor/model_runner_components/weight_updater.py``): one tensor per TP rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from sglang.srt.utils import MultiprocessingSerializer


def _unwrap_tensor(tensor, tp_rank, device):
    if isinstance(tensor, LocalSerializedTensor):
        tensor = tensor.get(tp_rank)
    return tensor.to(device)


@dataclass
class LocalSerializedTensor:
    """torch.Tensor that gets serialized by MultiprocessingSerializer (which only serializes a pointer
    and not the data). The i-th element in the list corresponds to i-th rank's GPU."""

    values: List[bytes]

    def get(self, rank: int):
        return MultiprocessingSerializer.deserialize(self.values[rank])
