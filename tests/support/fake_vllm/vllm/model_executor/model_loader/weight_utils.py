import torch

from vllm.device_allocator.cumem import check_mapped


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """As vLLM's: the shapes must match, then an in-place copy (which faults on memory that sleep
    mode released)."""
    check_mapped(param)
    assert param.size() == loaded_weight.size(), (
        f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
    param.data.copy_(loaded_weight)
