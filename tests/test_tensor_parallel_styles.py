"""The tensor-parallel style names of transformers' `base_model_tp_plan`s, each checked on its own.

Tier 1 (no process group): every style transformers registers is either run by ultrascale or refused
with a reason. Tier 2 (gloo, tp=2, no FSDP on top): a toy model using every dense style at once equals
one process in its output and every gradient, and no gradient is left a pending (Partial) sum.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.testing import assert_close

from tests._dist import run_ranks
from ultrascale.parallel.tensor import apply_tp
from ultrascale.parallel.tensor_styles import (
    PARAMETER_STYLE_NAMES,
    REFUSED_STYLE_NAMES,
    STYLE_NAMES,
    packed_shard,
    resolve_plan,
    style_from_name,
)


def test_every_transformers_style_is_run_or_refused():
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)
    import transformers.distributed.tensor_parallel  # noqa: F401  (registers the tensor-parallel styles)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    registered = set(ALL_PARALLEL_STYLES.keys())
    assert registered, "transformers registered no tensor-parallel styles"
    runs = set(STYLE_NAMES) | set(PARAMETER_STYLE_NAMES)
    unknown = registered - runs - set(REFUSED_STYLE_NAMES)
    assert not unknown, f"transformers styles ultrascale neither runs nor refuses: {sorted(unknown)}"
    assert not runs & set(REFUSED_STYLE_NAMES)


def test_refused_style_says_why():
    with pytest.raises(ValueError, match="'grouped_gemm' is not supported: .*expert_parallel="):
        style_from_name("grouped_gemm")
    with pytest.raises(ValueError, match="unknown tensor-parallel style 'diagonal'"):
        style_from_name("diagonal")


def test_bare_parameter_entries_need_their_modules_entry():
    """An entry naming a parameter lays it out only under its module's 'moe_tp_experts' / 'local_params' entry;
    a packed style on a module, or an entry naming nothing, is an error (never a silently whole weight)."""
    from ultrascale.parallel.tensor import split_parameter_entries

    model = Toy()
    with pytest.raises(ValueError, match="lay out bare parameters, which ultrascale splits only under"):
        split_parameter_entries(model, resolve_plan({"sinky.sinks": "colwise"}))
    with pytest.raises(ValueError, match="match no submodule or parameter of Toy: \\['sinky.nothing'\\]"):
        split_parameter_entries(model, resolve_plan({"sinky.nothing": "colwise", "sinky": "local_params"}))
    with pytest.raises(ValueError, match="names a bare parameter; give its layout as one of"):
        split_parameter_entries(model, {"sinky.sinks": RowwiseParallel(), "sinky": style_from_name("local_params")})
    with pytest.raises(ValueError, match="'packed_colwise' lays out a fused weight parameter"):
        style_from_name("packed_colwise")._apply(model.q, None)
    experts = split_parameter_entries(model, resolve_plan(PLAN))["experts"]
    # 'packed_colwise' on (E, 2I, D): gate and up halves split together; 'rowwise' on (E, D, I): split on I.
    assert experts.placements == {"gate_up_proj": packed_shard(1), "down_proj": Shard(2)}
    assert experts.placements["gate_up_proj"] != Shard(1)  # a plain split of the packed dim would pair wrong rows


def test_per_head_parameters_a_plan_leaves_whole_beside_split_heads_are_found():
    """A bare parameter with one value per head, in a module whose column-parallel layers split the heads: listed
    where the plan leaves it whole (Doge's `A`), not where the plan splits it (the sinks' 'local_params')."""
    from ultrascale.parallel.tensor import per_head_parameters_left_whole

    model = Toy()
    assert per_head_parameters_left_whole(model, resolve_plan(PLAN), {HEADS}) == []
    whole = {key: style for key, style in PLAN.items() if key not in ("sinky.sinks", "sinky")}
    assert per_head_parameters_left_whole(model, resolve_plan(whole), {HEADS}) == ["sinky.sinks"]
    assert per_head_parameters_left_whole(model, resolve_plan(whole), {HEADS + 1}) == []
    without_split = {key: style for key, style in whole.items() if not key.startswith("sinky.")}
    assert per_head_parameters_left_whole(model, resolve_plan(without_split), {HEADS}) == []  # nothing split beside


def test_shipped_plans_of_tested_architectures_resolve():
    import transformers as T

    for config in (T.Qwen3Config(), T.Gemma3TextConfig(), T.Phi3Config(), T.Olmo2Config()):
        resolve_plan(config.base_model_tp_plan)


HEAD_DIM, HEADS, DIM, ROPE = 8, 4, 16, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


EXPERTS, TOP_K, WIDTH = 4, 2, 6


class Experts(nn.Module):
    """Fused SwiGLU experts as transformers 5 keeps them, computed its way (a loop over the experts hit):
    ``gate_up_proj`` (E, 2I, D) = [gate; up] and ``down_proj`` (E, D, I); transposed (Llama4, Aria):
    (E, D, 2I) and (E, I, D)."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.transposed = transposed
        self.identity_expert = nn.Identity()  # LongCat-Flash's zero-compute expert: index EXPERTS
        scale = DIM ** -0.5  # O(1) activations: the comparison's tolerance is for fp32 reduction order
        self.gate_up_proj = nn.Parameter(
            scale * (torch.randn(EXPERTS, DIM, 2 * WIDTH) if transposed else torch.randn(EXPERTS, 2 * WIDTH, DIM)))
        self.down_proj = nn.Parameter(scale * (torch.randn(EXPERTS, WIDTH, DIM) if transposed else torch.randn(EXPERTS, DIM, WIDTH)))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(EXPERTS + 1):
            token, slot = torch.where(top_k_index == e)
            if e == EXPERTS:
                out = out.index_add(0, token, self.identity_expert(hidden[token]) * top_k_weights[token, slot, None])
                continue
            gate_up, down = self.gate_up_proj[e], self.down_proj[e]
            h = hidden[token] @ (gate_up if self.transposed else gate_up.t())  # (n, 2I / tp)
            gate, up = h.chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ (down if self.transposed else down.t())  # (n, D) partial
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class SharedExperts(nn.Module):
    """Inkling's shared experts: bare (n, I, D) / (n, D, I) weights, the intermediate scaled by per-token
    gammas (an input whose gradient is partial over tp, like the routing weights)."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        scale = DIM ** -0.5
        self.gate_proj = nn.Parameter(scale * torch.randn(n, WIDTH, DIM))
        self.up_proj = nn.Parameter(scale * torch.randn(n, WIDTH, DIM))
        self.down_proj = nn.Parameter(scale * torch.randn(n, DIM, WIDTH))

    def forward(self, hidden: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        x = hidden.unsqueeze(0).expand(self.gate_proj.shape[0], -1, -1)  # (n, N, D)
        activated = torch.nn.functional.silu(torch.bmm(x, self.gate_proj.transpose(1, 2))) * torch.bmm(x, self.up_proj.transpose(1, 2))
        return torch.bmm(activated * gammas.t().unsqueeze(-1), self.down_proj.transpose(1, 2)).sum(0)  # (N, D)


class Sinky(nn.Module):
    """An attention-like module with per-head sinks (n_heads,), a bare parameter beside its q/o linears."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.sinks = nn.Parameter(torch.randn(HEADS))
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, HEAD_DIM)  # (B, T, HEADS // tp, hd): the local heads
        scale = torch.sigmoid(self.sinks)[None, None, :, None]  # the local heads' sinks
        return self.o((q * scale).reshape(B, T, -1))


class Toy(nn.Module):
    """Every style of transformers' plans in one forward (module -> style in PLAN)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, DIM)
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.q_norm = RMSNorm(HEAD_DIM)  # per head, on this rank's heads
        self.kv_a = nn.Linear(DIM, HEAD_DIM + ROPE)  # MLA: latent | RoPE key part
        self.kv_b = nn.Linear(HEAD_DIM, HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM)
        self.gather = nn.Linear(DIM, 2 * DIM)
        self.full_norm = RMSNorm(2 * DIM)  # over every feature: needs them all (OLMo2's q_norm)
        self.split = nn.Linear(2 * DIM, DIM)
        self.mlp = MLP()
        self.sinky = Sinky()
        self.router = nn.Linear(DIM, EXPERTS + 1)  # replicated: same tokens and weights on every tp rank
        self.experts = Experts(transposed=False)
        self.experts_t = Experts(transposed=True)
        self.plain = Experts(transposed=False)  # its plan says 'colwise' for a concatenated [gate; up] (Inkling's)
        self.gammas = nn.Linear(DIM, 2)
        self.shared = SharedExperts()
        self.head = nn.Linear(DIM, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # (B, T, D)
        B, T, _ = x.shape
        q = self.q_norm(self.q(x).view(B, T, -1, HEAD_DIM))  # (B, T, HEADS // tp, hd)
        latent, rope = self.kv_a(x).split([HEAD_DIM, ROPE], dim=-1)  # (B, T, hd), (B, T, ROPE)
        k = self.kv_b(latent).view(B, T, -1, HEAD_DIM)  # (B, T, HEADS // tp, hd)
        k = torch.cat([k[..., :ROPE] + rope[:, :, None, :], k[..., ROPE:]], dim=-1)  # RoPE part shared by all heads
        mixed = (q * k).sum(-1, keepdim=True).tanh() * k  # (B, T, HEADS // tp, hd)
        x = x + self.o(mixed.reshape(B, T, -1))  # row-parallel: (B, T, D)
        x = x + self.split(self.full_norm(self.gather(x)))  # gathered (B, T, 2D) -> split input
        x = x + self.mlp(x)
        x = x + self.sinky(x)
        flat = x.reshape(B * T, -1)
        weights, chosen = self.router(flat).softmax(-1).topk(TOP_K, dim=-1)  # (B T, k) each
        routed = self.experts(flat, chosen, weights) + self.experts_t(flat, chosen, weights) + self.plain(flat, chosen, weights)
        x = x + (routed + self.shared(flat, torch.sigmoid(self.gammas(flat)))).view(B, T, -1)
        return self.head(x)


PLAN = {
    "emb": "embedding_colwise",
    "q": "colwise",
    "q_norm": "replicated_with_grad_allreduce",
    "kv_a": "mla_kv_a_proj",
    "kv_b": "colwise",
    "o": "rowwise",
    "gather": "colwise_gather_output",
    "split": "rowwise_split_input",
    "mlp.up": "colwise",
    # A row-parallel layer that leaves its partial sums to its parent, which all-reduces them.
    "mlp.down": RowwiseParallel(output_layouts=Partial()),
    "mlp": "all_reduce",
    "sinky.q": "colwise",
    "sinky.o": "rowwise",
    "sinky.sinks": "colwise",
    "sinky": "local_params",
    "experts.gate_up_proj": "packed_colwise",
    "experts.down_proj": "rowwise",
    "experts": "moe_tp_experts",
    "experts_t.gate_up_proj": "packed_rowwise",
    "experts_t.down_proj": "colwise",
    "experts_t": "moe_tp_experts",
    "experts.identity_expert": "moe_identity_expert",
    "experts_t.identity_expert": "moe_identity_expert",
    "plain.gate_up_proj": "colwise",
    "plain.down_proj": "rowwise",
    "plain": "moe_tp_experts",
    "plain.identity_expert": "moe_identity_expert",
    "shared.gate_proj": "colwise",
    "shared.up_proj": "colwise",
    "shared.down_proj": "rowwise",
    "shared": "all_reduce",
    "head": "replicate",
}


def _toy_and_batch():
    torch.manual_seed(0)
    model = Toy()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model, torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))


def _styles_tp2(rank, world_size, plan):
    from torch.distributed.device_mesh import init_device_mesh

    from ultrascale.parallel.tensor_styles import MlaKvAProjParallel

    model, ids = _toy_and_batch()
    plan = resolve_plan({k: MlaKvAProjParallel(rope_dim=ROPE) if v == "mla_kv_a_proj" else v for k, v in plan.items()})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_tp(model, init_device_mesh("cpu", (world_size,)), plan)
    out = model(ids)
    out.pow(2).mean().backward()
    partial = [n for n, p in model.named_parameters() if any(pl.is_partial() for pl in getattr(p.grad, "placements", ()))]
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in model.named_parameters()}
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    warned = " ".join(str(w.message) for w in caught if "gate_up_proj" in str(w.message))
    return {"out": out.detach(), "grads": grads, "partial": partial, "local": local, "warned": warned}


def test_every_dense_style_matches_one_process():
    model, ids = _toy_and_batch()
    out = model(ids)
    out.pow(2).mean().backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    for result in run_ranks(_styles_tp2, 2, PLAN):
        assert result["partial"] == []  # every tp sum done in backward, once: `.grad` has the parameter's layout
        assert result["local"]["emb.weight"] == (32, DIM // 2) and result["local"]["q.weight"] == (16, DIM)
        assert result["local"]["q_norm.weight"] == (HEAD_DIM,) and result["local"]["split.weight"] == (DIM, DIM)
        assert result["local"]["sinky.sinks"] == (HEADS // 2,)
        assert result["local"]["experts.gate_up_proj"] == (EXPERTS, WIDTH, DIM)
        assert result["local"]["experts_t.gate_up_proj"] == (EXPERTS, DIM, WIDTH)
        assert result["local"]["experts_t.down_proj"] == (EXPERTS, WIDTH // 2, DIM)
        assert result["local"]["plain.gate_up_proj"] == (EXPERTS, WIDTH, DIM) and "packed" in result["warned"]
        assert result["local"]["shared.gate_proj"] == (2, WIDTH // 2, DIM)
        assert_close(result["out"], out.detach(), rtol=1e-5, atol=1e-6)
        for name, grad in expected.items():
            # atol 3e-6: a dozen partial sums over tp reach these gradients in another order than one process
            assert_close(result["grads"][name], grad, rtol=1e-5, atol=3e-6, msg=lambda m: f"grad {name}: {m}")


# Fields shrunk so that every architecture's default config builds small; absent fields are left alone.
_SMALL_FIELDS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=128, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
                     num_experts_per_tok=2, head_dim=16, shared_expert_intermediate_size=32, kv_lora_rank=16, q_lora_rank=16,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


@pytest.mark.slow
def test_every_shipped_causal_lm_plan_is_accepted():
    """Every transformers `*ForCausalLM` whose config ships a `base_model_tp_plan`, built on the meta device from its
    default config shrunk: ultrascale's adapter runs its plan (every style known, every bare-parameter entry owned)
    and refuses none but Doge, whose plan leaves its per-head `A` whole beside the split heads (refused by name, see
    test_hf_matrix). Some default configs do not build once shrunk (per-layer attributes, RoPE fields); the sweep
    must still cover most architectures."""
    import warnings

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ultrascale.models.adapters import get_adapter

    built, refused, not_built = [], {}, []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = CONFIG_MAPPING[model_type]  # a lazy mapping: `in` and `.get` do not see every entry
        except KeyError:
            continue
        if not getattr(config_class, "base_model_tp_plan", None):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = config_class()
                text = getattr(config, "text_config", None)
                target = text if text is not None and getattr(text, "base_model_tp_plan", None) else config
                for field, value in _SMALL_FIELDS.items():
                    if isinstance(getattr(target, field, None), int):
                        setattr(target, field, value)
                for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
                    if hasattr(target, field):
                        setattr(target, field, None)
                with torch.device("meta"):
                    model = transformers.AutoModelForCausalLM.from_config(config)
        except Exception:  # noqa: BLE001 - a default config that does not shrink; counted below
            not_built.append(model_type)
            continue
        built.append(model_type)
        adapter = get_adapter(model)
        if adapter.tp_plan is None or adapter.tp_refusal is not None:
            refused[model_type] = adapter.tp_refusal or "no plan found"
    assert set(refused) == {"doge"}, refused
    assert "self_attn.A holds one value per attention head" in refused["doge"]
    assert len(built) >= 4 * len(not_built) and {"mixtral", "granite_swa", "longcat_flash", "deepseek_v3"} <= set(built), (
        built, not_built)
