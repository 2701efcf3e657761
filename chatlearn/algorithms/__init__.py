"""GRPO's math and the learning-rate schedule. Importing the package registers every
implementation under the names chatlearn.config.registry declares."""
from chatlearn.algorithms import grpo, lr_schedule  # noqa: F401
