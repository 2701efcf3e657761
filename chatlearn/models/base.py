"""The one interface every backend implements.

A *batch* travels between stages as a plain ``dict[str, np.ndarray]`` (columnar, ragged
sequences packed with offsets, never padded), so that Ray moves it zero-copy; every column it may
hold (per sample or per token, its dtype and the stage that writes it) is declared in
:mod:`chatlearn.batch`.

Parts that a model can hold on its devices (:class:`chatlearn.config.names.Part`): ``weights``,
``optimizer``, ``grads``, ``kv_cache``. ``offload(parts)`` frees their storage on the device for
real (the data is kept on the host), ``onload(parts)`` restores it bit for bit.

The backends: :class:`Trainer` (FSDP2, Megatron), :class:`Rollout` (vLLM, SGLang, transformers),
:class:`ScoringModel` (a reward model) and :class:`Reward` (the reward workers). Each base class
declares every method the runtime calls on its backends (the engine, the scheduler's offload/onload,
the weight push's ``chatlearn.runtime.weight_push.stream.Endpoint``), abstract where a backend must
implement it, so that a backend that misses one fails when it is built (``TypeError``), not in the
middle of a run.
"""
from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from chatlearn.algorithms.advantages import loss_token_counts, response_mask  # noqa: F401  (re-exported)
from chatlearn.batch import Batch
from chatlearn.config.names import Part
from chatlearn.errors import UserError
from chatlearn.models.weight_buckets import plan_buckets

if TYPE_CHECKING:
    import torch

    from chatlearn.models.specs import TrainerSpec

Bucket = list  # list[tuple[str, np.ndarray]] in Hugging Face parameter names


def sample_slices(batch: Batch) -> Iterator[slice]:
    """Slices of ``tokens`` for each sample."""
    off = batch["offsets"]
    for i in range(len(off) - 1):
        yield slice(int(off[i]), int(off[i + 1]))


def response_positions(batch: Batch, i: int) -> np.ndarray:
    """int64: the positions within sample ``i`` of the tokens a loss and a log-prob cover: its
    response tokens, less those a multi-turn rollout appended as observations (``loss_mask`` 0)."""
    start, end = int(batch["offsets"][i]), int(batch["offsets"][i + 1])
    plen = int(batch["prompt_lens"][i])
    resp = np.arange(plen, end - start, dtype=np.int64)
    if "loss_mask" in batch:
        resp = resp[np.asarray(batch["loss_mask"][start + plen:end], dtype=bool)]
    return resp


class Model(abc.ABC):
    """What the scheduler needs of every model placed on devices (trainers and rollouts)."""

    @abc.abstractmethod
    def offload(self, parts: Iterable[str]) -> dict:
        """Free the device storage of the named parts (:class:`Part` values; parts already off or
        that the model does not hold are skipped); returns {"bytes": int} moved."""

    @abc.abstractmethod
    def onload(self, parts: Iterable[str]) -> dict:
        """Restore the named parts bit for bit; returns {"bytes": int} moved."""


def step_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether an optimizer step may be taken: its loss and gradient norm are finite numbers.

    A non-finite one means the gradients are nan or inf, and stepping would write them into the
    weights and the optimizer state for good, so the trainers skip that step instead (as
    Megatron-LM, DeepSpeed and torch's GradScaler skip a step whose gradients overflowed): the
    gradients are dropped and neither the weights, the optimizer state nor the learning-rate
    schedule move. Both numbers are all-reduced over the ranks, so every rank decides alike.
    The engine stops the run after ``optimizer.max_nonfinite_steps`` skipped steps in a row.
    """
    return math.isfinite(loss) and math.isfinite(grad_norm)


class Trainer(Model):
    """policy_trainer, ref_policy and critic (FSDP2 and Megatron).

    ``spec.role`` says which: ``policy`` (an LM head, the loss of
    :class:`chatlearn.algorithms.grpo.GRPOLoss`), ``reference`` (frozen, log-probs only) or ``critic``
    (a scalar value head on the backbone, the loss of :class:`chatlearn.algorithms.value_loss.ValueLoss`,
    its values from :meth:`compute_values`).

    Every rank receives the full batch; data-parallel replica ``dp_rank`` of ``dp_size`` works
    on its contiguous share of the samples (``_my_samples``). Offloaded parts live in
    ``self._stashes`` (part -> what restores it).

    The training step and the log-prob pass are defined here, once (:meth:`train`,
    :meth:`compute_grads`, :meth:`compute_logprobs`); a backend implements the pieces in which
    the two differ, the abstract hooks below: how a batch is cut into micro-batches
    (:meth:`_micro_batches`), how their forwards run (:meth:`_logprob_pass`) and their
    backwards accumulate gradients (:meth:`_accumulate_grads`), and its optimizer
    (:meth:`_optimizer_steps`, :meth:`_set_lr`, :meth:`_clip_and_step`, :meth:`zero_grad`).

    The attributes annotated below are set by a backend's constructor; the weight push reads
    ``rank`` and ``device`` (``chatlearn.runtime.weight_push.stream.Endpoint``).
    """

    spec: TrainerSpec  # the trainer's settings, read as attributes (the fields each backend reads: its constructor)
    rank: int  # global rank in the trainer's process group (rank 0 writes files, gets full tensors)
    device: torch.device  # this rank's device (``cuda:i`` or ``cpu``)
    trainable: bool  # policy_trainer and critic (an optimizer) or ref_policy (frozen, forward only)
    model: torch.nn.Module  # the module whose train/eval mode the passes set
    dp_size: int = 1
    dp_rank: int = 0
    _stashes: dict

    # ------------------------------------------------------------------ the engine's calls
    def compute_logprobs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False):
        """float32 [T] log-probs of every token given its prefix (0 at prompt positions), the same
        on every rank (a collective); ``logp_t = log softmax(z_{t-1} / temperature)[token_t]``.
        With ``with_entropy`` a pair: also the entropy of the temperature-scaled distribution,
        [T]. No gradients; the model in eval mode; the weights must be onloaded. The pass's
        padding share and micro-steps are kept for :meth:`logprob_stats`. A critic has no
        log-probs (RuntimeError): see :meth:`compute_values`."""
        import torch

        if self.spec.role == "critic":
            raise RuntimeError(f"{type(self).__name__}: the critic has a value head, not an LM head: it gives "
                               "values (compute_values), not log-probs")
        with torch.no_grad():
            self._require_weights()
            self.model.train(False)
            micro, self._logprob_stats = self._micro_batches(batch, self.spec.logprob_micro_batch_size)
            return self._logprob_pass(batch, micro, temperature, with_entropy)

    def probe_logprobs(self, batch: Batch) -> dict:
        """The trainer's side of the check that a weight push landed (``chatlearn.runtime.driver.landing``):
        ``{"logprobs": float32 [T] of :meth:`compute_logprobs` at temperature 1, "dtype": the precision it
        computes in}``. A collective; :meth:`logprob_stats` keep the episode's pass, not this one."""
        kept = self.__dict__.get("_logprob_stats")
        try:
            found = self.compute_logprobs(batch, 1.0)
        finally:
            if kept is None:
                self.__dict__.pop("_logprob_stats", None)
            else:
                self._logprob_stats = kept
        return {"logprobs": np.asarray(found, dtype=np.float32), "dtype": "bfloat16" if self.spec.bf16 else "float32"}

    def teacher_logprobs(self, batch: Batch, temperature: float = 1.0, topk: int = 0) -> dict:
        """A distillation teacher's pass (``spec.role`` teacher): ``{"teacher_logprobs": float32 [T] of
        :meth:`compute_logprobs`, "teacher_top1": float32 [T], 1.0 where the sampled token is the teacher's most
        likely one at that position}`` (0 at prompt and observation tokens), from one forward. With ``topk``
        (> 0: that many, -1: the whole vocabulary) also ``"teacher_topk_logprobs"`` float32 [T, k] and
        ``"teacher_topk_ids"`` int32 [T, k]: the teacher's most likely tokens at each position, most likely
        first, and their log-probs at ``temperature`` (what ``algorithm: gkd`` trains on). A collective."""
        if self.spec.role != "teacher":
            raise RuntimeError(f"{type(self).__name__}: teacher_logprobs needs a teacher (role teacher); this "
                               f"model's role is {self.spec.role!r}")
        from chatlearn.algorithms.gkd import TeacherTopK
        from chatlearn.algorithms.grpo import TOP1

        if not topk:
            logp, top1 = self.compute_logprobs(batch, temperature, with_entropy=TOP1)
            return {"teacher_logprobs": np.asarray(logp, np.float32), "teacher_top1": np.asarray(top1, np.float32)}
        logp, (top1, values, ids) = self.compute_logprobs(batch, temperature,
                                                          with_entropy=TeacherTopK(None if topk < 0 else topk))
        return {"teacher_logprobs": np.asarray(logp, np.float32), "teacher_top1": np.asarray(top1, np.float32),
                "teacher_topk_logprobs": np.asarray(values, np.float32),
                "teacher_topk_ids": np.asarray(ids, np.int32)}

    def ref_logprobs(self, batch: Batch, temperature: float = 1.0):
        """The reference log-probs of a trainer that trains adapters (LoRA): :meth:`compute_logprobs`
        with the adapters disabled, i.e. under the base weights the run started from (the reference
        model of a KL term, without a second copy of the weights). A collective. A trainer without
        adapters raises RuntimeError (its reference is the separate ``ref_policy`` model)."""
        with self._adapters_disabled():
            return self.compute_logprobs(batch, temperature)

    def _adapters_disabled(self):
        """A context manager in which the model computes with its base weights alone."""
        raise RuntimeError(f"{type(self).__name__} trains no adapters: the reference log-probs come from "
                           "the ref_policy model")

    def compute_values(self, batch: Batch):
        """The critic's float32 [T] values of every response token (0 elsewhere), the same on every
        rank (a collective): the value of token t is the value head on the hidden state at t - 1,
        ``V_t = score(h_{t-1})``, the value of the state before the token is generated (verl's
        ``values[:, -response_length - 1:-1]``). No gradients; the model in eval mode; the weights
        must be onloaded. The same pass as :meth:`compute_logprobs` (:meth:`_micro_batches` of
        ``logprob_micro_batch_size``, :meth:`_logprob_pass`, whose forward gives values for a
        critic); its padding share and micro-steps are kept for :meth:`logprob_stats`. Only for a
        critic (``spec.role``); a RuntimeError otherwise."""
        import torch

        if self.spec.role != "critic":
            raise RuntimeError(f"{type(self).__name__}: compute_values needs a critic (role critic); this "
                               f"model's role is {self.spec.role!r}")
        with torch.no_grad():
            self._require_weights()
            self.model.train(False)
            micro, self._logprob_stats = self._micro_batches(batch, self.spec.logprob_micro_batch_size)
            return self._logprob_pass(batch, micro, 1.0, False)

    def logprob_stats(self) -> dict:
        """``pad_token_frac`` and ``micro_steps`` of the last :meth:`compute_logprobs` (or
        :meth:`compute_values`) pass (see :meth:`_micro_batches`); {} before any."""
        return dict(getattr(self, "_logprob_stats", {}))

    def _config_key(self, name: str) -> str:
        """The config key ``name`` of this model, ``models.<model>.<name>``: ``critic`` for a critic
        (``spec.role``), else ``policy_trainer`` when trainable, ``ref_policy`` when not."""
        model = ("critic" if self.spec.role == "critic" else "policy_trainer" if self.spec.trainable
                 else "ref_policy")
        return f"models.{model}.{name}"

    def _objective(self, batch: Batch):
        """The loss of ``batch`` for this model's role: :class:`chatlearn.algorithms.value_loss.ValueLoss`
        for a critic, :class:`chatlearn.algorithms.grpo.GRPOLoss` otherwise (a ValueError names the
        backend when the batch does not fit it)."""
        from chatlearn.algorithms.gkd import GKDLoss
        from chatlearn.algorithms.grpo import GRPOLoss
        from chatlearn.algorithms.sft import SFTLoss
        from chatlearn.algorithms.value_loss import ValueLoss

        kind = (ValueLoss if self.spec.role == "critic" else SFTLoss if getattr(self, "_sft_step", False)
                else GKDLoss if "teacher_topk_ids" in batch else GRPOLoss)
        try:
            return kind(self.spec, batch, self.device)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None

    def compute_grads(self, batch: Batch, temperature: float = 1.0) -> dict:
        """Forward + backward over the global batch (the loss of :meth:`_objective`:
        :class:`chatlearn.algorithms.grpo.GRPOLoss` for the policy,
        :class:`chatlearn.algorithms.value_loss.ValueLoss` for a critic); the gradients are left in
        the backend's gradient storage, exactly d(loss)/d(theta) on every rank (see
        :meth:`_accumulate_grads`). Returns the loss metrics (the token sums all-reduced over
        all ranks) and the pass's ``pad_token_frac`` and ``micro_steps``; no step.
        ``temperature`` must be the one ``old_logprobs`` were computed with (a critic ignores it)."""
        import torch.distributed as dist

        name = type(self).__name__
        if not self.trainable:
            raise RuntimeError(f"{name}: this model is not trainable (ref_policy)")
        self._require_weights()
        if Part.OPTIMIZER in self._stashes:
            raise RuntimeError(f"{name}: optimizer state is offloaded; call onload(['optimizer'])")
        objective = self._objective(batch)
        self.model.train(True)
        sums, passes = self._accumulate_grads(batch, objective, temperature)
        dist.all_reduce(sums)
        diff_max = None
        if objective.tracks_rollout:
            top = objective.rollout_diff_max.detach().clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            diff_max = float(top.item())
        weight_max = None
        if objective.correction != "none":
            top = objective.is_weight_max.detach().clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            weight_max = float(top.item())
        return {**objective.metrics(sums.tolist(), diff_max, weight_max), **passes}

    def train(self, batch: Batch, temperature: float = 1.0) -> dict:
        """One optimizer step on one global batch (the policy's or the critic's loss, by role);
        returns metrics (floats): the loss metrics of :meth:`compute_grads`, ``grad_norm``, ``lr``,
        ``skipped_steps``.

        ``temperature`` must be the one ``old_logprobs`` were computed with. The step's learning
        rate is :func:`chatlearn.algorithms.lr_schedule.trainer_learning_rate` at the current step
        count (:meth:`_optimizer_steps`), or 0 when every sample of the batch has weight 0 (a
        filtered batch: the step then changes no weight, and the schedule still advances).

        A step whose loss or gradient norm is not finite is skipped (:func:`step_is_finite`, in
        :meth:`_clip_and_step`): the gradients are dropped, no weight or optimizer state changes
        and the schedule does not advance; ``skipped_steps`` is then 1.
        """
        from chatlearn.algorithms.grpo import GRPOLoss
        from chatlearn.algorithms.lr_schedule import trainer_learning_rate

        metrics = self.compute_grads(batch, temperature)
        lr = (trainer_learning_rate(self.spec, self._optimizer_steps())
              if GRPOLoss.sample_weights(batch).any() else 0.0)
        self._set_lr(lr)
        stepped, grad_norm = self._clip_and_step(metrics["loss"])
        self.zero_grad()
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = lr
        metrics["skipped_steps"] = 0.0 if stepped else 1.0
        return metrics

    def train_sft(self, batch: Batch) -> dict:
        """One optimizer step of supervised fine-tuning on one global batch: :meth:`train` with the loss of
        :class:`chatlearn.algorithms.sft.SFTLoss` (the token mean of -log p over the batch's assistant
        tokens: ``loss_mask`` 1) in place of the policy's; the same micro-batches, gradient clipping,
        learning-rate schedule and skipped non-finite steps. A collective."""
        if self.spec.role != "policy":
            raise RuntimeError(f"{type(self).__name__}: supervised fine-tuning trains a policy (role {self.spec.role!r})")
        self._sft_step = True
        try:
            return self.train(batch, 1.0)
        finally:
            self._sft_step = False

    @abc.abstractmethod
    def weight_specs(self) -> list[tuple[str, str, tuple, int]]:
        """``(hf_name, dtype, full shape, group)`` of every exported weight, in export order
        (the same on every rank; no collective); names of one ``group`` come out of one gather."""

    @abc.abstractmethod
    def export_tensors(self, names: Iterable[str]) -> Iterator[tuple]:
        """``(hf_name, full tensor on rank 0, None elsewhere)`` for the names given (whole
        groups), gathered group by group; a collective: every rank iterates to the end. The
        tensors are copies (never views of the weights); the weights must be onloaded."""

    def push_view(self):
        """What the weight push sends: an object with :meth:`weight_specs`, :meth:`export_tensors`,
        ``rank`` and ``device``; and, for a push of LoRA adapters alone, ``manifest`` (the FSDP trainer's
        ``lora.push: adapters``). The trainer itself by default."""
        return self

    def export_weights(self, bucket_mb: int) -> Iterator[Bucket]:
        """All weights as ``[(hf_name, np.ndarray), ...]`` buckets of about ``bucket_mb`` MiB,
        planned as the weight push plans them (``chatlearn.models.weight_buckets.plan_buckets``).
        A collective: every rank iterates to the end; rank 0's buckets hold the arrays, the
        other ranks' are empty lists. For tests and tools; runs push with ``WeightPush``."""
        for index in plan_buckets(self.weight_specs(), bucket_mb * 2 ** 20):
            yield [(name, t.detach().to("cpu").numpy()) for name, t in self.export_tensors(index.names)
                   if t is not None]

    @abc.abstractmethod
    def save_hf(self, path: str) -> None:
        """Write a Hugging Face model folder at ``path`` (rank 0 writes; a collective): weights,
        config and the other files of the ``load`` folder (tokenizer, chat template)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write the weights, the optimizer state (when trainable), every rank's RNG states and
        the metadata into the folder ``path``, so that :meth:`load_checkpoint` resumes bit for
        bit. A collective: every rank calls it with the same path, on a file system all ranks
        share; rank 0 writes the ``.complete`` marker last (``chatlearn.checkpoint.sharded``),
        and a return means the checkpoint is complete on every rank. Weights and optimizer must
        be onloaded; weights that hold nan or inf are refused (:meth:`_require_finite_weights`)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`: weights, optimizer state
        (when trainable) and RNG states; pending gradients are dropped. A collective; weights
        and optimizer must be onloaded. A missing, incomplete or mismatched checkpoint raises a
        :class:`chatlearn.errors.UserError` on every rank before any collective."""

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _micro_batches(self, batch: Batch, size: int) -> tuple[list, dict]:
        """``(micro-batches, stats)``: this rank's micro-batches of ``batch`` (of ``size``
        samples, or with ``packing`` bins of at most ``max_token_in_packing`` tokens; in a form
        the backend's passes take) and the pass's ``{"pad_token_frac", "micro_steps"}``. Every
        rank that takes part in one collective runs the same number of micro-steps (dummy ones
        make up the difference). Validates the batch (:meth:`_my_samples`)."""

    @abc.abstractmethod
    def _logprob_pass(self, batch: Batch, micro_batches: list, temperature: float,
                      with_entropy: bool):
        """The forwards of :meth:`compute_logprobs` over ``micro_batches`` (from
        :meth:`_micro_batches`; called without gradients, the model in eval mode): float32 [T]
        log-probs on every rank (the ranks' values gathered: a collective), or the pair
        ``(log-probs, entropy)`` with ``with_entropy``."""

    @abc.abstractmethod
    def _accumulate_grads(self, batch: Batch, objective, temperature: float) -> tuple:
        """The forwards and backwards of :meth:`compute_grads` (the model in train mode):
        ``objective`` is the batch's :class:`chatlearn.algorithms.grpo.GRPOLoss` (or a critic's
        :class:`chatlearn.algorithms.value_loss.ValueLoss`, the same interface). Cuts the batch
        with :meth:`_micro_batches` (``train_micro_batch_size``) and accumulates, over this
        rank's micro-batches, gradients such that after the backend's gradient reduction over
        the data-parallel replicas they are exactly d(loss)/d(theta) of the global loss.
        Returns ``(sums, passes)``: a float64 tensor on ``device`` of the
        ``objective.token_sums`` of this rank's tokens (named by ``objective.SUMS``; the caller
        all-reduces it over all ranks, so each token must be counted on one rank only) and the
        pass's stats from :meth:`_micro_batches`."""

    @abc.abstractmethod
    def _optimizer_steps(self) -> int:
        """Optimizer steps taken so far (restored with the optimizer state on resume, so that
        the learning-rate schedule continues where it was); the same on every rank."""

    @abc.abstractmethod
    def _set_lr(self, lr: float) -> None:
        """Set the learning rate of the next optimizer step on every parameter group."""

    @abc.abstractmethod
    def _clip_and_step(self, loss: float) -> tuple[bool, float]:
        """``(stepped, grad norm)``: the global norm of the accumulated gradients, then, when
        :func:`step_is_finite` of ``loss`` (all-reduced) and that norm, the gradients clipped to
        ``clip_grad`` (<= 0: no clipping) and one optimizer step; otherwise no step (weights and
        optimizer state unchanged). Every rank must decide alike. Gradients are left in place."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients (before the next :meth:`compute_grads`)."""

    @abc.abstractmethod
    def _part_tensors(self, part: str) -> list:
        """The tensors whose storage makes up ``part`` (``weights`` or ``optimizer``), for
        :meth:`_stash_parts`."""

    # ------------------------------------------------------------------ shared helpers
    def _require_weights(self) -> None:
        if Part.WEIGHTS in self._stashes:
            raise RuntimeError(f"{type(self).__name__}: weights are offloaded; call onload(['weights'])")

    # parts a trainer copies to the host and back; "grads" are dropped, "kv_cache" does not exist
    OFFLOADABLE = (Part.WEIGHTS, Part.OPTIMIZER)

    def _check_parts(self, parts: Iterable[str]) -> list[str]:
        parts = list(parts)
        known = tuple(Part)
        unknown = [p for p in parts if p not in known]
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown parts {unknown}; "
                             f"known: {tuple(str(p) for p in known)}")
        return parts

    def _stash_parts(self, parts: list[str]) -> int:
        """Free the device storage of the offloadable ``parts`` not yet offloaded, keeping
        their bytes on the host (``chatlearn.models.stash.Stash``); returns the bytes."""
        from chatlearn.models.stash import Stash

        moved = 0
        for part in self.OFFLOADABLE:
            if part in parts and part not in self._stashes:
                self._stashes[part] = Stash(self._part_tensors(part))
                moved += self._stashes[part].nbytes
        return moved

    def _unstash_parts(self, parts: list[str]) -> int:
        """Restore offloaded ``parts`` bit for bit; returns the bytes copied back."""
        return sum(self._stashes.pop(part).restore() for part in self.OFFLOADABLE
                   if part in parts and part in self._stashes)

    def _require_finite_weights(self, params: Iterable, path: str) -> None:
        """Refuse, on every rank, to write a checkpoint at ``path`` from weights that hold nan or
        inf (``params``: this rank's local weight tensors; a collective: the count is
        all-reduced). Skipped steps keep the weights finite; this catches a finite step that
        overflowed them (a learning rate far too large)."""
        import torch
        import torch.distributed as dist

        params = list(params)
        bad = torch.tensor([sum(int(not bool(torch.isfinite(t).all())) for t in params), len(params)],
                           dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(bad)
        if int(bad[0]):
            raise UserError(f"{int(bad[0])} of the trainer's {int(bad[1])} weight tensors (shards of all "
                            f"ranks) hold nan or inf, so no checkpoint is written to {path!r}: training "
                            "diverged. Resume from the last checkpoint with a lower "
                            f"{self._config_key('optimizer.lr')} (or a smaller clip_grad).")

    def _require_onloaded(self, what: str) -> None:
        offloaded = [str(part) for part in self.OFFLOADABLE if part in self._stashes]
        if offloaded:
            raise RuntimeError(f"{type(self).__name__}.{what}: {' and '.join(offloaded)} offloaded; "
                               f"call onload({offloaded}) first")

    def _my_samples(self, batch: Batch) -> np.ndarray:
        """Indices of this data-parallel replica's contiguous share of the samples."""
        n = len(batch["offsets"]) - 1
        if n % self.dp_size:
            raise ValueError(f"{type(self).__name__}: the batch has {n} samples, which does not "
                             f"divide by the {self.dp_size} data-parallel replicas")
        if n and int(np.min(batch["prompt_lens"])) < 1:
            raise ValueError(f"{type(self).__name__}: every sample needs a prompt of at least 1 token")
        share = n // self.dp_size
        return np.arange(self.dp_rank * share, (self.dp_rank + 1) * share)


class Rollout(Model):
    """The policy: vLLM, SGLang or transformers.

    A weight push (``chatlearn.runtime.weight_push.stream``) reaches a rollout as one update: one
    :meth:`begin_weight_update`, the buckets, one :meth:`finish_weight_update`. A bucket comes
    either as tensors (:meth:`load_weight_bucket`: every transport) or, with the ``cuda_ipc``
    transport to an engine whose workers run in processes of their own (vLLM), as a slot of
    the trainer's GPU memory that the workers map themselves (:meth:`attach_weight_slots`,
    :meth:`load_weight_slot`, :meth:`detach_weight_slots`): a backend that implements those sets
    :attr:`maps_weight_slots`; for the others the rollout's own process maps the slots and calls
    :meth:`load_weight_bucket`.
    """

    # Whether the engine's workers map the trainer's CUDA IPC slots themselves (the three slot
    # methods below are implemented); read by the weight push to choose how ``cuda_ipc`` delivers.
    maps_weight_slots: bool = False

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: dict) -> Batch:
        """Sample one response per prompt.

        ``sampling``: temperature, top_p, top_k (-1: off), max_tokens, seed (optional), and the
        penalties presence_penalty, frequency_penalty, repetition_penalty (optional, vLLM's
        definitions; absent: off).
        Returns a batch (tokens, offsets, prompt_lens, rollout_logprobs) plus
        ``finish_reasons`` (int8 [N]: 1 stopped at EOS, 0 cut at max_tokens).
        ``rollout_logprobs`` are log-probs under the temperature-scaled distribution
        (no top-p/top-k truncation), the same quantity the trainer computes.
        """

    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Open an update of the weights; the weights must be onloaded (the KV cache may be off:
        the scheduler pushes between the two wake steps)."""

    def begin_partial_weight_update(self, modules: list[str]) -> None:
        """Open an update that loads only the weights of ``modules`` (Hugging Face module names, each loaded
        whole: a LoRA adapter push, ``chatlearn.models.rollout.lora_push``); every other weight stays as it is.
        An engine that loads weights one by one needs nothing more than :meth:`begin_weight_update`."""
        self.begin_weight_update()

    @abc.abstractmethod
    def load_weight_bucket(self, weights: list) -> None:
        """Load one bucket of ``(hf_name, tensor)`` pairs (Hugging Face names; a tied
        ``lm_head.weight`` may be absent) into the open update. The tensors may be views of a
        buffer that is reused once this returns: keep copies of whatever is kept."""

    @abc.abstractmethod
    def finish_weight_update(self) -> None:
        """Close the update: every bucket is in place and the next generation uses the new
        weights only (no cached KV of the old weights)."""

    def attach_weight_slots(self, handles: dict) -> None:
        """CUDA IPC slots of the trainer ranks, ``{device uuid: [handle per slot]}`` (transport
        ``cuda_ipc``), mapped by the engine's own workers on their GPUs. Only for engines whose
        workers run in processes of their own (vLLM)."""
        raise self._no_slots("attach_weight_slots")

    def load_weight_slot(self, slot: int, entries: list) -> None:
        """Load the bucket the trainer wrote into slot ``slot`` of :meth:`attach_weight_slots`
        (``entries``: ``[name, dtype, shape, offset, nbytes]`` rows) into the open update;
        returns once the slot has been read (the trainer then refills it)."""
        raise self._no_slots("load_weight_slot")

    def detach_weight_slots(self) -> None:
        """Drop the mappings of :meth:`attach_weight_slots` (after the push, before the trainer
        frees the slots)."""
        raise self._no_slots("detach_weight_slots")

    def probe_logprobs(self, tokens: list[int]) -> dict:
        """The rollout's side of the check that a weight push landed (``chatlearn.runtime.driver.landing``):
        ``{"logprobs": float32 [len(tokens) - 1], "dtype": the engine's dtype}``, the log-prob of each token
        after the first given the ones before it under the raw logits (temperature 1, no penalties). It
        draws no random numbers and leaves no cached KV of ``tokens`` for the next generation."""
        raise NotImplementedError(f"{type(self).__name__}.probe_logprobs: this rollout backend cannot check "
                                  "that a weight push landed; set runtime_args.weight_push_check=false")

    def _no_slots(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__}.{method}: this rollout backend does not map CUDA IPC "
                                   "weight slots in its workers (maps_weight_slots is False); the weight push "
                                   "hands it buckets through load_weight_bucket")


class ScoringModel(Model):
    """A reward model (``models.reward.load``): a sequence-classification model on devices that
    scores conversations; it holds ``weights`` and takes turns like the other models."""

    @abc.abstractmethod
    def score(self, conversations: list[list[dict]]) -> np.ndarray:
        """float32 [N]: one score per conversation (the prompt's chat messages, then the response as
        the assistant's message), rendered with the model's own tokenizer and chat template; the same
        array on every rank (a collective)."""


class JudgingModel(Model):
    """An LLM judge (a model of kind ``judge``): a causal LM on a rollout engine that gives a verdict on each
    rendered prompt (``chatlearn/models/reward/judge.py``); it holds ``weights`` and ``kv_cache`` and takes turns
    like the other models."""

    @abc.abstractmethod
    def judge(self, prompts: list[list[dict]], probs: bool | None = None) -> dict:
        """``{"texts": the verdicts, "yes_probs": float32 [N] (NaN where not asked for), "generated_tokens": int}``
        of each prompt (a list of chat messages); ``probs``: None, the judge's setting; True, both; False, texts."""


class Reward(abc.ABC):
    """A reward worker: scores the responses of a share of the samples (on CPUs; it holds no
    parts). ``chatlearn.runtime.driver.sampling.Sampling.score`` calls :meth:`score_one` for each
    reward function in turn (each within its time limit) and sums them as :meth:`score` does.

    A batch here is a dict of lists, one entry per sample: ``prompts``, ``responses`` (decoded
    text), ``ground_truths``, ``data_sources``, ``extra`` (see
    ``chatlearn.models.reward.functions``)."""

    @abc.abstractmethod
    def score_one(self, index: int, batch: dict) -> dict:
        """Reward function ``index`` alone on ``batch``: ``{"score": weight x score (float64
        [N]), "metrics": {"<name>/<key>": per-sample values}}``."""

    @abc.abstractmethod
    def score(self, prompts: list[str], responses: list[str], ground_truths: list,
              data_sources: list[str], extra: list[dict]) -> dict:
        """Every reward function on the samples: ``{"score": the weighted sum (float32 [N]),
        "metrics": {"<name>/<key>": per-sample values}}``."""
