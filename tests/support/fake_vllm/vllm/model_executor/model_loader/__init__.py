"""``vllm.model_executor.model_loader`` of a release before 0.16: no ``reload`` subpackage
(``reload/layerwise.py`` arrived in vLLM 0.16)."""
