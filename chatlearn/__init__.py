"""chatlearn: reinforcement learning (GRPO) for large language models."""

__version__ = "0.1.0"
