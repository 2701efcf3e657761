"""``current_platform`` of a CUDA machine (vLLM's ``CudaPlatform``): the fake's tensors live on
the CPU, but every platform-dependent choice is the CUDA one."""


class _CudaPlatform:
    device_type = "cuda"

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True

    def is_sleep_mode_available(self) -> bool:
        return True


current_platform = _CudaPlatform()
