"""MFUMonitor, MemoryMonitor and ProfilerCapture: exact FLOP counts, tokens counted once per dp group,
model-state bytes beside their formula, per-rank traces; and the YAML recipe that configures them."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import ultrascale  # noqa: F401
from tests._dist import run_ranks
from tests._parity import ParityData, TokenDataset
from ultrascale.callbacks import MemoryMonitor, MFUMonitor, ProfilerCapture
from ultrascale.callbacks.activation_checkpointing import apply_ac, make_policy
from ultrascale.callbacks.mfu import model_flops
from ultrascale.estimate import estimate_model_state_bytes, recompute_flops_per_token
from ultrascale.hardware import PEAK_TFLOPS, find_peak_tflops
from ultrascale.models.adapters import get_adapter
from ultrascale.models.lm import LlamaLM

SEQ, GLOBAL_BATCH, STEPS = 32, 8, 4


def trainer(world_size, callbacks, strategy="ultrascale_zero3", steps=STEPS, **kwargs):
    return L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs,
    )


def data(steps=STEPS):
    return ParityData(TokenDataset(steps * GLOBAL_BATCH, SEQ, 512, seed=1), GLOBAL_BATCH)


# --------------------------------------------------------------------------- FLOPs


def _counted_vs_formula(model, ac_mode=None, vocab=512, batch=2, seq=128):
    summary = apply_ac(model, get_adapter(model).blocks, make_policy(ac_mode)) if ac_mode else None
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    # The math SDPA backend is made of matmuls FlopCounterMode counts; it has no formula
    # for the fused CPU flash kernel and would count attention as 0 FLOPs.
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        out = model(tokens)
        (out.logits if hasattr(out, "logits") else out).float().sum().backward()
    flops = model_flops(model)
    formula = flops.per_token(seq)
    if summary is not None:
        formula += recompute_flops_per_token(summary.matmul_params, summary.attention_layers, flops.hidden, seq)
    return counter.get_total_flops(), formula * batch * seq


@pytest.mark.parametrize("ac_mode", [None, "full", "every_k", "selective", "attention"])
def test_llama_flops_match_flop_counter(ac_mode):
    model = LlamaLM(preset="tiny")
    model.configure_model()
    counted, formula = _counted_vs_formula(model, ac_mode)
    assert abs(counted - formula) / counted < 0.05, (counted, formula)


def test_hf_dense_and_moe_flops_match_flop_counter():
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    counted, formula = _counted_vs_formula(LlamaForCausalLM(LlamaConfig(**small)))
    assert abs(counted - formula) / counted < 0.05, (counted, formula)
    # "eager" experts: a per-expert loop of matmuls that FlopCounterMode sees (grouped_mm it does not).
    moe = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"))
    counted, formula = _counted_vs_formula(moe)
    assert abs(counted - formula) / counted < 0.05, (counted, formula)
    assert "2 of 4 experts active" in model_flops(moe).source


def test_peak_table_lookup():
    assert find_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == ("H100 SXM", 989.4)
    assert find_peak_tflops("NVIDIA H100 PCIe", "fp8") == ("H100 PCIe", 1513.0)
    assert find_peak_tflops("NVIDIA H200", "fp8") == ("H200", 1978.9)
    assert find_peak_tflops("NVIDIA L4", "fp8") == ("L4", 242.5)
    assert find_peak_tflops("AMD Instinct MI300X", "bf16") == ("MI300X", 1307.4)
    assert find_peak_tflops("NVIDIA B200", "fp8") == ("B200", 4500.0)
    assert find_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == ("A100", 312.0)
    assert find_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no fp8
    assert find_peak_tflops("NVIDIA L40S", "bf16") is None  # not an L4
    assert find_peak_tflops("NVIDIA H100 NVL", "bf16") is None  # lower clocks: not the SXM figure
    assert all(table["fp16"] == table["bf16"] for table in PEAK_TFLOPS.values())


def test_mfu_bad_knobs():
    with pytest.raises(ValueError, match=r"`window_size=0` must be an integer >= 1"):
        MFUMonitor(window_size=0)
    with pytest.raises(ValueError, match=r"unknown `peak_dtype='int8'`; valid: bf16, fp16, fp8, tf32, fp32"):
        MFUMonitor(peak_dtype="int8")
    with pytest.raises(ValueError, match=r"`peak_tflops=0` must be positive"):
        MFUMonitor(peak_tflops=0)


class _Unknown(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_mfu_unknown_model_needs_flops_per_token():
    loader = torch.utils.data.DataLoader(torch.randn(8, 2, 4), batch_size=2)
    with pytest.raises(ValueError, match=r"cannot derive FLOPs per token for _Unknown .* set `flops_per_token=`"):
        trainer(1, [MFUMonitor()], strategy="auto", logger=False).fit(_Unknown(), loader)
    monitor = MFUMonitor(flops_per_token=48.0, peak_tflops=1.0)  # 6 N for a 4x4 linear (N=16) + 0 attention
    run = trainer(1, [monitor], strategy="auto", logger=False)
    run.fit(_Unknown(), loader)
    metrics = run.callback_metrics
    assert monitor.tokens_seen == STEPS * 2 * 2  # batch (2, 2, 4): tokens are B x T = 4 per step
    assert metrics["throughput/tflops_per_device"].item() == pytest.approx(
        48.0 * metrics["throughput/tokens_per_sec_per_device"].item() / 1e12)


def test_mfu_above_one_is_reported_not_logged():
    loader = torch.utils.data.DataLoader(torch.randn(8, 2, 4), batch_size=2)
    monitor = MFUMonitor(flops_per_token=48.0, peak_tflops=1e-15)  # a peak far below what any step reaches
    run = trainer(1, [monitor], strategy="auto", logger=False)
    with pytest.warns(UserWarning, match=r"computes MFU .* > 1 .* MFU and HFU are not logged") as caught:
        run.fit(_Unknown(), loader)
    assert sum("> 1" in str(w.message) for w in caught) == 1  # once, not every step
    assert "throughput/mfu" not in run.callback_metrics and "throughput/tokens_per_sec" in run.callback_metrics
    assert monitor.impossible_mfu_steps == STEPS


def test_cpu_peak_without_fast_bf16_falls_back_to_fp32(monkeypatch):
    from ultrascale.callbacks import mfu as mfu_module

    speeds = {torch.bfloat16: 0.001, torch.float32: 0.05}  # the emulated-bf16 CPU of the report
    monkeypatch.setattr(mfu_module, "measure_matmul_tflops", lambda dtype, device, **kw: speeds[dtype])
    monitor = MFUMonitor(flops_per_token=48.0)
    run = trainer(1, [monitor], strategy="auto", logger=False, precision="bf16-mixed")
    with pytest.warns(UserWarning, match="no fast bf16 path; MFU is relative to the fp32 peak"):
        monitor._resolve_peak(run)
    assert monitor.peak == 0.05 and "fp32" in monitor.peak_source
    speeds[torch.bfloat16] = 0.1  # a CPU with bf16 instructions keeps its bf16 peak
    monitor._resolve_peak(run)
    assert monitor.peak == 0.1 and "bf16" in monitor.peak_source


# --------------------------------------------------------------------------- tokens once per dp group


def test_mfu_on_cuda_synchronises_only_at_logged_optimizer_steps(monkeypatch):
    """A CUDA `synchronize` stalls the host: the monitor waits for the GPU only at the optimizer steps Lightning
    writes to its loggers, and then reports the tokens of every batch since the last one over their time."""
    from types import SimpleNamespace

    syncs, logged = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    fake = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), world_size=1, global_step=0,
                           log_every_n_steps=2, should_stop=False, max_steps=-1)
    module = SimpleNamespace(log=lambda name, value, **kw: logged.append((fake.global_step, name, value)))
    monitor = MFUMonitor(mfu=False, window_size=1)
    monitor.on_train_epoch_start(fake, module)
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}  # 16 tokens a batch
    for step in range(1, 5):  # 4 optimizer steps of 2 micro-batches; Lightning logs steps 2 and 4
        for micro in range(2):
            monitor.on_train_batch_start(fake, module, batch, 0)
            time.sleep(0.01)
            if micro == 1:
                fake.global_step = step
            monitor.on_train_batch_end(fake, module, None, batch, 0)
    assert len(syncs) == 2
    rates = [value for at, name, value in logged if name == "throughput/tokens_per_sec"]
    assert [at for at, name, _ in logged if name == "throughput/tokens_per_sec"] == [2, 4]
    assert all(16 * 4 / 0.04 * 0.5 < rate <= 16 * 4 / 0.04 for rate in rates), rates  # 4 batches of 16 tokens, >= 40 ms
    assert monitor.tokens_seen == 8 * 16


def test_mfu_on_cuda_measures_the_last_step_of_a_run_shorter_than_its_logging_interval(monkeypatch):
    """A run of `max_steps` below `log_every_n_steps` (each of `ultrascale tune`'s candidates) never reaches a
    logged step: its last optimizer step is measured, over every batch of the run."""
    from types import SimpleNamespace

    syncs, logged = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    fake = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), world_size=1, global_step=0,
                           log_every_n_steps=50, should_stop=False, max_steps=3)
    module = SimpleNamespace(log=lambda name, value, **kw: logged.append((fake.global_step, name, value)))
    monitor = MFUMonitor(mfu=False, window_size=1)
    monitor.on_train_epoch_start(fake, module)
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    for step in range(1, 4):
        monitor.on_train_batch_start(fake, module, batch, 0)
        time.sleep(0.01)
        fake.global_step = step
        monitor.on_train_batch_end(fake, module, None, batch, 0)
    assert len(syncs) == 1
    assert [at for at, name, _ in logged if name == "throughput/tokens_per_sec"] == [3]
    rate = next(value for _, name, value in logged if name == "throughput/tokens_per_sec")
    assert 16 * 3 / 0.03 * 0.5 < rate <= 16 * 3 / 0.03, rate  # 3 batches of 16 tokens, >= 30 ms


class _BatchEnds(L.Callback):
    def __init__(self):
        self.ends: list[float] = []

    def on_train_epoch_start(self, *args):
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.ends.append(time.perf_counter())


def _mfu_2x2(rank, world_size):
    monitor, ends = MFUMonitor(window_size=STEPS), _BatchEnds()
    run = trainer(world_size, [monitor, ends], strategy=ultrascale.TensorParallelStrategy(tensor_parallel=2), logger=False)
    model = LlamaLM(preset="tiny", max_steps=100)
    run.fit(model, data())
    metrics = {k: v.item() for k, v in run.callback_metrics.items() if "/" in k}
    return {
        "metrics": metrics, "tokens_seen": monitor.tokens_seen, "peak": monitor.peak, "source": monitor.peak_source,
        "dims": (run.strategy.parallel_dims.dp, run.strategy.parallel_dims.tp), "seconds": ends.ends[-1] - ends.start,
        "flops_per_token": model.flops_per_token(SEQ),
    }


def test_mfu_counts_each_token_once_under_dp2_tp2():
    results = run_ranks(_mfu_2x2, 4)
    assert results[0]["dims"] == (2, 2)
    for r in results:
        # 4 steps x global batch 8 x 32 tokens, not x4 (the world) nor x2 (tp).
        assert r["tokens_seen"] == STEPS * GLOBAL_BATCH * SEQ
        m = r["metrics"]
        assert m["throughput/tokens_seen"] == STEPS * GLOBAL_BATCH * SEQ
        assert m["throughput/tokens_per_sec"] == pytest.approx(4 * m["throughput/tokens_per_sec_per_device"])
        # The window spans the whole epoch: tokens/s = all tokens / the epoch's time, timed independently here.
        independent = STEPS * GLOBAL_BATCH * SEQ / r["seconds"]
        assert m["throughput/tokens_per_sec"] == pytest.approx(independent, rel=0.1)
        assert m["throughput/tflops_per_device"] == pytest.approx(
            r["flops_per_token"] * m["throughput/tokens_per_sec_per_device"] / 1e12, rel=1e-6
        )
        assert m["throughput/mfu"] == pytest.approx(m["throughput/tflops_per_device"] / r["peak"], rel=1e-6)
        assert m["throughput/hfu"] == pytest.approx(m["throughput/mfu"], rel=1e-6)  # no recomputation
        assert m["time/step"] > 0 and m["time/data"] >= 0
        assert r["peak"] > 0 and "measured fp32 1024^3 matmul" in r["source"]


def _hfu_with_full_ac(rank, world_size):
    from ultrascale.callbacks import ActivationCheckpointing

    monitor = MFUMonitor()
    run = trainer(world_size, [ActivationCheckpointing(mode="full"), monitor], logger=False)
    model = LlamaLM(preset="tiny", max_steps=100)
    run.fit(model, data())
    block_params = sum(p.numel() for layer in model.model.layers for p in layer.parameters() if p.dim() == 2)
    return {k: v.item() for k, v in run.callback_metrics.items()}, model.flops_per_token(SEQ), block_params


def test_hfu_adds_the_recomputed_forward_under_full_ac():
    metrics, model_fpt, block_params = run_ranks(_hfu_with_full_ac, 2)[0]
    config = LlamaLM(preset="tiny").config
    # Full AC re-runs every block's forward: 2 x block matmul params + 4 L h s per token.
    recompute = 2 * block_params + 4 * config.n_layers * config.dim * SEQ
    assert metrics["throughput/hfu"] / metrics["throughput/mfu"] == pytest.approx(1 + recompute / model_fpt, rel=1e-6)


# --------------------------------------------------------------------------- memory


def _memory(rank, world_size, strategy):
    monitor = MemoryMonitor()
    run = trainer(world_size, [monitor], strategy=strategy, logger=False)
    model = LlamaLM(preset="tiny", max_steps=100)
    run.fit(model, data())
    return {k: v.item() for k, v in run.callback_metrics.items() if k.startswith("memory/")}, model.num_params()


@pytest.mark.parametrize("strategy", ["ultrascale_zero3", "ultrascale_zero2"])
def test_memory_monitor_measures_beside_the_formula(strategy):
    results = run_ranks(_memory, 2, strategy)
    for metrics, psi in results:
        stage = 3 if strategy.endswith("3") else 2
        expected = estimate_model_state_bytes(psi, zero_stage=stage, shard_degree=2).total / 2**30
        assert metrics["memory/model_state_estimate_gib"] == pytest.approx(expected)
        # fp32 Adam: (4 + 4 + 8) Psi / 2 under ZeRO-3; (4 + 4/2 + 8/2) Psi under ZeRO-2; measured on live tensors.
        assert metrics["memory/model_state_gib"] == pytest.approx(expected, rel=0.02)
        assert 0.05 < metrics["memory/rss_gib"] < 8


def test_memory_snapshot_needs_cuda():
    with pytest.raises(ValueError, match=r"MemoryMonitor: `snapshot_at_step=0` must be an integer >= 1"):
        MemoryMonitor(snapshot_at_step=0)
    loader = torch.utils.data.DataLoader(torch.randn(8, 2, 4), batch_size=2)
    with pytest.raises(ValueError, match=r"memory snapshots record the CUDA caching allocator, and this run is on cpu"):
        trainer(1, [MemoryMonitor(snapshot_at_step=2)], strategy="auto", logger=False).fit(_Unknown(), loader)


# --------------------------------------------------------------------------- profiler


def test_profiler_bad_schedule():
    with pytest.raises(ValueError, match=r"ProfilerCapture: `active=0` must be an integer >= 1"):
        ProfilerCapture(active=0)
    with pytest.raises(ValueError, match=r"`wait=-1` must be an integer >= 0"):
        ProfilerCapture(wait=-1)


def _profile(rank, world_size, root):
    capture = ProfilerCapture(wait=1, warmup=1, active=2, record_shapes=True, profile_memory=True)
    logger = L.pytorch.loggers.TensorBoardLogger(root, name="run")
    run = trainer(world_size, [capture], logger=logger, steps=5)
    run.fit(LlamaLM(preset="tiny", max_steps=100), data(steps=5))
    return capture.traces_dir, len(capture.summaries), capture.summaries[0]


def test_profiler_writes_a_trace_per_rank(tmp_path):
    results = run_ranks(_profile, 2, str(tmp_path))
    directory = Path(results[0][0])
    assert directory == tmp_path / "run" / "version_0" / "profiler"
    for rank in range(2):
        traces = list(directory.glob(f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, list(directory.iterdir())
        trace = json.loads(traces[0].read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert "aten::mm" in names and "ProfilerStep#3" in names  # the active steps (0-based 2 and 3)
        assert (directory / f"rank{rank}_summary_1.txt").read_text() == results[rank][2]
    assert all(count == 1 for _, count, _ in results)
    assert "Self CPU time total" in results[0][2] and "aten::" in results[0][2]


# --------------------------------------------------------------------------- LightningCLI


def test_callbacks_recipe_configures_every_callback(tmp_path):
    from ultrascale.callbacks import ActivationCheckpointing, Float8Training
    from ultrascale.cli import UltraScaleCLI

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu_callbacks.yaml"
    cli = UltraScaleCLI(args=["--config", str(recipe), "--trainer.default_root_dir", str(tmp_path)], run=False)
    by_type = {type(cb): cb for cb in cli.trainer.callbacks}
    assert by_type[ActivationCheckpointing].mode == "selective"
    assert by_type[MFUMonitor].window_size == 20
    assert by_type[ProfilerCapture].active == 3
    assert MemoryMonitor in by_type
    assert Float8Training not in by_type  # FP8 is shown commented out: the tiny model's dims are too small to gain


# --------------------------------------------------------------------------- progress bar


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_step_progress_bar_counts_optimizer_steps_across_epochs_and_resumes(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from ultrascale.callbacks import StepProgressBar

    def run(max_steps, ckpt_path=None):
        seen = []

        class Watch(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                seen.append((trainer.progress_bar_callback.train_progress_bar.n, trainer.global_step))

        bar = StepProgressBar()
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, callbacks=[bar, Watch()], logger=CSVLogger(tmp_path),
                            default_root_dir=tmp_path, enable_model_summary=False)
        trainer.fit(_Tiny(), ckpt_path=ckpt_path)
        return trainer, bar.train_progress_bar, seen

    # 3 batches per epoch, 7 steps: Lightning's bar would restart at every epoch and say "Epoch 2".
    trainer, bar, seen = run(7)
    assert (bar.n, bar.total, bar.desc.strip(": ")) == (7, 7, "Training")
    assert [n for n, _ in seen] == [step for _, step in seen] == list(range(1, 8))
    assert "v_num" not in bar.postfix and "train_loss=" in bar.postfix
    checkpoint = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    # Resumed at step 7 towards 10: the bar continues from 7 (not 0/3, nor "7/1").
    _, bar, seen = run(10, ckpt_path=checkpoint)
    assert seen[0] == (8, 8) and (bar.n, bar.total) == (10, 10)


GPU_NAMES = {"H100 SXM": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200", "A100": "NVIDIA A100-SXM4-80GB", "B200": "NVIDIA B200",
             "H100 PCIe": "NVIDIA H100 PCIe", "L4": "NVIDIA L4", "MI300X": "AMD Instinct MI300X"}


@contextlib.contextmanager
def fp32_matmul_precision(matmul: str, everywhere: str = "ieee"):
    """torch's TF32 settings (`fp32_precision`, the API torch 2.13 reads without raising) set, and put back after."""
    before = torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = everywhere, matmul
    try:
        yield
    finally:
        torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before


@pytest.mark.parametrize("precision, matmul, everywhere, dtype", [
    ("bf16-mixed", "ieee", "ieee", "bf16"), ("16-mixed", "ieee", "ieee", "fp16"), ("32-true", "tf32", "ieee", "tf32"),
    ("32-true", "none", "tf32", "tf32"), ("32-true", "ieee", "ieee", "fp32"), ("32-true", "none", "ieee", "fp32"),
], ids=["bf16", "fp16", "tf32-matmul", "tf32-inherited", "fp32", "fp32-inherited"])
def test_every_gpu_kind_has_a_peak_for_every_precision(monkeypatch, precision, matmul, everywhere, dtype):
    """`32-true` on CUDA without TF32 (torch's default) asks for the fp32 column: every device of the table has one,
    and a device the table does not know (H800, L40S, the NVL parts) gives tokens/s under the CLI's `mfu=None`
    and a clear error under `mfu=True`. TF32 is read from torch's `fp32_precision` (the matmul's, or where it says
    "none" the global one): torch 2.13 raises on a read of the legacy `allow_tf32` once they are set."""
    with fp32_matmul_precision(matmul, everywhere):
        _every_gpu_kind_has_a_peak(monkeypatch, precision, dtype)


def _every_gpu_kind_has_a_peak(monkeypatch, precision, dtype):
    from types import SimpleNamespace

    from ultrascale.hardware import GPU_TABLE

    assert set(GPU_NAMES) == set(GPU_TABLE)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), precision=precision, callbacks=[])
    for key, name in GPU_NAMES.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_, name=name: name)
        monitor = MFUMonitor()
        monitor._resolve_peak(trainer)
        assert monitor.peak == GPU_TABLE[key].peaks[dtype] and monitor.peak_source == f"table: {key} {dtype} dense"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H800")
    quiet = MFUMonitor(mfu=None)
    quiet._resolve_peak(trainer)
    assert quiet.peak is None and not quiet._mfu_active
    with pytest.raises(ValueError, match=rf"no {dtype} peak for device 'NVIDIA H800'.*set `peak_tflops=`"):
        MFUMonitor()._resolve_peak(trainer)


# --------------------------------------------------------------------------- what tokens/s counts

def _padded_blocks():
    """8 unpacked rows of seq_len 16 with 3..14 real positions and a prompt of 2: known padding and targets."""
    import numpy as np

    from ultrascale.data.instruct import InstructionBlockDataset, pack_examples

    lengths = [3, 14, 5, 9, 12, 4, 7, 10]  # inputs per example
    packed = pack_examples([(np.arange(1, n + 2), 2) for n in lengths], seq_len=16, pad_id=0, pack=False)
    dataset = InstructionBlockDataset(packed.input_ids, packed.labels, packed.position_ids)
    return dataset, sum(lengths), int((packed.labels != -100).sum())


def _throughput(rank, world_size, strategy_kwargs):
    from tests._parity import Recorder, parity_trainer
    from tests.test_pipeline_parallel import make_llama

    dataset, _, _ = _padded_blocks()
    recorder = Recorder()
    strategy = ultrascale.UltraScaleStrategy(**strategy_kwargs) if strategy_kwargs is not None else "auto"
    trainer = parity_trainer(world_size, strategy, recorder, 1, callbacks=[MFUMonitor(mfu=False)])
    trainer.fit(make_llama(n_layers=2), ParityData(dataset, 8))
    return recorder.logger.steps


@pytest.mark.parametrize("layout", [None, {"data_parallel_shard": 2}, {"context_parallel": 2, "data_parallel_shard": 1}],
                         ids=["one device", "ZeRO-3 dp2", "CP 2"])
def test_tokens_per_sec_counts_no_padding(layout) -> None:
    """A global batch of 128 positions, 64 of them real and 56 targets: the logged padding fraction is 1/2 and
    target tokens / tokens 56/64, on one device, over dp 2 (each rank half the rows) and under cp 2 (each rank half
    of every row: counted before the cut)."""
    _, content, targets = _padded_blocks()
    assert (content, targets) == (64, 56)
    (steps, *_) = run_ranks(_throughput, 1 if layout is None else 2, layout)
    metrics = steps[min(steps)]
    assert metrics["throughput/padding_fraction"] == pytest.approx(1 - content / 128)
    assert metrics["throughput/target_tokens_per_sec"] / metrics["throughput/tokens_per_sec"] == pytest.approx(targets / content)
    assert metrics["throughput/tokens_seen"] == content


def test_batch_token_counts_of_packed_and_padded_rows() -> None:
    """Row 0: documents of 3 and 5 positions, then 8 of padding; row 1: one document of 16, no padding. Content 24,
    targets as labelled, and the attention spans 3^2 + 5^2 + 16^2 (MFU's attention term per document)."""
    from ultrascale.parallel.loss import batch_token_counts

    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7], list(range(16))])
    labels = torch.full((2, 16), -100)
    labels[0, 1:3], labels[0, 4:8], labels[1, 5:] = 1, 1, 1
    counts = batch_token_counts({"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": labels,
                                 "position_ids": positions})
    assert counts.tolist() == [32, 24, 2 + 4 + 11, 9 + 25 + 256]
    assert batch_token_counts({"input_ids": torch.zeros(2, 16, dtype=torch.long)}).tolist() == [32, 32, 32, 2 * 256]
    masked = batch_token_counts({"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    assert masked.tolist()[:3] == [4, 3, 3]
