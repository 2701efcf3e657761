"""Checkpoints: atomic, resumable training state, and the offline merge to Hugging Face."""
