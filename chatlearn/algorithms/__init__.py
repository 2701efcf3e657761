"""GRPO's math and the learning-rate schedule. Each module registers its implementations under the
names chatlearn.config.registry declares when it is imported: ``advantages`` (numpy: what the driver
computes), ``gae`` (numpy: PPO's per-token advantages and returns), ``kl`` (torch: the KL estimators), ``grpo``
(torch: the policy losses and the trainers' loss) and ``lr_schedule``; ``response`` (numpy: the response tokens a
loss covers) is what they share. Imports go one way: ``grpo`` -> ``advantages``, ``kl``; ``advantages`` ->
``gae`` -> ``response``; ``advantages`` -> ``kl`` only inside the KL-in-reward penalty. The package itself
imports none of them, so the driver runs without torch."""
