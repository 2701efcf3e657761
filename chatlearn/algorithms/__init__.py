"""GRPO's math and the learning-rate schedule. Each module registers its implementations under the
names chatlearn.config.registry declares when it is imported: ``advantages`` (numpy: what the driver
computes), ``grpo`` (torch: the trainers' loss; it imports ``advantages``) and ``lr_schedule``. The
package itself imports none of them, so the driver runs without torch."""
