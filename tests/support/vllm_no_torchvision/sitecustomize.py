"""Test-only: vLLM 0.32's Qwen2-VL on a machine without torchvision (tests/models/rollout/test_vllm_vision.py).

Put this folder first on ``PYTHONPATH`` of a process (and so of every process it starts: vLLM inspects model
classes in a subprocess of its own) and Python runs it at start-up. It installs an import hook that changes
two things of transformers 5.19, both of which need torchvision and neither of which a still image needs:

* ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` (imported by vLLM's ``qwen2_vl.py`` for
  ``smart_resize`` and ``Qwen2VLImageProcessor``; it imports torchvision at its top) becomes the same names
  from ``image_processing_pil_qwen2_vl``: the PIL backend transformers itself falls back to, whose resize,
  rescale, normalise and patches the chatlearn data layer uses here (``chatlearn.data.vision``);
* ``Qwen2VLProcessor.from_pretrained`` and ``Qwen2_5_VLProcessor.from_pretrained`` build the processor from
  that image processor and the tokenizer, with a stand-in for the video processor (torchvision-only): videos
  are off (``limit_mm_per_prompt`` video 0), and the stand-in refuses to process one.

vLLM's own code runs unchanged: its model class, its multi-modal processor (placeholder expansion, image
parsing, caching), its vision tower and language model, its sampler. No production path uses this: without
torchvision chatlearn refuses a VLM on vLLM (``chatlearn.config.vision_keys.vllm_vision_problem``), which this
hook lifts by making the import succeed.
"""
import importlib.abc
import importlib.machinery
import sys

IMAGE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
# the processor modules, and the processor class of each
PROCESSORS = {"transformers.models.qwen2_vl.processing_qwen2_vl": "Qwen2VLProcessor",
              "transformers.models.qwen2_5_vl.processing_qwen2_5_vl": "Qwen2_5_VLProcessor"}


class _ImageLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
        module.smart_resize = pil.smart_resize
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil


class _ThenPatch(importlib.abc.Loader):
    def __init__(self, inner, class_name):
        self.inner, self.class_name = inner, class_name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        cls = getattr(module, self.class_name)

        @classmethod
        def from_pretrained(klass, path, *args, **kwargs):
            from transformers import AutoTokenizer
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
            kwargs.pop("trust_remote_code", None)
            tok = AutoTokenizer.from_pretrained(path)
            image = Qwen2VLImageProcessorPil.from_pretrained(path)
            return klass(image_processor=image, tokenizer=tok, video_processor=_NoVideo(image.merge_size), chat_template=getattr(tok, "chat_template", None))

        cls.from_pretrained = from_pretrained
        check = cls.check_argument_for_proper_class

        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and isinstance(arg, _NoVideo):
                return None
            return check(self, name, arg)

        cls.check_argument_for_proper_class = check_argument_for_proper_class


class _NoVideo:
    """Stands in for the video processor (needs torchvision): videos are off (limit_mm_per_prompt video 0)."""

    class valid_kwargs:
        __annotations__ = {}

    def __init__(self, merge_size):
        self.merge_size = merge_size

    def __call__(self, *args, **kwargs):
        raise RuntimeError("videos are not supported without torchvision")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == IMAGE:
            return importlib.machinery.ModuleSpec(name, _ImageLoader())
        if name in PROCESSORS:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = _ThenPatch(spec.loader, PROCESSORS[name])
            return spec
        return None


sys.meta_path.insert(0, _Finder())
