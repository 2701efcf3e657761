"""``vllm.model_executor.model_loader.reload`` (vLLM >= 0.16). A fake of an earlier release
(``FAKE_VLLM_RELEASE``) has no such package: importing it fails as a missing module does."""
import vllm

if vllm.RELEASE < (0, 16):
    raise ModuleNotFoundError(f"No module named {__name__!r} (vLLM {vllm.__version__})", name=__name__)
