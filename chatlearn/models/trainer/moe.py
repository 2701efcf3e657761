"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, ...) in the FSDP2 trainer: the MoE keys of a
trainer section acting on a Hugging Face model (``models.<trainer>.moe_*``, ``groupgemm``).

FSDP2 shards every parameter of a decoder layer over the data-parallel ranks, the experts' fused 3D
tensors (transformers 5: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) included,
and all-gathers them for the layer's forward: every rank computes every expert of its own tokens.
There is no expert parallelism and so no token dispatch: ``expert_model_parallel_size``,
``expert_tensor_parallel_size``, ``moe_token_dispatcher_type`` and ``moe_shared_expert_overlap`` mean
nothing here (:func:`fsdp_ignored_keys` says so once, at start).

What acts (:class:`RouterTaps`, :func:`apply`):

* the router's load-balancing loss, ``moe_aux_loss_coeff`` (null: ``config.json``'s
  ``router_aux_loss_coef``), Megatron's per-layer Switch loss (megatron-core
  ``moe_utils.switch_load_balancing_loss_func``) summed over the MoE layers::

      aux_l = E / k * sum_e f_e * P_e,   f_e = (top-k choices of expert e) / T,   P_e = mean_t softmax(z_t)_e

  over the T tokens of a micro-batch that the router saw (padding excluded; prompt tokens included,
  as in every forward); 1 when the load and the router's probabilities are uniform. For one MoE layer
  this is transformers' ``load_balancing_loss_func`` / k; with several layers transformers multiplies
  the counts and probabilities summed over all layers, which couples the layers: the per-layer form
  is kept here (the same as the Megatron trainer's).
* the z-loss, ``moe_z_loss_coeff``: ``z_l = mean_t logsumexp(z_t)^2`` per layer, summed over layers.
* both are added to the policy loss as ``coeff x sum_l loss_l``, averaged over the step's micro-steps
  (each micro-batch's backward adds ``coeff x sum_l loss_l / micro_steps``; FSDP averages the ranks).
* ``moe_router_force_load_balancing`` (benchmarks): the router's logits are replaced by standard normal
  noise (the straight-through gradient of megatron-core's ``RandomSTE``/``apply_random_logits``), then
  routed as usual (softmax, top-k, renormalised): in expectation an even spread over the experts. In
  every forward, the reference's too. The noise is drawn from torch's global generator, which the
  checkpoints save and activation recomputation restores.
* ``moe_layer_recompute``: the MoE block of every layer (router and experts) runs under
  ``torch.utils.checkpoint`` (non-reentrant) in training, its activations recomputed in backward.
  With ``gradient_checkpointing`` the whole layer is recomputed already and this adds nothing.
* ``groupgemm``: transformers 5's experts implementation: ``grouped_mm`` (one grouped GEMM over the
  experts, ``torch.nn.functional.grouped_mm``; on the CPU too in torch 2.13) when true, ``eager`` (a
  loop over the experts that received tokens, one matmul each) when false. The same log-probs.

Metrics of a training step (``train/moe/...``): ``aux_loss`` and ``z_loss`` (per layer, unscaled,
averaged over the layers and the micro-steps), ``load_imbalance`` (per layer the most top-k choices
any expert got over the mean an expert got, over all the step's tokens of all ranks; averaged over
the layers; 1 is an even spread).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from chatlearn.config.moe_keys import config_experts
from chatlearn.errors import UserError
from chatlearn.models.specs import MoeSpec

logger = logging.getLogger(__name__)

# the FSDP backend's value of each key that means nothing to it, and why
FSDP_IGNORED = {
    "expert_model_parallel_size": (1, "FSDP2 shards every expert over the data-parallel ranks and each rank "
                                      "computes every expert of its own tokens (no expert parallelism)"),
    "expert_tensor_parallel_size": (None, "the FSDP backend has no tensor or expert parallelism"),
    "moe_token_dispatcher_type": ("alltoall", "every rank holds every expert, so no token is dispatched "
                                              "to another rank"),
    "moe_shared_expert_overlap": (False, "there is no token dispatch for the shared experts to overlap with "
                                         "(every rank holds every expert)"),
}


DEFAULT = MoeSpec(aux_loss_coeff=None, z_loss_coeff=0.0, force_load_balancing=False, layer_recompute=False,
                  groupgemm=False, token_dispatcher_type="alltoall", shared_expert_overlap=False,
                  expert_model_parallel_size=1, expert_tensor_parallel_size=None)


def fsdp_ignored_keys(spec: MoeSpec) -> list[tuple[str, object, str]]:
    """``(key, value, why)`` of the keys set away from the FSDP backend's value, which mean nothing there."""
    fields = {"expert_model_parallel_size": spec.expert_model_parallel_size,
              "expert_tensor_parallel_size": spec.expert_tensor_parallel_size,
              "moe_token_dispatcher_type": spec.token_dispatcher_type,
              "moe_shared_expert_overlap": spec.shared_expert_overlap}
    out = []
    for key, (neutral, why) in FSDP_IGNORED.items():
        value = fields[key]
        if value != neutral and not (key == "expert_tensor_parallel_size" and value == 1):
            out.append((key, value, why))
    return out


def router_class(model: torch.nn.Module):
    """The router's class of a transformers MoE model (what it records as ``router_logits``:
    ``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``); None for a dense model."""
    base = getattr(model, "get_base_model", lambda: model)()  # a PeftModel's
    recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    return getattr(recorder, "target_class", None)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in the order of its MoE layers ([] for a dense model)."""
    cls = router_class(model)
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE blocks (the modules whose ``gate`` is a router: ``Qwen3MoeSparseMoeBlock``...)."""
    cls = router_class(model)
    return [] if cls is None else [m for m in model.modules() if isinstance(getattr(m, "gate", None), cls)]


def num_experts(model: torch.nn.Module) -> Optional[int]:
    """The expert count of the model's config (``num_experts`` / ``num_local_experts``), None if dense."""
    return config_experts(model.config.to_dict())


def expert_count_problem(path: str, saved_config: Optional[dict], model: torch.nn.Module, load: str) -> Optional[str]:
    """One paragraph when the checkpoint at ``path`` (its recorded ``saved_config``) was saved from a model with
    another number of experts than ``model`` (loaded from ``load``); None when they agree or the checkpoint
    records no config."""
    if not isinstance(saved_config, dict):
        return None
    saved, ours = config_experts(saved_config), num_experts(model)
    if saved == ours:
        return None
    def say(n):
        return f"{n} experts" if n else "no experts (a dense model)"
    return (f"checkpoint {path!r} was saved from a model with {say(saved)} per MoE layer, and this run's model "
            f"({load!r}, config.json num_experts) has {say(ours)}: the expert weights cannot be loaded into it, and "
            "no resharding changes an expert count. Resume with the model the checkpoint was trained from "
            f"(it was saved from {saved_config.get('_name_or_path') or 'the folder its trainer_meta.json records'!r}), "
            "or start this model from its own folder without resuming.")


class _RandomSTE(torch.autograd.Function):
    """megatron-core's ``RandomSTE``: standard normal logits forward, the gradient passed straight through."""

    @staticmethod
    def forward(ctx, logits):
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _route(router, logits: torch.Tensor):
    """The Qwen MoE routers' own routing of ``logits`` [T, E] (transformers 5 ``Qwen3MoeTopKRouter.forward``):
    softmax in float32, top-k, renormalised when ``norm_topk_prob``; ``(logits, scores, indices)``."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, idx = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


class RouterTaps:
    """Forward hooks on every router of an MoE model: forced load balancing (in every forward), and while
    :meth:`recording` the router logits of each layer (with their graph) for the auxiliary losses and the
    expert counts of the load-imbalance metric."""

    def __init__(self, model: torch.nn.Module, spec: MoeSpec):
        self.spec = spec
        self.routers = routers(model)
        self.num_experts = num_experts(model) or 0
        self.top_k = getattr(model.config, "num_experts_per_tok", None) or getattr(model.config, "top_k", 2)
        coeff = spec.aux_loss_coeff
        self.aux_coeff = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0) if coeff is None else coeff
        self.z_coeff = spec.z_loss_coeff
        self._records: Optional[list] = None
        self._mask: Optional[torch.Tensor] = None
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        self.reset_step()

    def _hook(self, router, args, output):
        if self.spec.force_load_balancing:
            output = _route(router, _RandomSTE.apply(output[0]))
        if self._records is not None:
            self._records.append((output[0], output[2]))
        return output if self.spec.force_load_balancing else None

    # ---------------------------------------------------------------- a training step
    def reset_step(self) -> None:
        """Zero the step's statistics (kept on the routers' device: no host sync per micro-step)."""
        n = max(len(self.routers), 1)
        device = self.routers[0].weight.device if self.routers else torch.device("cpu")
        if device.type == "meta":
            device = torch.device("cpu")
        self.counts = torch.zeros(n, max(self.num_experts, 1), dtype=torch.float64, device=device)
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # aux, z (layer means summed over micro-steps), steps

    def begin(self, mask: Optional[torch.Tensor]) -> None:
        """Record the routers of the next forward; ``mask``: which of its flattened [B*L] tokens count
        (None: all)."""
        self._records = []
        self._mask = None if mask is None else mask.reshape(-1).bool()

    def end(self, micro_steps: int) -> Optional[torch.Tensor]:
        """Stop recording; the micro-batch's auxiliary loss term (``coeff x sum over layers``, divided by
        ``micro_steps``), None when no coefficient is set; the statistics are added to the step's."""
        records, mask = self._records or [], self._mask
        self._records = self._mask = None
        aux_terms, z_terms = [], []
        for layer, (logits, idx) in enumerate(records):
            if mask is not None:
                logits, idx = logits[mask], idx[mask]
            if logits.shape[0] == 0:
                continue
            aux_terms.append(switch_aux_loss(logits, idx, self.num_experts, self.top_k))
            z_terms.append(z_loss(logits))
            self.counts[layer] += torch.bincount(idx.reshape(-1), minlength=self.num_experts).to(self.counts)
        self.sums[2] += 1
        if not aux_terms:
            return None
        aux, z = torch.stack(aux_terms), torch.stack(z_terms)
        self.sums[0] += aux.detach().mean().to(self.sums)
        self.sums[1] += z.detach().mean().to(self.sums)
        term = None
        if self.aux_coeff:
            term = self.aux_coeff * aux.sum()
        if self.z_coeff:
            term = self.z_coeff * z.sum() if term is None else term + self.z_coeff * z.sum()
        return None if term is None else term / micro_steps

    def step_metrics(self, device: torch.device) -> dict:
        """``moe/aux_loss``, ``moe/z_loss``, ``moe/load_imbalance`` of the step, over all ranks (a collective)."""
        sums = self.sums.to(device)
        counts = self.counts.to(device)
        if dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        sums, counts = sums.cpu(), counts.cpu()
        steps = max(float(sums[2]), 1.0)
        return {"moe/aux_loss": float(sums[0]) / steps, "moe/z_loss": float(sums[1]) / steps,
                "moe/load_imbalance": load_imbalance(counts)}


def switch_aux_loss(logits: torch.Tensor, idx: torch.Tensor, experts: int, top_k: int) -> torch.Tensor:
    """One layer's load-balancing loss over the tokens of ``logits`` [T, E] (their top-k ``idx`` [T, k]):
    ``E / k * sum_e f_e * P_e`` with ``f_e`` the share of the T tokens that chose expert e, ``P_e`` the mean
    router probability of e (megatron-core ``switch_load_balancing_loss_func`` without the coefficient)."""
    probs = torch.softmax(logits.float(), dim=-1)
    tokens = logits.shape[0]
    f = torch.bincount(idx.reshape(-1), minlength=experts).to(probs.dtype) / tokens
    return experts / top_k * (f * probs.mean(dim=0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """One layer's router z-loss: ``mean_t logsumexp(z_t)^2`` (megatron-core ``z_loss_func`` without the coefficient)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def load_imbalance(counts: torch.Tensor) -> float:
    """Mean over layers (rows of ``counts`` [layers, E], top-k choices per expert) of max / mean; 0 without tokens."""
    rows = [c for c in counts if float(c.sum()) > 0]
    if not rows:
        return 0.0
    return float(sum(float(c.max() / c.mean()) for c in rows) / len(rows))


def lora_problem(model: torch.nn.Module, targets) -> Optional[str]:
    """One paragraph when peft's LoRA (already injected into ``model`` with ``targets``) adapts parameters
    rather than linear layers: peft 0.21 (``target_parameters``, its ``ParamWrapper`` layers) does that for
    transformers 5's fused 3D expert tensors and the router's weight of an MoE model when the targets take
    them (``all-linear`` does); None otherwise (LoRA on the linear layers of an MoE model works as on a
    dense one: the experts and the router are then trained by nothing and stay the base model's)."""
    wrapped = sorted({name.split(".base_layer")[0] for name, m in model.named_modules()
                      if type(m).__name__ == "ParamWrapper"})
    if not wrapped:
        return None
    shown = ", ".join(wrapped[:2]) + (f" (and {len(wrapped) - 2} more)" if len(wrapped) > 2 else "")
    return (f"lora.target_modules {targets!r} makes peft adapt the mixture-of-experts parameters of this model "
            f"({shown}): peft 0.21 wraps transformers' fused 3D expert tensors [experts, out, in] and the router's "
            "weight in ParamWrapper layers, whose merged update (per expert W_e + B_e @ A_e x alpha / rank) the "
            "weight push, the checkpoints and chatlearn merge do not compute. On an MoE model give LoRA the "
            "attention's linear layers only, e.g. lora.target_modules: [q_proj, k_proj, v_proj, o_proj] (the "
            "experts and the router then keep the base weights), or train the whole model (lora.rank: 0).")


def _recomputed(block: torch.nn.Module):
    """``block.forward`` run under non-reentrant ``torch.utils.checkpoint`` when training with gradients."""
    forward = block.forward

    def run(*args, **kwargs):
        if block.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def apply(model: torch.nn.Module, spec: MoeSpec, key) -> Optional[RouterTaps]:
    """Make the MoE keys of ``spec`` act on ``model`` (before sharding): the experts implementation
    (``groupgemm``), the recomputed MoE blocks (``moe_layer_recompute``, unless ``gradient_checkpointing``
    already recomputes the layers: the caller passes ``spec`` with it off then) and the router taps.
    ``key(name)``: the config key of this model's ``name``. Returns the taps; None for a dense model."""
    if router_class(model) is None or not routers(model):
        return None
    base = getattr(model, "get_base_model", lambda: model)()
    impl = "grouped_mm" if spec.groupgemm else "eager"
    if getattr(base, "_can_set_experts_implementation", lambda: False)():
        try:
            base.set_experts_implementation(impl)
        except (ValueError, ImportError) as err:
            raise UserError(f"groupgemm: true asks for transformers' grouped_mm experts, which this machine cannot "
                            f"run ({err}). Set groupgemm: false (one matmul per expert).", key=key("groupgemm")) from None
    elif spec.groupgemm:
        raise UserError(f"{type(base).__name__} has no switchable experts implementation (transformers' "
                        "use_experts_implementation), so groupgemm cannot act on it. Set groupgemm: false.",
                        key=key("groupgemm"))
    if spec.layer_recompute:
        for block in moe_blocks(model):
            block.forward = _recomputed(block)
    for name, value, why in fsdp_ignored_keys(spec):
        logger.warning("%s: %r has no effect on the FSDP backend: %s.", key(name), value, why)
    return RouterTaps(model, spec)
