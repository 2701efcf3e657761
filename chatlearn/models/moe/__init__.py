"""Mixture-of-experts helpers shared by the rollouts and the trainers.

- :mod:`.layout` (numpy only, the driver may import it): the MoE layers, top-k and experts of a model
  folder's ``config.json``; the ``routed_experts`` batch column's compact encoding (:func:`.layout.encode`,
  :func:`.layout.decode`) and its assembly per sample.
- :mod:`.routing` (torch): the Hugging Face router patch that records each token's top-k experts in a
  rollout (capture) and routes each token to the recorded experts in a trainer forward (replay), and the
  per-micro-batch tensor ``[batch, seq, num_moe_layers, top_k]`` (int64, -1: no record) a trainer
  replays from.
"""
