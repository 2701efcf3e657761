"""``SamplingParams`` of vLLM 0.32 (``vllm/sampling_params.py``), for the fields listed below.

Same names, defaults and order of checks as there: ``__post_init__`` (temperature in (0, 0.01)
raised to 0.01, ``seed=-1`` -> None, ``stop``/``stop_token_ids`` normalised, ``logprobs=True`` ->
1), ``_verify_args`` (n, penalties, temperature in [0, 2], top_p in (0, 1], top_k 0 or -1 for
off, min_p, max_tokens, min_tokens, logprobs, stop) and the greedy rules (temperature below
1e-5: top_p 1, top_k 0, min_p 0, n must be 1). A rejected value raises
:class:`~vllm.exceptions.VLLMValidationError`; an unknown keyword ``TypeError`` (the real one is
a ``msgspec.Struct``). As there, the seed's type is not checked here: a seed that is not an int
fails when a sampled request seeds its generator (``LLM.generate``). The fields vLLM has and
this fake leaves out (structured outputs, logit bias, bad words, prompt logprobs, ...) are
unknown keywords here; ``tests/models/rollout/test_vllm_fake_strict.py`` compares the fields
the fake has with the installed vLLM's.
"""
from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, field
from enum import IntEnum

from vllm.exceptions import VLLMValidationError

logger = logging.getLogger("vllm.sampling_params")

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


def _verify_num_sequences(value: int, parameter_name: str) -> None:
    if not isinstance(value, int):
        raise VLLMValidationError(f"{parameter_name} must be an int, but is of type {type(value)}")
    if value < 1:
        raise VLLMValidationError(f"{parameter_name} must be at least 1, got {value}.")
    max_n = int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))
    if value > max_n:
        raise VLLMValidationError(f"{parameter_name} must be at most {max_n}, got {value}.")


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(kw_only=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    # set by __post_init__ and by the engine (update_from_generation_config), not inputs
    _eos_token_id: int | None = field(default=None, init=False, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if 0 < self.temperature < _MAX_TEMP:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf "
                           "in tensors. We have maxed it out to %s.", self.temperature, _MAX_TEMP, _MAX_TEMP)
            self.temperature = max(self.temperature, _MAX_TEMP)
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Zero temperature means greedy sampling.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            self._verify_greedy_sampling()
        # eos_token_id is added to this by the engine
        self._all_stop_token_ids.update(self.stop_token_ids)

    def _verify_args(self) -> None:  # noqa: C901 - vLLM's checks, in vLLM's order
        _verify_num_sequences(self.n, "n")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise VLLMValidationError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise VLLMValidationError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise VLLMValidationError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise VLLMValidationError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature):
            raise VLLMValidationError(f"temperature must be a finite number, got {self.temperature}.",
                                      parameter="temperature", value=self.temperature)
        if self.temperature < 0.0:
            raise VLLMValidationError(f"temperature must be non-negative, got {self.temperature}.",
                                      parameter="temperature", value=self.temperature)
        if self.temperature > 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {self.temperature}.",
                                      parameter="temperature", value=self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {self.top_p}.", parameter="top_p",
                                      value=self.top_p)
        # quietly accept -1 as disabled, but prefer 0
        if self.top_k < -1:
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not isinstance(self.top_k, int):
            raise VLLMValidationError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if not 0.0 <= self.min_p <= 1.0:
            raise VLLMValidationError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.",
                                      parameter="max_tokens", value=self.max_tokens)
        if self.min_tokens < 0:
            raise VLLMValidationError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise VLLMValidationError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                                      f"got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise VLLMValidationError(f"logprobs must be non-negative or -1, got {self.logprobs}.",
                                      parameter="logprobs", value=self.logprobs)
        assert isinstance(self.stop_token_ids, list)
        if self.prompt_logprobs is not None and self.prompt_logprobs != -1 and self.prompt_logprobs < 0:
            raise VLLMValidationError(f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.",
                                      parameter="prompt_logprobs", value=self.prompt_logprobs)
        if not all(isinstance(st_id, int) for st_id in self.stop_token_ids):
            raise VLLMValidationError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        assert isinstance(self.stop, list)
        if any(not stop_str for stop_str in self.stop):
            raise VLLMValidationError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise VLLMValidationError("stop strings are only supported when detokenize is True. "
                                      "Set detokenize=True to use stop.")

    def _verify_greedy_sampling(self) -> None:
        if self.n > 1:
            raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def verify(self, model_config) -> None:
        """The request checks against the engine (``SamplingParams.verify``): the number of
        log-probs (``max_logprobs``; -1 asks for the whole vocabulary) and the stop token ids."""
        vocab_size = model_config.get_vocab_size()
        max_logprobs = model_config.max_logprobs
        if max_logprobs == -1:
            max_logprobs = vocab_size
        if num_logprobs := self.logprobs:
            if num_logprobs == -1:
                num_logprobs = vocab_size
            if num_logprobs > max_logprobs:
                raise VLLMValidationError(f"Requested sample logprobs of {num_logprobs}, which is greater than "
                                          f"max allowed: {max_logprobs}", parameter="logprobs", value=num_logprobs)
        invalid = [t for t in self.stop_token_ids if t < 0 or t >= vocab_size]
        if invalid:
            raise VLLMValidationError(f"token_id(s) {invalid} in stop_token_ids contain out-of-vocab token ids. "
                                      f"Vocabulary size: {vocab_size}", parameter="stop_token_ids", value=invalid)

    def update_from_generation_config(self, generation_config: dict, eos_token_id: int | None = None) -> None:
        """The engine's EOS (the tokenizer's) and the generation config's other EOS ids (stop ids)."""
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is not None:
            eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
            if eos_token_id is not None:
                eos_ids.discard(eos_token_id)
            if eos_ids:
                self._all_stop_token_ids.update(eos_ids)
                if not self.ignore_eos:
                    eos_ids.update(self.stop_token_ids)
                    self.stop_token_ids = list(eos_ids)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
