"""vLLM's layerwise in-place reload (``reload/layerwise.py``, vLLM >= 0.16): present, so that the
adapter detects it as in 0.32, but not modelled. The fake's platform is CUDA and its models are
unquantized, where the adapter loads pushed weights through ``model.load_weights`` and never
calls these (``chatlearn.models.rollout.vllm.weight_load_path``)."""

LAYERWISE_INFO: dict = {}


def _not_modelled(*args, **kwargs):
    raise NotImplementedError("the fake vLLM does not model the layerwise reload (CPU backend, quantized "
                              "models); its unquantized CUDA models load through model.load_weights")


initialize_layerwise_reload = finalize_layerwise_reload = get_layerwise_info = _not_modelled
