"""The Mixture-of-Experts feed-forward of the built-in Llama, and the routing hooks for Hugging Face MoE models.

`MoE` replaces `FeedForward` in every block when ``LlamaConfig.n_experts > 0``: a linear router
picks ``moe_top_k`` of ``n_experts`` SwiGLU experts per token (softmax scores, Mixtral's and
DeepSeek's top-k), optional shared experts see every token (DeepSeek-MoE), and the balance is
kept by an auxiliary loss, by DeepSeek-V3's aux-loss-free selection bias, or not at all; a router
z-loss is optional. The experts' weights are stored fused as transformers 5 stores them
(``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)), so one expert implementation
(`ultrascale.parallel.expert.experts_forward`) and one expert-parallel dispatch serve both.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ultrascale.parallel.expert import (
    ROUTER_LOAD_ATTRIBUTE,
    RouterLoad,
    attach_aux_loss,
    balance_terms,
    capacity_mask,
    experts_forward,
)
from ultrascale.parallel.rules import not_built


class Router(nn.Module):
    """Token -> top-k experts: ``p = softmax(gate(x))``; the k largest of ``p + expert_bias`` are chosen
    (the bias only selects, DeepSeek-V3), weighted by their ``p`` (renormalised to sum 1 if asked)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, *, load_balance: str, aux_loss_coef: float,
                 z_loss_coef: float, bias_update_rate: float, capacity_factor: Optional[float],
                 normalize_weights: bool, layer: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_coef = aux_loss_coef if load_balance == "aux_loss" else 0.0
        self.z_loss_coef = z_loss_coef
        self.capacity_factor = capacity_factor
        self.normalize_weights = normalize_weights
        self.bias_update_rate = bias_update_rate if load_balance == "aux_free" else 0.0
        # A buffer, not a parameter: moved by `update_router_bias` after each step, saved in checkpoints.
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=load_balance == "aux_free")
        setattr(self, ROUTER_LOAD_ATTRIBUTE, RouterLoad(n_experts, top_k, layer))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``x`` (B, T, H) -> chosen experts (B T, k) (``n_experts`` = dropped over capacity), their
        weights (B T, k) fp32, and the balance terms' sum (None when off)."""
        rows = x.shape[0]
        logits = self.gate(x.reshape(-1, x.shape[-1]))  # (B T, E)
        probs = logits.float().softmax(-1)  # (B T, E)
        with torch.no_grad():
            chosen = torch.topk(probs + self.expert_bias.float(), self.top_k, dim=-1).indices  # (B T, k)
        weights = probs.gather(-1, chosen)  # (B T, k)
        if self.normalize_weights and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        load: RouterLoad = getattr(self, ROUTER_LOAD_ATTRIBUTE)
        aux = balance_terms(logits, chosen, rows, load, aux_coef=self.aux_loss_coef, z_coef=self.z_loss_coef)
        if self.capacity_factor is not None:
            chosen = capacity_mask(chosen, self.n_experts, self.capacity_factor)
        if self.training:
            load.record(chosen, aux, chosen.shape[0])
        return chosen, weights, aux


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts in two fused tensors (transformers 5's layout): ``gate_up_proj``
    (E, 2I, H) = [gate; up] per expert, ``down_proj`` (E, H, I)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.act_fn = F.silu

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                may_drop: bool = False) -> torch.Tensor:
        return experts_forward(self, hidden, top_k_index, top_k_weights, may_drop=may_drop)


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``; w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, dim); hidden is (B, T, ffn_hidden_dim)


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of the block's feed-forward: ``(B, T, H) -> (B, T, H)``."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        hidden = config.resolved_moe_hidden_dim
        self.router = Router(
            config.dim, config.n_experts, config.moe_top_k, load_balance=config.moe_load_balance,
            aux_loss_coef=config.moe_aux_loss_coef, z_loss_coef=config.moe_z_loss_coef,
            bias_update_rate=config.moe_bias_update_rate, capacity_factor=config.moe_capacity_factor,
            normalize_weights=config.moe_normalize_weights, layer=layer,
        )
        self.experts = GroupedExperts(config.dim, hidden, config.n_experts)
        self.shared_experts = FeedForward(config.dim, hidden * config.n_shared_experts) if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        chosen, weights, aux = self.router(x)  # (B T, k) each
        routed = self.experts(x.reshape(-1, dim), chosen, weights, may_drop=self.router.capacity_factor is not None)
        out = routed.view(batch, seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return attach_aux_loss(out, aux, getattr(self.router, ROUTER_LOAD_ATTRIBUTE))


# --------------------------------------------------------------------------- Hugging Face MoE models


HF_EXPERTS_IMPLEMENTATION = "ultrascale"
"""The name ultrascale's `experts_forward` is registered under in transformers' `ExpertsInterface`."""


def hf_experts_modules(model: nn.Module) -> list[nn.Module]:
    """The fused experts modules of a transformers 5 MoE model (``gate_up_proj`` (E, 2I, H), ``down_proj``)."""
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
            and m.gate_up_proj.dim() == 3 and isinstance(getattr(m, "down_proj", None), torch.Tensor)]


ROUTER_NAMES = ("gate", "router")
"""Where transformers' MoE blocks keep the router beside `experts` (Mixtral / Qwen / DeepSeek: `gate`; GPT-OSS: `router`)."""


def hf_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers (``weight`` (E, H), ``top_k``) beside each experts module, in layer order."""
    routers = []
    for parent in model.modules():
        if getattr(parent, "experts", None) is None:
            continue
        for name in ROUTER_NAMES:
            router = getattr(parent, name, None)
            if router is not None and hasattr(router, "top_k") and isinstance(getattr(router, "weight", None), torch.Tensor):
                routers.append(router)
                break
    return routers


def behind_experts_interface(experts: nn.Module) -> bool:
    """Whether transformers' ExpertsInterface dispatches this experts module (its class wrapped by
    `use_experts_implementation`, whose __init__ sets `has_gate`): routed by a top-k router of the form
    (logits, weights, indices) beside it. Llama 4's computes every expert for every token in its own forward."""
    return "has_gate" in vars(experts)


def hf_experts_problem(model: nn.Module) -> Optional[str]:
    """Why `experts_forward` cannot compute some experts module of `model`, or None. It computes gated experts in
    every layout transformers' `use_experts_implementation` declares with `has_gate` (concatenated or interleaved
    [gate, up] through the module's own `_apply_gate`, transposed or not, with or without biases), without a norm
    after each expert. An experts module whose class that decorator did not wrap computes its experts itself, which
    the dispatch cannot replace (Llama 4's runs every token through every expert, weighted by its score)."""
    for experts in hf_experts_modules(model):
        if not behind_experts_interface(experts):
            return (f"{type(experts).__name__} computes its experts in its own forward, not through transformers' "
                    "ExpertsInterface (`use_experts_implementation`)")
        if experts.has_gate is not True:
            return f"{type(experts).__name__} has no gate projection (has_gate=False: `up_proj` experts)"
        if getattr(experts, "has_post_expert_norm", False):
            return f"{type(experts).__name__} normalises each expert's output (has_post_expert_norm=True)"
    return None


def attach_hf_routing(model: nn.Module, *, aux_loss_coef: float, z_loss_coef: float) -> None:
    """Give each router of a transformers MoE model a `RouterLoad` (per-expert token counts, logged by
    ultrascale strategies) and, when a coefficient is set, ultrascale's balance terms: computed from
    the router's logits and choices by a forward hook and attached to its routing weights, so they
    join backward with the experts' output (see `ultrascale.parallel.expert`). Idempotent. Routers whose experts
    transformers' ExpertsInterface does not dispatch (Llama 4's) route their own way: they get none, and the balance
    and z-losses on them are refused by name."""
    routers = [router for router in hf_routers(model) if behind_experts_interface(_moe_block(model, router).experts)]
    if len(routers) < len(hf_routers(model)) and (aux_loss_coef or z_loss_coef):
        own = next(r for r in hf_routers(model) if r not in routers)
        raise not_built("hf_router_form", (
            f"{type(_moe_block(model, own).experts).__name__} routes its tokens itself, not through transformers' "
            "ExpertsInterface: ultrascale's router balance and z-losses read a top-k router's (logits, weights, indices); "
            "set router_aux_loss_coef=0 and router_z_loss_coef=0 for this model"))
    for layer, router in enumerate(routers):
        if hasattr(router, ROUTER_LOAD_ATTRIBUTE):
            continue
        load = RouterLoad(router.weight.shape[0], router.top_k, layer)
        setattr(router, ROUTER_LOAD_ATTRIBUTE, load)

        def hook(module: nn.Module, args: Any, output: Any, load: RouterLoad = load) -> Any:
            if not (isinstance(output, tuple) and len(output) == 3):
                # Inkling's also returns its shared experts' gammas (and its weight holds their rows): not counted.
                if aux_loss_coef or z_loss_coef:
                    raise not_built("hf_router_form", (
                        f"{type(module).__name__} returns {len(output) if isinstance(output, tuple) else 1} value(s), "
                        "not (logits, weights, indices): ultrascale's router balance and z-losses read that form; "
                        "set router_aux_loss_coef=0 and router_z_loss_coef=0 for this model"))
                return output
            logits, scores, chosen = output  # (B T, E), (B T, k), (B T, k)
            rows = module._ultrascale_rows
            aux = balance_terms(logits, chosen, rows, load, aux_coef=aux_loss_coef, z_coef=z_loss_coef)
            if module.training:
                load.record(chosen, aux, chosen.shape[0])
            return logits, attach_aux_loss(scores, aux, load), chosen

        def rows_hook(module: nn.Module, args: Any, router: nn.Module = router) -> None:
            router._ultrascale_rows = args[0].shape[0] if args[0].dim() == 3 else 1  # the MoE block sees (B, T, H)

        router.register_forward_hook(hook)
        _moe_block(model, router).register_forward_pre_hook(rows_hook)


def _moe_block(model: nn.Module, router: nn.Module) -> nn.Module:
    """The MoE block holding `router` beside its `experts`."""
    return next(m for m in model.modules() if any(getattr(m, name, None) is router for name in ROUTER_NAMES))


def register_hf_experts() -> None:
    """Make `experts_forward` a transformers experts implementation named `HF_EXPERTS_IMPLEMENTATION`."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(HF_EXPERTS_IMPLEMENTATION, experts_forward)


__all__ = [
    "GroupedExperts",
    "HF_EXPERTS_IMPLEMENTATION",
    "MoE",
    "Router",
    "attach_hf_routing",
    "hf_experts_problem",
    "hf_experts_modules",
    "hf_routers",
    "register_hf_experts",
]
