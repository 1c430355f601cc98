"""The CUDA branches, each checked on a GPU against its CPU-proven or plain-torch counterpart.

Skipped without CUDA (every figure of the project so far came from CPU ranks over gloo: docs/verify.md lists
what has never run on a GPU); the two-rank NCCL tests also need two GPUs. Run them on a GPU machine with

    python -m pytest -q -m gpu tests/test_gpu.py

Multi-rank tests spawn their ranks (a process that has touched CUDA cannot fork one that uses it).
"""

from __future__ import annotations

import math
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ultrascale.launch import free_port

CUDA = torch.cuda.is_available()
TWO_GPUS = CUDA and torch.cuda.device_count() >= 2
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
needs_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")


def _spawned(rank: int, world: int, port: int, fn_name: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = globals()[fn_name](rank, world)
        torch.save(result, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_nccl(fn_name: str, world: int = 2) -> list:
    """`fn_name(rank, world)` (a function of this module) on `world` spawned ranks, one GPU each, NCCL."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_spawned, args=(world, free_port(), fn_name, out), nprocs=world, join=True)
        return [torch.load(Path(out) / f"{rank}.pt", weights_only=False) for rank in range(world)]


# --------------------------------------------------------------------------- attention backend, flash-attn


def test_attention_backend_choice_and_flash_attn_equal_sdpa():
    """`parallel.device.attention_backend`: flash-attn on SM80+ in bf16 where installed, SDPA otherwise; the
    built-in Llama's attention gives SDPA's output either way."""
    from ultrascale.models.llama import ScaledDotProductAttention
    from ultrascale.parallel.device import attention_backend, flash_attn_installed

    device = torch.device("cuda")
    sm80 = torch.cuda.get_device_capability(device) >= (8, 0)
    assert attention_backend(device, torch.bfloat16) == ("flash" if sm80 and flash_attn_installed() else "sdpa")
    assert attention_backend(device, torch.float32) == "sdpa"
    torch.manual_seed(0)
    q = torch.randn(2, 8, 128, 64, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 128, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    got = ScaledDotProductAttention()(q, k, v)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- context parallel's CUDA kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_parallel_cuda_kernel_and_its_log_sum_exp(dtype):
    """The CUDA (out, lse) kernel behind ring / all-gather attention: the output equals SDPA's, the
    log-sum-exp equals logsumexp of the scaled causal scores, and the backward equals autograd's."""
    from ultrascale.parallel.attention_kernels import attention_kernel

    forward, backward = attention_kernel(torch.device("cuda"))
    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 32, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    scale = 32**-0.5
    out, lse = forward(q.detach(), k.detach(), v.detach(), True, None, scale)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert_close(out.float(), reference.detach(), **tol)
    scores = (q.float() @ k.float().repeat_interleave(2, 1).transpose(-2, -1)) * scale  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    assert lse.dtype == torch.float32
    assert_close(lse, scores.logsumexp(-1).detach(), **tol)
    dout = torch.randn_like(out)
    dq, dk, dv = backward(dout, q.detach(), k.detach(), v.detach(), out, lse, True, None, scale)
    reference.backward(dout.float())
    for got, param in ((dq, q), (dk, k), (dv, v)):
        assert_close(got.float(), param.grad.float(), **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else tol))


# --------------------------------------------------------------------------- NCCL: ring attention, pipeline sends


def _ring_attention_nccl(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from ultrascale.parallel.context import ContextParallel

    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    q = torch.randn(1, 4, 64, 16, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 4, 64, 16, device="cuda", requires_grad=True) for _ in range(2))
    out = {}
    for method in ("ring", "allgather"):
        cp = ContextParallel(mesh, method)
        local = cp.shard_batch({"input_ids": torch.zeros(1, 64, dtype=torch.long, device="cuda")})
        index = local["position_ids"][0]
        lq, lk, lv = (t.detach()[:, :, index].clone().requires_grad_() for t in (q, k, v))
        result = cp.attention(lq, lk, lv)
        result.sum().backward()
        out[method] = {"index": index.cpu(), "out": result.detach().cpu(), "dq": lq.grad.cpu()}
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected.sum().backward()
    out["expected"], out["expected_dq"] = expected.detach().cpu(), q.grad.cpu()
    return out


@needs_two_gpus
def test_ring_and_allgather_attention_over_nccl():
    """Context parallel's P2P ring and all-gather on NCCL, cp 2: each rank's queries equal full SDPA."""
    for result in run_nccl("_ring_attention_nccl"):
        for method in ("ring", "allgather"):
            index = result[method]["index"]
            assert_close(result[method]["out"], result["expected"][:, :, index], rtol=1e-5, atol=1e-5)
            assert_close(result[method]["dq"], result["expected_dq"][:, :, index], rtol=1e-4, atol=1e-4)


def _pipeline_nccl(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 32, device="cuda") for _ in range(world)]
    stage = PipelineStage(layers[rank], rank, world, torch.device("cuda"))
    losses: list[torch.Tensor] = []
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: F.mse_loss(out, target, reduction="sum"),
                            scale_grads=False)
    x, target = torch.randn(8, 32, device="cuda"), torch.randn(8, 32, device="cuda")
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=target, losses=losses)
    dist.barrier()
    return {"grad": layers[rank].weight.grad.cpu(), "x": x.cpu(), "target": target.cpu(),
            "weights": [(layer.weight.detach().cpu(), layer.bias.detach().cpu()) for layer in layers]}


@needs_two_gpus
def test_pipeline_sends_over_nccl():
    """torch's 1F1B over NCCL P2P between two GPUs: each stage's gradient equals the one-device chain's."""
    results = run_nccl("_pipeline_nccl")
    layers = [torch.nn.Linear(32, 32) for _ in results[0]["weights"]]
    with torch.no_grad():
        for layer, (weight, bias) in zip(layers, results[0]["weights"]):
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
    out = results[0]["x"]
    for layer in layers:
        out = layer(out)
    F.mse_loss(out, results[0]["target"], reduction="sum").backward()
    for rank, result in enumerate(results):
        assert_close(result["grad"], layers[rank].weight.grad, rtol=1e-4, atol=1e-4)


def _fsdp_float8_all_gather(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(3)]).cuda()
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = init_device_mesh("cuda", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(16, 64, device="cuda")
    model(x).float().pow(2).mean().backward()
    return {"finite": all(torch.isfinite(p.grad.full_tensor()).all().item() for p in model.parameters())}


@needs_two_gpus
def test_fsdp_float8_all_gather_over_nccl():
    assert all(result["finite"] for result in run_nccl("_fsdp_float8_all_gather"))


# --------------------------------------------------------------------------- Float8


def test_float8_linear_close_to_bf16():
    """torchao's Float8Linear (what `Float8Training` converts to) on a GPU with fp8 matmuls (SM89+), forward and
    backward within fp8's error of the bf16 layer."""
    from ultrascale.parallel.device import float8_matmul_support

    refusal, _ = float8_matmul_support(torch.device("cuda"), "tensorwise")
    if refusal is not None:
        pytest.skip(refusal)
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False)).cuda()
    converted = convert_to_float8_training(
        torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features, bias=False) for m in reference]).cuda())
    converted.load_state_dict(reference.state_dict())
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected, got = reference(x), converted(x)
    expected.float().sum().backward()
    got.float().sum().backward()
    relative = (got.float() - expected.float()).norm() / expected.float().norm()
    assert relative < 0.1, relative
    grad_error = (converted[0].weight.grad - reference[0].weight.grad).norm() / reference[0].weight.grad.norm()
    assert grad_error < 0.1, grad_error


def test_float8_training_callback_compiled_fit(tmp_path):
    """The callback itself on a GPU with fp8 tensor cores, compiled (its fast path): every block's linears in fp8,
    the loss finite and falling."""
    from ultrascale.parallel.device import float8_matmul_support

    refusal, _ = float8_matmul_support(torch.device("cuda"), "tensorwise")
    if refusal is not None:
        pytest.skip(refusal)
    import ultrascale
    from ultrascale.callbacks import Float8Training

    fp8 = Float8Training(skip_first_last=False)
    losses = _tiny_fit(tmp_path, [fp8], "bf16-mixed", steps=6, strategy=ultrascale.ZeRO3Strategy(compile=True))
    assert fp8.converted and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


def test_selective_checkpointing_keeps_flash_attn_output():
    """flash-attn's forward is the attention kernel on CUDA in bf16; selective AC must keep its output, as SDPA's."""
    from ultrascale.callbacks.activation_checkpointing import SelectiveAC, _flash_attn_ops
    from ultrascale.parallel.device import flash_attn_installed

    if not flash_attn_installed():
        pytest.skip("flash-attn is not installed")
    assert _flash_attn_ops() and _flash_attn_ops() <= SelectiveAC().get_save_ops()


# --------------------------------------------------------------------------- MemoryMonitor, bf16, checkpoints, experts


def _tiny_fit(tmp_path: Path, callbacks: list, precision: str, steps: int = 3, strategy: Any = "ultrascale_zero3"):
    import lightning as L

    from tests._parity import ParityData, Recorder, TokenDataset
    from ultrascale.models import LlamaLM

    recorder = Recorder()
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=steps, precision=precision,
                        logger=recorder.logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[recorder, *callbacks])
    try:
        trainer.fit(LlamaLM(preset="tiny", max_steps=100), ParityData(TokenDataset(64, 32, 512, masked=True), 8))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()  # the one-device fit's one-rank group: the next fit makes its own
    return recorder.losses


def test_memory_monitor_cuda_statistics_and_snapshot(tmp_path):
    from ultrascale.callbacks import MemoryMonitor

    monitor = MemoryMonitor(snapshot_at_step=2, snapshot_dir=str(tmp_path / "snapshots"))
    _tiny_fit(tmp_path, [monitor], "32-true")
    snapshots = list((tmp_path / "snapshots").glob("*"))
    assert snapshots and all(s.stat().st_size > 0 for s in snapshots), snapshots


def test_bf16_mixed_on_cuda_close_to_fp32(tmp_path):
    """bf16-mixed on CUDA (FSDP2's bf16 compute, fp32 reductions) follows the fp32 loss curve."""
    fp32 = _tiny_fit(tmp_path / "fp32", [], "32-true")
    bf16 = _tiny_fit(tmp_path / "bf16", [], "bf16-mixed")
    assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=0, atol=2e-2)


def _float8_tensor_parallel(rank: int, world: int) -> dict:
    """A Llama whose block linears FP8 converted, at tp2 with sequence parallel over NCCL (torchao's float8 styles:
    the input all-gathers run in fp8), against the same model in this process alone."""
    import copy

    import torchao.float8 as float8
    from torch.distributed.device_mesh import init_device_mesh

    from ultrascale.models.llama import Llama, LlamaConfig
    from ultrascale.models.tp_plans import llama_tp_plan
    from ultrascale.parallel.tensor import apply_tp, float8_entries

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=512,
                              max_seq_len=64)).cuda()
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"),
                                      module_filter_fn=lambda m, fqn: fqn.startswith("layers."))
    alone = copy.deepcopy(model)
    mesh = init_device_mesh("cuda", (world,))
    plan = llama_tp_plan(sequence_parallel=True, loss_parallel=False)
    styles = {type(style).__name__ for style in float8_entries(model, plan, torch.device("cuda")).values()}
    apply_tp(model, mesh, plan)
    tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    labels = tokens.roll(-1, 1)
    labels[0, :10], labels[1, :37] = -100, -100  # prompts of uneven length, masked
    results = {}
    for name, net in (("tp", model), ("alone", alone)):
        loss = F.cross_entropy(net(tokens).float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        grad = net.layers[0].attention.wq.weight.grad
        results[name] = (loss.item(), (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).cpu())
    return {"styles": styles, **results}


@needs_two_gpus
def test_float8_tensor_parallel_styles_over_nccl():
    result = run_nccl("_float8_tensor_parallel")[0]
    assert {"Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"} <= result["styles"]
    (tp_loss, tp_grad), (loss, grad) = result["tp"], result["alone"]
    assert abs(tp_loss - loss) < 1e-4 * abs(loss)
    assert (tp_grad - grad).norm() < 1e-3 * grad.norm()


def _async_tensor_parallel(rank: int, world: int) -> dict:
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ultrascale.parallel.compile import block_compiler
    from ultrascale.parallel.device import enable_symmetric_memory, symmetric_memory_available

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(1024, 4096, bias=False), torch.nn.Linear(4096, 1024, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.gelu(self.up(x)))

    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    block = Block().cuda().bfloat16()
    parallelize_module(block, mesh, {"up": ColwiseParallel(input_layouts=Shard(1)),
                                     "down": RowwiseParallel(output_layouts=Shard(1))})
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16)[:, rank * 128 : (rank + 1) * 128]
    eager = block(x)
    enable_symmetric_memory(mesh.get_group())  # what the strategy does for its tp group
    block_compiler(True, "inductor", "test", async_tensor_parallel=True).transform_model(block, [block])
    out, code = run_and_get_code(lambda: block(x))
    return {"available": symmetric_memory_available(torch.device("cuda")), "code": "\n".join(code),
            "difference": (out.float() - eager.float()).abs().max().item(), "scale": eager.float().abs().max().item()}


@needs_two_gpus
def test_async_tensor_parallel_fuses_over_nccl():
    """The strategy's async TP on real symmetric memory: the compiled block runs the fused all-gather-matmul and
    matmul-reduce-scatter kernels, and gives eager's output to bf16 rounding."""
    for result in run_nccl("_async_tensor_parallel"):
        assert result["available"]
        assert "fused_all_gather_matmul" in result["code"] and "fused_matmul_reduce_scatter" in result["code"]
        assert result["difference"] <= 2e-2 * result["scale"]


def _async_checkpoint_cuda(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from ultrascale.parallel import checkpoint as ckpt

    folder = Path(os.environ["ULTRASCALE_TEST_DIR"])
    group = dist.new_group(backend="gloo")
    weights = torch.arange(8, dtype=torch.float32, device="cuda") + rank
    pending = ckpt.async_save_sharded_checkpoint({f"w{rank}": weights}, {"global_step": 1}, folder / "a.ckpt", group=group)
    weights.zero_()  # the save copied the CUDA tensor to host memory before returning
    pending.finish()
    state = {f"w{rank}": torch.empty(8, device="cuda")}
    ckpt.load_sharded_checkpoint(folder / "a.ckpt", state)
    return {"loaded": state[f"w{rank}"].cpu()}


@needs_two_gpus
def test_async_checkpoint_of_cuda_tensors_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_TEST_DIR", str(tmp_path))
    for rank, result in enumerate(run_nccl("_async_checkpoint_cuda")):
        assert torch.equal(result["loaded"], torch.arange(8, dtype=torch.float32) + rank)


def test_grouped_mm_experts_equal_the_loop():
    """MoE experts as one `torch._grouped_mm` per projection (bf16 on SM80+) equal the per-expert loop,
    forward and backward."""
    from ultrascale.parallel.device import grouped_mm_supported
    from ultrascale.parallel.expert import run_experts

    device = torch.device("cuda")
    if not grouped_mm_supported(device, torch.bfloat16):
        pytest.skip("grouped matmul needs torch._grouped_mm and compute capability 8.0+")
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 11, 16], device=device)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    gate_up = torch.randn(4, 256, 64, device=device, dtype=torch.bfloat16) * 0.05
    down = torch.randn(4, 64, 128, device=device, dtype=torch.bfloat16) * 0.05
    results = []
    for grouped in (True, False):
        inputs = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        out = run_experts(inputs[0], counts, inputs[1], inputs[2], grouped=grouped)
        out.float().sum().backward()
        results.append([out.detach(), *(t.grad for t in inputs)])
    for got, expected in zip(*results):
        assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- issue 48: what a first GPU run found


def test_mfu_monitor_on_a_32_true_fit(tmp_path):
    """`32-true` without TF32 (torch's default) asks the peak table for its fp32 column: the fit logs MFU."""
    from ultrascale.callbacks import MFUMonitor

    monitor = MFUMonitor()
    _tiny_fit(tmp_path, [monitor], "32-true")
    assert monitor.peak is not None and "fp32" in monitor.peak_source


def _reference_attention(q, k, v, allowed):
    """fp64 attention with GQA by repeat; `allowed` (B, 1, T, T) bool."""
    groups = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1),
                                         attn_mask=allowed)
    return out, (qd, kd, vd)


def _cp_attention_one_rank(rank: int, world: int) -> dict:
    """Context parallel attention (all-gather) on a one-rank NCCL mesh, bf16 and fp16, GQA, with and without packed
    documents over 74 tokens (two zig-zag chunks of 37: a bias row not a multiple of 8; the documents leave rows
    fully masked inside a block): the output and dQ, dK, dV against an fp64 reference. On one rank the local
    order is the sequence's own (chunks 0 and 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ultrascale.parallel.context import ContextParallel

    mesh = init_device_mesh("cuda", (1,))
    errors = {}
    t = 74
    for dtype in (torch.bfloat16, torch.float16):
        for documents in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(2, heads, t, 32, device="cuda", dtype=dtype) for heads in (8, 2, 2))
            dout = torch.randn_like(q)
            positions = torch.arange(t, device="cuda").expand(2, t).clone()
            if documents:
                positions[0, 30:] -= 30
                positions[1, 41:] -= 41
            cp = ContextParallel(mesh, "allgather")
            local = cp.shard_batch({"input_ids": torch.zeros(2, t, dtype=torch.long, device="cuda"), "position_ids": positions})
            assert torch.equal(local["position_ids"], positions)
            lq, lk, lv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out = cp.attention(lq, lk, lv)
            out.backward(dout)
            starts = (positions == 0).cumsum(-1)
            allowed = (torch.ones(t, t, dtype=torch.bool, device="cuda").tril()[None]
                       & (starts[:, :, None] == starts[:, None, :]))[:, None]
            reference, (qd, kd, vd) = _reference_attention(q, k, v, allowed)
            reference.backward(dout.double())
            got = [out.detach(), lq.grad, lk.grad, lv.grad]
            want = [reference.detach(), qd.grad, kd.grad, vd.grad]
            errors[(str(dtype), documents)] = [float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want)]
    return errors


def test_context_parallel_backward_in_bf16_and_fp16_equals_attention():
    """The merged output handed to the efficient kernel's backward in the layout it assumes (it was (B, H, T, D)-
    contiguous: dQ and dK 50-75 % off in bf16/fp16), and a document bias whose rows are padded to the kernel's
    alignment (37 keys per block raised 'attn_bias is not correctly aligned')."""
    for (dtype, documents), errors in run_nccl("_cp_attention_one_rank", world=1)[0].items():
        for name, error in zip(("out", "dQ", "dK", "dV"), errors):
            assert error < 1e-2, f"{dtype}, documents={documents}: {name} is {error:.2e} off (relative norm)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_context_parallel_flash_blocks_merged_equal_attention(dtype, monkeypatch):
    """Ring blocks on CUDA's flash kernel as the ring computes them: the last 29 queries of 87 tokens against their
    own keys (square, causal) and against the 58 keys before them (no mask: query and key counts differ, odd), merged,
    then each block's backward with the merged output and log-sum-exp; grouped heads not repeated. Equal to fp64
    attention, and flash took every call."""
    from ultrascale.parallel import attention_kernels as kernels
    from ultrascale.parallel.context import _merge

    taken = []
    flash_forward, flash_backward = kernels._flash_forward, kernels._flash_backward
    monkeypatch.setattr(kernels, "_flash_forward", lambda *a: taken.append("forward") or flash_forward(*a))
    monkeypatch.setattr(kernels, "_flash_backward", lambda *a: taken.append("backward") or flash_backward(*a))
    forward, backward = kernels.attention_kernel(torch.device("cuda"))
    torch.manual_seed(0)
    t, own, scale = 87, 29, 32**-0.5
    q = torch.randn(2, 8, own, 32, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, t, 32, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    blocks = [(slice(t - own, t), True), (slice(0, t - own), False)]
    out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full(q.shape[:-1], float("-inf"), device="cuda")
    for keys, causal in blocks:
        block_out, block_lse = forward(q, k[:, :, keys], v[:, :, keys], causal, None, scale)
        _merge(out, lse, block_out, block_lse)
    out = out.to(dtype)
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for keys, causal in blocks:
        dq_block, dk_block, dv_block = backward(dout, q, k[:, :, keys], v[:, :, keys], out, lse, causal, None, scale)
        dq += dq_block
        dk[:, :, keys] += dk_block
        dv[:, :, keys] += dv_block
    assert taken == ["forward", "forward", "backward", "backward"]
    allowed = torch.arange(t, device="cuda")[None, :] <= torch.arange(t - own, t, device="cuda")[:, None]
    reference, (qd, kd, vd) = _reference_attention(q, k, v, allowed[None, None])
    reference.backward(dout.double())
    for name, got, want in (("out", out, reference), ("dQ", dq, qd.grad), ("dK", dk, kd.grad), ("dV", dv, vd.grad)):
        error = float((got.double() - want.detach()).norm() / want.detach().norm())
        assert error < 1e-2, f"{name} is {error:.2e} off (relative norm)"


@pytest.mark.parametrize("dtype, masked", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_grouped_query_attention_never_needs_the_math_kernel(dtype, masked):
    """GQA in fp32 or with a mask under `sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])`, which forbids the
    math fallback (O(H·T²) memory): the built-in Llama's attention (packed documents) and `grouped_sdpa`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ultrascale.models.llama import ScaledDotProductAttention
    from ultrascale.parallel.device import grouped_sdpa

    torch.manual_seed(0)
    q = torch.randn(1, 8, 128, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=dtype) for _ in range(2))
    mask = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()[None, None] if masked else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = ScaledDotProductAttention()(q, k, v, mask)
        direct = grouped_sdpa(q, k, v, attn_mask=mask, is_causal=mask is None)
    causal = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()[None, None]
    reference, _ = _reference_attention(q, k, v, causal)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert_close(out.double(), reference.detach(), **tol)
    assert_close(direct.double(), reference.detach(), **tol)


def _norm_without_gradients(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ultrascale.parallel.device import collective_device
    from ultrascale.parallel.grad import global_grad_norm
    from ultrascale.parallel.zero import ZeroEngine

    model = torch.nn.Linear(4, 4, device="cuda")
    model.weight.requires_grad_(False)
    model.bias.requires_grad_(False)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, device="cuda"))], lr=0.1)
    optimizer.param_groups[0]["params"] = []  # a stage whose optimizer holds nothing this rank trains
    mesh = init_device_mesh("cuda", (world,))
    engine = ZeroEngine(model, optimizer, stage=1, dp_mesh=mesh, norm_group=dist.group.WORLD)
    return {"device": str(collective_device()), "norm": global_grad_norm([], across=dist.group.WORLD).item(),
            "zero_norm": engine.grad_norm().item()}


def test_a_rank_without_gradients_takes_part_in_the_norm_over_nccl():
    """A pipeline stage with no gradient (frozen, or no parameters) still joins the norm's all-reduce: its
    made-up zero must be a CUDA tensor, which NCCL requires."""
    result = run_nccl("_norm_without_gradients", world=1)[0]
    assert result["device"].startswith("cuda")
    assert result["norm"] == 0.0 and result["zero_norm"] == 0.0


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
def test_power_sum_on_cuda_is_one_norm_kernel_as_exact_as_the_cpu_path(norm_type):
    """On CUDA `power_sum` is the GPU's own norm (a tree reduction): as exact for a long flat ZeRO bucket as the
    CPU path's pairwise sum, against float64."""
    from ultrascale.parallel.grad import power_sum

    values = torch.randn(1 << 23, generator=torch.Generator().manual_seed(0))
    exact = values.double().abs().pow(norm_type).sum()
    assert_close(power_sum(values.cuda(), norm_type).double().cpu(), exact, rtol=1e-6, atol=0)
    assert_close(power_sum(values.cuda().bfloat16(), norm_type).double().cpu(),
                 values.bfloat16().double().abs().pow(norm_type).sum(), rtol=1e-6, atol=0)
