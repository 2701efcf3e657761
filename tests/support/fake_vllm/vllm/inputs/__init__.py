"""``TokensPrompt`` of vLLM 0.32 (``vllm/inputs/llm.py``), the prompt type the fake takes."""
from typing import NotRequired, TypedDict


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
