"""Megatron-core trainer backend (``runtime_args.train_backend: megatron``).

megatron-core is imported lazily, when a trainer is built: ``pip install -e '.[megatron]'``.
"""
from chatlearn.models.trainer.megatron.trainer import MegatronTrainer

__all__ = ["MegatronTrainer"]
