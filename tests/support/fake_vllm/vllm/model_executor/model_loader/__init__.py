"""``vllm.model_executor.model_loader``: ``weight_utils`` and, from vLLM 0.16 on, the ``reload``
subpackage (``reload/layerwise.py``). With ``FAKE_VLLM_RELEASE`` before 0.16 the fake's
``reload`` package fails to import, as a missing one does."""
