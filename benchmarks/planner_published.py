"""Published training-run measurements to compare the layout planner's predictions against.

This file is data only: the list ``PUBLISHED_RUNS`` holds runs (model, GPUs, layout, batch,
recomputation, precision) and the throughput and memory their authors reported. Each figure is
copied from the cited source, which was read from a stored copy of a public repository; the comment
above each entry quotes the table row or sentence it comes from. No figure was measured or estimated
here. A field the source does not state is ``None``; anything that is context rather than a
stated value (a config file's default, an implied data-parallel degree) is only in ``notes``.

Fields of a run:

- ``source``: short citation; ``url``: the repository path (at the stored commit) it was read from.
- ``model``: ``"llama3_8b"``, ``"llama3_70b"`` or ``"llama3_405b"`` (the ``ultrascale.models.llama``
  presets; Llama 3.1 has the same shapes), or a dict of the architecture (``n_layers``, ``hidden``,
  ``heads``, ``kv_heads``, ``ffn_hidden``, ``vocab``, ``style``) taken from the named config.
- ``gpu``, ``gpus``, ``gpus_per_node``.
- ``layout``: only the degrees the source states, using the planner's names (``pp``, ``dp``,
  ``dp_shard``, ``dp_replicate``, ``tp``, ``cp``, ``ep``, ``zero_stage``, ``virtual_stages``,
  ``schedule``). torchtitan's "FSDP n" and llm-foundry's ``FULL_SHARD`` are ``dp_shard`` (ZeRO-3);
  NeMo / Megatron-Bridge tables state TP, PP, CP, VP (and FSDP 0/1) but not DP, so DP is left out of
  the layout and the implied value gpus / (tp * pp * cp) is written in ``notes``.
- ``seq_len``, ``micro_batch`` (sequences per rank per forward), ``global_batch`` (sequences) or
  ``global_batch_tokens``.
- ``recompute``: ``"none"``, ``"selective"``, ``"full"`` or ``None``; ``precision``: ``"bf16"`` or
  ``"fp8"`` (fp8 = FP8 GEMMs for the linear layers, the rest in bf16).
- Measured: ``tokens_per_s_per_gpu``, ``mfu`` (a fraction), ``tflops_per_gpu`` (model TFLOP/s per GPU
  as the source defines it), ``memory_gib`` (peak per GPU).
- ``pipeline_layers``: an uneven layer split the source states (text), else None or absent.
- ``flops_include_recompute``: whether the source's TFLOP/s or MFU counts the recomputed forward
  (hardware FLOPs, Narayanan et al. 2021) or model FLOPs only; None or absent where unknown.
- ``flops_per_sequence``: the model FLOPs per sequence the source's MFU divides by, where it states it.
- ``recompute_assumed``: (mode, reason) where the source says recomputation is used without its mode.
- ``notes``: compile, async TP, software versions, hardware caveats.

Caveats worth keeping in mind when comparing:

- torchtitan's H100 runs are on Grand Teton H100s with 96 GB HBM2e at a 500 W power limit, slower than
  a 700 W SXM H100 (the source says so); their memory figure is the maximum over all ranks.
- NeMo / Megatron-Bridge "Model TFLOP / sec / GPU" and llm-foundry's MFU use each project's own FLOP
  count (llm-foundry's formula is in its README: 6N + attention per token, no recompute).
"""

from __future__ import annotations

# Source files, at the commit each was read at.
_TT_H100 = (
    "https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/"
    "benchmarks/llama3_h100_202412_torchtitan.md"
)
_TT_A100 = "https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md"
_TT_H200 = (
    "https://github.com/pytorch/torchtitan/blob/bcdeaa37c92d1eaceeec3351e7ac81be6a1488af/"
    "benchmarks/llama3_8b_h200_2025-06_torchtitan.md"
)
_NEMO_2407 = (
    "https://github.com/NVIDIA/NeMo/blob/070a0bb168d405d653b9734c0017cf5078e77c0d/"
    "docs/source/performance/performance_summary.md"
)
_MBRIDGE_2511 = (
    "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/00b7660be0254ac6f95f44164ddd0c3e9cc798ed/"
    "docs/performance-summary.md"
)
_FOUNDRY = (
    "https://github.com/mosaicml/llm-foundry/blob/061f2c7ce64e655100286584a7629e2a09f827ba/"
    "scripts/train/benchmarking/README.md"
)

_TT_H100_HW = (
    "Grand Teton: 8 H100 per host with NVLink, each H100 96GB HBM2e, 400 Gb/s RDMA per GPU, "
    "default 500W power limit (not 700W TDP). TPS read at the 90th iteration; memory is the max "
    "over all GPUs. torch 1963fc8 / torchao eab345c (2024-12-23), torchtitan 9dec370 (2024-12-26)."
)
_TT_SEQ_NOTE = "Sequence length not stated in this table; torchtitan's llama3 train_configs presets set seq_len = 8192."
_TT_MFU_NOTE = (
    "Source: 'the 1D Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8 achieves "
    "33% to 39% MFU (with or without torch.compile, respectively)', computed against SXM peak; "
    "no per-row MFU, so mfu is None."
)
_NEMO_2407_HW = "System: DGX-H100; container NeMo24.07; table is 'pre-training performance ... at FP8 precision'."
_MBRIDGE_HW = "System: DGX-H100; 25.11 NeMo Container; Megatron-Bridge performance recipes."

# MPT architectures (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): GPT-style blocks with a
# 4*d_model GELU MLP (expansion_ratio: 4) and multi-head attention (kv_heads = heads), vocab 50368.
# n_params is the README table's NumParams column for the quoted row.
_MPT_70B = {
    "n_layers": 80,
    "hidden": 8192,
    "heads": 64,
    "kv_heads": 64,
    "ffn_hidden": 4 * 8192,
    "vocab": 50368,
    "style": "GPT-style (MPT: 4h GELU MLP, MHA)",
    "n_params": 64862437376,
    "config": "mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-70b.yaml @17e6d63 "
    "(d_model 8192, n_heads 64, n_layers 80, expansion_ratio 4, vocab_size 50368)",
}
_MPT_13B = {
    "n_layers": 40,
    "hidden": 5120,
    "heads": 40,
    "kv_heads": 40,
    "ffn_hidden": 4 * 5120,
    "vocab": 50368,
    "style": "GPT-style (MPT: 4h GELU MLP, MHA)",
    "n_params": 12853954560,
    "config": "mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-13b.yaml @309f683 "
    "(d_model 5120, n_heads 40, n_layers 40, expansion_ratio 4, vocab_size 50368)",
}
_MPT_7B = {
    "n_layers": 32,
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 32,
    "ffn_hidden": 4 * 4096,
    "vocab": 50368,
    "style": "GPT-style (MPT: 4h GELU MLP, MHA)",
    "n_params": 6684024832,
    "config": "mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-7b.yaml @15fb4ff "
    "(d_model 4096, n_heads 32, n_layers 32, expansion_ratio 4, vocab_size 50368)",
}
# NeMo GPTConfig175B (NVIDIA/NeMo nemo/collections/llm/gpt/model/base.py): seq_length 2048, num_layers 96,
# hidden_size 12288, ffn_hidden_size 49152, num_attention_heads 96; learned absolute positions; vocab comes
# from the tokenizer and is not in the config.
_GPT3_175B = {
    "n_layers": 96,
    "hidden": 12288,
    "heads": 96,
    "kv_heads": 96,
    "ffn_hidden": 49152,
    "vocab": None,
    "style": "GPT-style (4h GELU MLP, MHA)",
    "config": "NVIDIA/NeMo nemo/collections/llm/gpt/model/base.py GPTConfig175B (NeMo 2.0 config; "
    "the 24.07 table does not restate the architecture). kv_heads=96: the config sets no "
    "num_query_groups, i.e. MHA.",
}


PUBLISHED_RUNS = [
    # ----------------------------------------------------------------------------------------------
    # torchtitan, Llama 3.1 on H100 (end of 2024)
    # ----------------------------------------------------------------------------------------------
    # "Table 1 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16.
    #  Selective activation checkpointing." row "| FSDP | 5,762 | 82.4 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 1",
        "url": _TT_H100,
        "model": "llama3_8b",
        "gpu": "H100",
        "gpus": 8,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 8},
        "seq_len": None,
        "micro_batch": 2,
        "global_batch": 16,
        "global_batch_tokens": None,
        "recompute": "selective",
        "precision": "bf16",
        "tokens_per_s_per_gpu": 5762,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 82.4,
        "notes": "FSDP2, no torch.compile. micro_batch = torchtitan 'local batch size'. "
        + _TT_SEQ_NOTE
        + " "
        + _TT_MFU_NOTE
        + " "
        + _TT_H100_HW,
    },
    # Table 1 (as above) row "| FSDP + torch.compile + Float8 | 8,532 | 76.8 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 1",
        "url": _TT_H100,
        "model": "llama3_8b",
        "gpu": "H100",
        "gpus": 8,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 8},
        "seq_len": None,
        "micro_batch": 2,
        "global_batch": 16,
        "global_batch_tokens": None,
        "recompute": "selective",
        "precision": "fp8",
        "tokens_per_s_per_gpu": 8532,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 76.8,
        "notes": "FSDP2 + torch.compile + Float8 (torchao, on nn.Linear). " + _TT_SEQ_NOTE + " " + _TT_H100_HW,
    },
    # "Table 3 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, global batch size 256.
    #  Selective activation checkpointing." row "| FSDP + torch.compile | 6,514 | 62.0 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 3",
        "url": _TT_H100,
        "model": "llama3_8b",
        "gpu": "H100",
        "gpus": 128,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 128},
        "seq_len": None,
        "micro_batch": 2,
        "global_batch": 256,
        "global_batch_tokens": None,
        "recompute": "selective",
        "precision": "bf16",
        "tokens_per_s_per_gpu": 6514,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 62.0,
        "notes": "FSDP2 + torch.compile (bf16). Same table: plain FSDP 5,605 TPS / 67.0 GiB; +Float8 8,380 / 61.8. "
        + _TT_SEQ_NOTE
        + " "
        + _TT_MFU_NOTE
        + " "
        + _TT_H100_HW,
    },
    # "Table 2 FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch size 1. Full
    #  activation checkpointing." row "| FSDP 4, CP 2 | 65536 | 2,540 | 84.2 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 2",
        "url": _TT_H100,
        "model": "llama3_8b",
        "gpu": "H100",
        "gpus": 8,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 4, "cp": 2},
        "seq_len": 65536,
        "micro_batch": 1,
        "global_batch": None,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "fp8",
        "tokens_per_s_per_gpu": 2540,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 84.2,
        "notes": "FSDP2 + context parallel + torch.compile + Float8. Same table: FSDP 8 CP 1 @32768 3,890 TPS / "
        "83.9 GiB; FSDP 2 CP 4 @131072 1,071 / 84.0; FSDP 1 CP 8 @262144 548 / 84.5. " + _TT_H100_HW,
    },
    # "Table 4 2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs (FSDP 32,
    #  TP 8). Local batch size 16, global batch size 512. Full activation checkpointing." row "| 2D | 829 | 71.9 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 4",
        "url": _TT_H100,
        "model": "llama3_70b",
        "gpu": "H100",
        "gpus": 256,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 32, "tp": 8},
        "seq_len": None,
        "micro_batch": 16,
        "global_batch": 512,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "fp8",
        "tokens_per_s_per_gpu": 829,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 71.9,
        "notes": "FSDP2 + TP + torch.compile + Float8, vanilla TP. Same table '2D + AsyncTP': 876 TPS / 67.6 GiB. "
        + _TT_SEQ_NOTE
        + " "
        + _TT_H100_HW,
    },
    # "Table 5 3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP. Llama 3.1 405B model.
    #  512 GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global batch size 256. Full activation
    #  checkpointing." row "| 1F1B | 100 | 82.5 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 5",
        "url": _TT_H100,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 8, "tp": 8, "pp": 8, "schedule": "1F1B"},
        "seq_len": None,
        "micro_batch": None,
        "global_batch": 256,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "fp8",
        "tokens_per_s_per_gpu": 100,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 82.5,
        "notes": "FSDP2 + async TP + PP + torch.compile + Float8. Local batch size 32 per DP rank; the number of "
        "pipeline micro-batches it is split into is not stated. Memory: 'Different PP ranks can have "
        "different peak memory usages. We take the maximum across all GPUs.' " + _TT_SEQ_NOTE + " " + _TT_H100_HW,
    },
    # Table 5 (as above) row "| Interleaved 1F1B | 128 | 72.7 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 5",
        "url": _TT_H100,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 8, "tp": 8, "pp": 8, "schedule": "Interleaved1F1B"},
        "seq_len": None,
        "micro_batch": None,
        "global_batch": 256,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "fp8",
        "tokens_per_s_per_gpu": 128,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 72.7,
        "notes": "As the 1F1B row but with the interleaved schedule; stages per rank (virtual_stages) not stated. "
        "Local batch size 32 per DP rank; micro-batch count not stated. " + _TT_SEQ_NOTE + " " + _TT_H100_HW,
    },
    # "Table 6 4D parallelism (FSDP + TP + PP + CP) + torch.compile + Float8 + AsyncTP + 1F1B. Llama 3.1 405B
    #  model. 512 GPUs (TP 8, PP8). Local batch size 8. Full activation checkpointing."
    #  row "| FSDP 4, CP 2 | 65536 | 47 | 75.9 |"
    {
        "source": "torchtitan H100 benchmarks (2024-12), Table 6",
        "url": _TT_H100,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 4, "cp": 2, "tp": 8, "pp": 8, "schedule": "1F1B"},
        "seq_len": 65536,
        "micro_batch": None,
        "global_batch": None,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "fp8",
        "tokens_per_s_per_gpu": 47,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 75.9,
        "notes": "FSDP2 + CP + async TP + PP (1F1B) + torch.compile + Float8. Local batch size 8; micro-batch count "
        "not stated. Same table: FSDP 8 CP 1 @32768 76 TPS / 75.3 GiB; FSDP 2 CP 4 @131072 31 / 77.1; "
        "FSDP 1 CP 8 @262144 16 / 84.9. " + _TT_H100_HW,
    },
    # ----------------------------------------------------------------------------------------------
    # torchtitan, Llama 3 on 64 A100 80GB (earlier docs/performance.md)
    # ----------------------------------------------------------------------------------------------
    # "results which torchtitan achieves on Llama 3 models with FSDP2 on 64 A100 (80GB) GPUs"
    #  row "| 8B | 1 | selective op | 2973 | 58.2% |"; "We use local batch size 1 (global batch size = local
    #  batch size 1 * number of FSDP ranks 64 = 64)"
    {
        "source": "torchtitan docs/performance.md (A100 version), Llama 3 table",
        "url": _TT_A100,
        "model": "llama3_8b",
        "gpu": "A100",
        "gpus": 64,
        "gpus_per_node": None,
        "layout": {"dp_shard": 64},
        "seq_len": None,
        "micro_batch": 1,
        "global_batch": 64,
        "global_batch_tokens": None,
        "recompute": "selective",
        "precision": None,
        "tokens_per_s_per_gpu": 2973,
        "mfu": 0.582,
        "tflops_per_gpu": None,
        "memory_gib": None,
        "notes": "FSDP2 (1D), selective per-op AC. 'WPS (word per second, or more accurately, token per second)'; "
        "the row's 'selective layer' AC variant: 2904 WPS, 56.8% MFU. Sequence length not stated; "
        "llama3_8b.toml ('a preset for 64 A100 GPUs') sets seq_len = 8192. Precision not stated; "
        "presumably torchtitan's default bf16 mixed precision (no Float8 in the preset).",
    },
    # same table, row "| 70B | 1 | full | 331 | 51.7% |"
    {
        "source": "torchtitan docs/performance.md (A100 version), Llama 3 table",
        "url": _TT_A100,
        "model": "llama3_70b",
        "gpu": "A100",
        "gpus": 64,
        "gpus_per_node": None,
        "layout": {"dp_shard": 64},
        "seq_len": None,
        "micro_batch": 1,
        "global_batch": 64,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": None,
        "tokens_per_s_per_gpu": 331,
        "mfu": 0.517,
        "tflops_per_gpu": None,
        "memory_gib": None,
        "notes": "FSDP2 (1D), full AC. Sequence length not stated; llama3_70b.toml sets seq_len = 8192. "
        "Precision not stated; presumably torchtitan's default bf16 mixed precision.",
    },
    # ----------------------------------------------------------------------------------------------
    # torchtitan benchmark contributed by Trainy, Llama 3.1 8B on H200 (June 2025)
    # ----------------------------------------------------------------------------------------------
    # "Runs were invoked with the following, where NUM_NODES was 4 and 8" (--nproc_per_node 8,
    #  --training.local_batch_size=2 --training.compile --model.converters="float8" ...)
    #  row "| 4 | 10938 | 47.96 |"
    {
        "source": "torchtitan benchmarks, Llama 3.1 8B on H200 by Trainy (2025-06)",
        "url": _TT_H200,
        "model": "llama3_8b",
        "gpu": "H200",
        "gpus": 32,
        "gpus_per_node": 8,
        "layout": {"dp_shard": 32},
        "seq_len": None,
        "micro_batch": 2,
        "global_batch": None,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 10938,
        "mfu": None,
        "tflops_per_gpu": None,
        "memory_gib": 47.96,
        "notes": "torch.compile + Float8 with enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp, "
        "force_recompute_fp8_weight_in_bwd. The command passes llama3_8b.toml and sets no parallel degree: "
        "dp_shard=32 is that toml's default (data_parallel_shard_degree = -1, all ranks), as are seq_len "
        "(8192) and AC (selective) in the versions read -- none restated in the doc. 8 nodes: 10753 TPS / "
        "46.97 GiB. TPS and memory sampled at the 100th iteration. 400Gb/s CX-7 per GPU. torch "
        "2.8.0a0+5228986c39, torchao 0afa4c1, torchtitan e7c0cae.",
    },
    # ----------------------------------------------------------------------------------------------
    # NeMo performance summary, container 24.07, DGX-H100, FP8
    # ----------------------------------------------------------------------------------------------
    # "| LLAMA3-8B     | 8      | 128  | 1   | 8192           | 1  | 1  | 2  | 1  | 12036              | 697 |"
    # (columns: Model | #-GPUs | GBS | MBS | Sequence Length | TP | PP | CP | VP | Tokens/sec/GPU | Model TFLOP/sec/GPU)
    {
        "source": "NeMo performance summary (NeMo 24.07), pre-training table",
        "url": _NEMO_2407,
        "model": "llama3_8b",
        "gpu": "H100",
        "gpus": 8,
        "gpus_per_node": None,
        "layout": {"tp": 1, "pp": 1, "cp": 2, "virtual_stages": 1},
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 128,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 12036,
        "mfu": None,
        "tflops_per_gpu": 697,
        "memory_gib": None,
        "notes": "Implied dp = 8/(1*1*2) = 4 (not stated). " + _NEMO_2407_HW,
    },
    # "| LLAMA3-70B    | 64     | 128  | 1   | 8192           | 4  | 4  | 2  | 5  | 1533               | 738 |"
    {
        "source": "NeMo performance summary (NeMo 24.07), pre-training table",
        "url": _NEMO_2407,
        "model": "llama3_70b",
        "gpu": "H100",
        "gpus": 64,
        "gpus_per_node": None,
        "layout": {"tp": 4, "pp": 4, "cp": 2, "virtual_stages": 5},
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 128,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 1533,
        "mfu": None,
        "tflops_per_gpu": 738,
        "memory_gib": None,
        "notes": "Interleaved pipeline (VP 5). Implied dp = 64/(4*4*2) = 2 (not stated). " + _NEMO_2407_HW,
    },
    # "| GPT3-175B     | 512    | 2048 | 2   | 2048           | 4  | 8  | 1  | 6  | 782                |
    #  [842](https://mlcommons.org/benchmarks/training/)                     |"
    {
        "source": "NeMo performance summary (NeMo 24.07), pre-training table",
        "url": _NEMO_2407,
        "model": _GPT3_175B,
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": None,
        "layout": {"tp": 4, "pp": 8, "cp": 1, "virtual_stages": 6},
        "seq_len": 2048,
        "micro_batch": 2,
        "global_batch": 2048,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 782,
        "mfu": None,
        "tflops_per_gpu": 842,
        "memory_gib": None,
        "notes": "Interleaved pipeline (VP 6). Implied dp = 512/(4*8*1) = 16 (not stated). The 842 links to "
        "MLCommons training results. Same table, 128 GPUs GBS 256 MBS 1 same TP/PP/VP: 726 tok/s/GPU, "
        "782 TFLOP/s. " + _NEMO_2407_HW,
    },
    # ----------------------------------------------------------------------------------------------
    # Megatron-Bridge performance summary, 25.11 NeMo container, DGX-H100
    # ----------------------------------------------------------------------------------------------
    # "| LLAMA3_8B | 8 | FP8-CS | 128 | 1 | 8192 | 1 | 1 | 1 | 1 | n/a | 1 | 16 | 14451 | 744 |"
    # (columns: Model | #-GPUs | Precision | GBS | MBS | Sequence Length | FSDP | TP | PP | CP | VP | EP | GA |
    #  Tokens/sec/GPU | Model TFLOP/sec/GPU)
    {
        "source": "Megatron-Bridge performance summary (25.11 container), DGX-H100 table",
        "url": _MBRIDGE_2511,
        "model": "llama3_8b",
        "gpu": "H100",
        "gpus": 8,
        "gpus_per_node": None,
        "layout": {"tp": 1, "pp": 1, "cp": 1, "ep": 1},
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 128,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 14451,
        "mfu": None,
        "tflops_per_gpu": 744,
        "memory_gib": None,
        "notes": "FSDP = 1 (Megatron FSDP over the 8 GPUs, so dp_shard 8 implied), GA 16. FP8-CS = FP8 current "
        "scaling. " + _MBRIDGE_HW,
    },
    # "| LLAMA3_70B | 64 | FP8-CS | 128 | 1 | 8192 | 0 | 4 | 8 | 1 | 5 | 1 | 64 | 1602 | 719 |"
    {
        "source": "Megatron-Bridge performance summary (25.11 container), DGX-H100 table",
        "url": _MBRIDGE_2511,
        "model": "llama3_70b",
        "gpu": "H100",
        "gpus": 64,
        "gpus_per_node": None,
        "layout": {"tp": 4, "pp": 8, "cp": 1, "ep": 1, "virtual_stages": 5},
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 128,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 1602,
        "mfu": None,
        "tflops_per_gpu": 719,
        "memory_gib": None,
        "notes": "FSDP = 0 (DDP / distributed optimizer), GA 64, interleaved pipeline VP 5. Implied dp = "
        "64/(4*8*1) = 2 (consistent with GBS/(MBS*GA) = 2). " + _MBRIDGE_HW,
    },
    # "| LLAMA3.1_405B | 1024 | FP8-CS | 512 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | 1 | 64 | 292 | 737 |"
    {
        "source": "Megatron-Bridge performance summary (25.11 container), DGX-H100 table",
        "url": _MBRIDGE_2511,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 1024,
        "gpus_per_node": None,
        "layout": {"tp": 8, "pp": 8, "cp": 2, "ep": 1, "virtual_stages": 8},
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 512,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 292,
        "mfu": None,
        "tflops_per_gpu": 737,
        "memory_gib": None,
        "notes": "FSDP = 0, GA 64, interleaved pipeline VP 8. Implied dp = 1024/(8*8*2) = 8 (consistent with "
        "GBS/(MBS*GA) = 8). " + _MBRIDGE_HW,
    },
    # ----------------------------------------------------------------------------------------------
    # MosaicML llm-foundry MPT training benchmarks (FSDP FULL_SHARD), H100 80GB BF16
    # ----------------------------------------------------------------------------------------------
    # "## H100 80GB BF16" row "|  70b | 2048 | 64 | h100_80gb | 42.57 | 56.76 |  4.212583E+14 | 8 | 4 | 2048 |
    #  32 | 66523 | 1039 | 4194304 | amp_bf16 | DEFAULT | FULL_SHARD | True | False | 64862437376 |"
    {
        "source": "llm-foundry MPT training benchmarks, H100 80GB BF16 table",
        "url": _FOUNDRY,
        "model": _MPT_70B,
        "gpu": "H100",
        "gpus": 64,
        "gpus_per_node": None,
        "layout": {"dp_shard": 64, "zero_stage": 3},
        "seq_len": 2048,
        "micro_batch": 8,
        "global_batch": 2048,
        "global_batch_tokens": 4194304,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": 1039,
        "mfu": 0.4257,
        "tflops_per_gpu": 421.2583,
        "memory_gib": None,
        "notes": "PyTorch FSDP FULL_SHARD over all 64 GPUs, Activation Checkpointing True (llm-foundry's "
        "whole-block checkpointing), no CPU offload, GradAccum 4. HFU 56.76%. tflops_per_gpu is the "
        "'Model TFLOP' column (4.212583E+14 FLOP/s). MFU uses 989 TFLOP/s H100 peak per its README formula.",
    },
    # "## H100 80GB BF16" row "|  13b | 2048 | 64 | h100_80gb | 39.86 | 39.86 |  3.943653E+14 | 2 | 1 | 128 |
    #  150 | 307209 | 4800 | 262144 | amp_bf16 | DEFAULT | FULL_SHARD | False | False | 12853954560 |"
    {
        "source": "llm-foundry MPT training benchmarks, H100 80GB BF16 table",
        "url": _FOUNDRY,
        "model": _MPT_13B,
        "gpu": "H100",
        "gpus": 64,
        "gpus_per_node": None,
        "layout": {"dp_shard": 64, "zero_stage": 3},
        "seq_len": 2048,
        "micro_batch": 2,
        "global_batch": 128,
        "global_batch_tokens": 262144,
        "recompute": "none",
        "precision": "bf16",
        "tokens_per_s_per_gpu": 4800,
        "mfu": 0.3986,
        "tflops_per_gpu": 394.3653,
        "memory_gib": None,
        "notes": "PyTorch FSDP FULL_SHARD over 64 GPUs, Activation Checkpointing False, GradAccum 1 (small global "
        "batch: 262144 tokens). 'Model TFLOP' column 3.943653E+14.",
    },
    # "## H100 80GB BF16" row "|  7b | 8192 | 8 | h100_80gb | 37.14 | 49.52 |  3.674893E+14 | 8 | 2 | 128 |
    #  6 | 55481 | 6935 | 1048576 | amp_bf16 | DEFAULT | FULL_SHARD | True | False | 6684024832 |"
    {
        "source": "llm-foundry MPT training benchmarks, H100 80GB BF16 table",
        "url": _FOUNDRY,
        "model": _MPT_7B,
        "gpu": "H100",
        "gpus": 8,
        "gpus_per_node": None,
        "layout": {"dp_shard": 8, "zero_stage": 3},
        "seq_len": 8192,
        "micro_batch": 8,
        "global_batch": 128,
        "global_batch_tokens": 1048576,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": 6935,
        "mfu": 0.3714,
        "tflops_per_gpu": 367.4893,
        "memory_gib": None,
        "notes": "PyTorch FSDP FULL_SHARD over 8 GPUs, Activation Checkpointing True, GradAccum 2. HFU 49.52%. "
        "'Model TFLOP' column 3.674893E+14.",
    },
]


# ==================================================================================================
# Pipelined runs at 512 GPUs or more (the planner issue's "pipelines priced as large runs lay them out").
#
# Published pipeline-parallel (pp >= 2) training runs of dense transformer LLMs on >= 512 GPUs.
#
# Data only: ``NEW_PP_RUNS`` is a list of dicts in the same shape as ``PUBLISHED_RUNS`` in
# ``benchmarks/planner_published.py`` (source, url, model, gpu, gpus, gpus_per_node, layout,
# pipeline_layers, seq_len, micro_batch, global_batch, global_batch_tokens, recompute, precision,
# tokens_per_s_per_gpu, mfu, tflops_per_gpu, memory_gib, flops_include_recompute, notes).
#
# Rules followed here:
#
# - Every figure is copied from the quoted text; the comment above each entry quotes the table row or
#   sentence it comes from. No measured field (tokens_per_s_per_gpu, mfu, tflops_per_gpu, memory_gib)
#   is computed. Where a per-GPU figure could be derived (e.g. the DGX-Cloud tables state *total*
#   tokens/s), the inputs and the derivation are in ``notes`` and the field is None.
# - ``layout`` holds only the degrees the source states. An implied DP degree (gpus / (tp*pp*cp)) is
#   written in ``notes`` unless the source states it.
# - ``mfu`` is the source's own utilisation figure. Its FLOP convention is given by
#   ``flops_include_recompute`` (True = hardware FLOPs incl. the recompute forward, e.g. Narayanan et
#   al. 2021's "percentage of theoretical peak"; False = model FLOPs only) and by the formula quoted
#   in ``notes``. NB: the DGX-Cloud FP8 MFUs are relative to the 1979 TFLOP/s FP8 peak (source says
#   so), not to the BF16 peak.
# - "GPU memory: ..." in notes says which memory size the source states for the GPU.
# - ``schedule``: NeMo / Megatron-Bridge / DGX-Cloud tables give a VP (virtual pipeline) degree > 1,
#   which in Megatron-Core means the interleaved 1F1B schedule; they do not name the schedule, so
#   "Interleaved1F1B" there is read from VP. Papers' schedules are quoted in notes.
# - The rows already in benchmarks/planner_published.py (torchtitan 405B on 512 H100, NeMo 24.07
#   GPT3-175B 512 H100 fp8, Megatron-Bridge 25.11 Llama3.1-405B 1024 H100 fp8) are not repeated.
#
# Where a source is a paper, ``url`` is the arXiv abstract page; the text was read from a stored
# copy in the code index (its file id is given in notes, as "stored copy id ..."), since the index
# does not name the repository of those copies.

# ------------------------------------------------------------------------------------------------
# Source addresses
# ------------------------------------------------------------------------------------------------
_NARAYANAN = "https://arxiv.org/abs/2104.04473"
_KORTHIKANTI = "https://arxiv.org/abs/2205.05198"
_LLAMA3 = "https://arxiv.org/abs/2407.21783"
_GLM130B = "https://arxiv.org/abs/2210.02414"
_DGXC_175B = (
    "https://github.com/NVIDIA/dgxc-benchmarking/blob/0b71cfda5163540778e2a3d2db59858bf62f96f7/"
    "nemo_megatron/README_175b.md"
)
_DGXC_340B = (
    "https://github.com/NVIDIA/dgxc-benchmarking/blob/143b90dd91f9be958fed4773ae95d941a3356a82/"
    "nemotron/README_340b.md"
)
_DGXC_405B = (
    "https://github.com/NVIDIA/dgxc-benchmarking/blob/143b90dd91f9be958fed4773ae95d941a3356a82/"
    "llama3.1/README_405b.md"
)
_DGXC_70B = (
    "https://github.com/NVIDIA/dgxc-benchmarking/blob/143b90dd91f9be958fed4773ae95d941a3356a82/"
    "llama3.1/README_70b.md"
)
_MBRIDGE_2602 = (
    "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/df0289c180dd20ff26933455c7a0a11084f6a36f/"
    "docs/performance-summary.md"
)
_NEMO_2502 = "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/performance_summary.html"

# ------------------------------------------------------------------------------------------------
# Shared notes
# ------------------------------------------------------------------------------------------------
_SELENE = (
    "GPU memory: 80GB ('Each cluster node has 8 NVIDIA 80-GB A100 GPUs ... connected to each other by "
    "NVLink and NVSwitch. Each node has eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs for "
    "application communication'; Selene). 'All of our results are run with mixed precision': the paper "
    "does not say fp16 or bf16 (precision recorded as bf16 per the table convention; peak used = 312 "
    "TFLOP/s '16-bit')."
)
_NARAYANAN_FLOPS = (
    "FLOP count (paper eq. 3): F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration; 'equation (3) assumes "
    "activation recomputation and takes into account the floating-point operations associated with the "
    "extra forward pass' -> hardware FLOPs (counts recompute). mfu here = the table's 'Percentage of "
    "theoretical peak FLOP/s' (of 312 TFLOP/s), i.e. a hardware-FLOPs utilisation, not PaLM-style MFU. "
    "'throughput is measured for end-to-end training, i.e., includes all operations including data "
    "loading, optimizer steps, communication, and logging.'"
)
_NARAYANAN_T1 = (
    "Table 1 setup (sec. 5.1): 'we use the interleaved pipeline schedule with the scatter/gather "
    "optimization enabled. All models use a vocabulary size (denoted by V) of 51,200 ... and a sequence "
    "length (s) of 2048.' Number of model chunks per device (virtual_stages) not stated; micro-batch size "
    "not stated for Table 1. Stored copy id 63285939983 (markdown transcription; its 'teraFIOP/s' is an "
    "OCR typo for teraFLOP/s)."
)
_DGXC_HW = (
    "GPU memory: 80GB ('At least 128 GPUs with at least 80 GB memory each'); DGX H100, "
    "'N_GPUS_PER_NODE is 8 for DGX H100'. NeMo Launcher (NeMo 1.x, Hydra config) benchmark on DGX Cloud, "
    "50 steps on synthetic/Pile data; 'we are using the last training step timing to obtain throughput "
    "value'. Peak used for MFU: 'H100 FP8 is 1979 TFLOPS and for H100 BF16 is 989 TFLOPS'. "
    "The table's throughput is the whole job's tokens/s ('(sequence length) * (global batch size) / "
    "(training_step_timing)'), not per GPU, so tokens_per_s_per_gpu is left None (divide by gpus for a "
    "per-GPU figure)."
)
_LLAMA3_HW = (
    "GPU memory: 80GB ('Llama 3 405B is trained on up to 16K H100 GPUs, each running at 700W TDP with "
    "80GB HBM3, using Meta's Grand Teton AI server platform ... Each server is equipped with eight GPUs'); "
    "RoCE fabric, '400 Gbps interconnects between GPUs'. MFU is PaLM-style ('BF16 Model FLOPs Utilization "
    "(MFU; Chowdhery et al. (2023))'), model FLOPs only. DP is FSDP: 'Our use of FSDP for Llama 3 shards "
    "optimizer states and gradients, but for model shards we do not reshard after forward computation' "
    "(so weights stay gathered between forward and backward: ZeRO-2-like memory, recorded as dp_shard). "
    "Pipeline: 'we use an interleaved schedule (Narayanan et al., 2021) with V pipeline stages on one "
    "pipeline rank' (V not stated) with a modified schedule whose number of contiguous micro-batches N is "
    "tunable; async P2P. Stored copy id 55567177796 (v1 text)."
)
_LLAMA3_PP_SPLIT = (
    "first and last pipeline stages each have one transformer layer fewer ('we reduce one Transformer layer "
    "each from the first and the last stages. This means that the first model chunk on the first stage has "
    "only the embedding, and the last model chunk on the last stage has only output projection and loss "
    "calculation')"
)

# ------------------------------------------------------------------------------------------------
# Architectures (dicts); Llama 3 shapes use the planner presets
# ------------------------------------------------------------------------------------------------


def _megatron_gpt(n_layers: int, hidden: int, heads: int, table: str) -> dict:
    """A Narayanan et al. / Korthikanti et al. GPT model: 4h 2-matrix GELU MLP, MHA, V = 51,200."""
    return {
        "n_layers": n_layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": heads,
        "ffn_hidden": 4 * hidden,
        "vocab": 51200,
        "style": "GPT-style (Megatron GPT: 4h 2-matrix GELU MLP, MHA, learned positions)",
        "config": f"{table}: heads {heads}, hidden {hidden}, layers {n_layers}; 'All models use a vocabulary "
        "size (denoted by V) of 51,200'; appendix: 'A transformer layer consists of an attention block "
        "followed by a 2-layer feed-forward network ... The feed-forward network increases the hidden size "
        "to 4h and then reduces it back to h'. kv_heads = heads (no grouped-query attention in these "
        "GPT models).",
    }


_GPT3_175B_DGXC = {
    "n_layers": 96,
    "hidden": 12288,
    "heads": 96,
    "kv_heads": 96,
    "ffn_hidden": 49152,
    "vocab": 51200,
    "style": "GPT-style (GPT-3 175B: 4h 2-matrix GELU MLP, MHA)",
    "config": "dgxc-benchmarking README_175b.md notes: 'sequence length = 2048', 'attention flops = 24 * 96 * "
    "12288^2 + ...', 'embedding flops = 6 * 51200 * 12288' (96 layers, hidden 12288, vocab 51200). Heads 96 "
    "and ffn 49152 from NVIDIA/NeMo nemo/collections/llm/gpt/model/base.py GPTConfig175B ('num_layers: int = "
    "96', 'hidden_size: int = 12288', 'ffn_hidden_size: int = 49152', 'num_attention_heads: int = 96'); the "
    "run itself used NeMo Launcher's gpt3_175b_hydra.yaml (not read). kv_heads = heads (MHA).",
}

_NEMOTRON4_340B = {
    "n_layers": 96,
    "hidden": 18432,
    "heads": 96,
    "kv_heads": 8,
    "ffn_hidden": 73728,
    "vocab": 256000,
    "style": "GPT-style (Nemotron-4: 2-matrix squared-ReLU MLP, GQA 8 groups, RoPE, no bias, untied embeddings)",
    "config": "NVIDIA/NeMo @0037ec8 nemo/collections/llm/gpt/model/nemotron.py: NemotronConfig 'activation_func: "
    "Callable = squared_relu', 'add_bias_linear: bool = False', 'share_embeddings_and_output_weights: bool = "
    "False', 'rotary_percent: float = 0.5'; Nemotron4Config340B 'num_layers: int = 96', 'hidden_size: int = "
    "18432', 'ffn_hidden_size: int = 73728', 'num_attention_heads: int = 96', 'num_query_groups: int = 8'. "
    "Vocab and seq from the dgxc README notes: 'sequence length = 4096 ... vocab size = 256000'.",
}

_GLM_130B = {
    "n_layers": 70,
    "hidden": 12288,
    "heads": 96,
    "kv_heads": 96,
    "ffn_hidden": 32768,
    "vocab": 150528,
    "style": "GLM (gated GeGLU 3-matrix MLP, DeepNorm post-LN, RoPE, MHA; bidirectional-prefix blank infilling)",
    "config": "THUDM/GLM-130B @2cbe915 configs/model_glm_130b.sh: '--num-layers 70 --hidden-size 12288 "
    "--inner-hidden-size 32768 --vocab-size 150528 --num-attention-heads 96 --max-sequence-length 2048'; "
    "paper sec. 2.1: 'To improve FFNs in Transformer, we pick GLU with the GeLU ... activation as the "
    "replacement.' No KV grouping in the config (MHA).",
}


PIPELINED_AT_SCALE = [
    # ==============================================================================================
    # Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    # Megatron-LM" (SC'21), Table 1 "Weak-scaling throughput for GPT models ranging from 1 billion to
    # 1 trillion parameters." Columns: Number of parameters (billion) | Attention heads | Hidden size |
    # Number of layers | Tensor model-parallel size | Pipeline model-parallel size | Number of GPUs |
    # Batch size | Achieved teraFLOP/s per GPU | Percentage of theoretical peak FLOP/s | Achieved
    # aggregate petaFLOP/s. A100 80GB.
    # ==============================================================================================
    # "| 39.1 | 64 | 8192 | 48 | 8 | 2 | 512 | 1536 | 138 | 44% | 70.8 |"
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1",
        "url": _NARAYANAN,
        "model": _megatron_gpt(48, 8192, 64, "Table 1 row 39.1B"),
        "gpu": "A100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 2, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": None,
        "global_batch": 1536,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.44,
        "tflops_per_gpu": 138,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "Implied dp = 512/(8*2) = 32 (not stated). Aggregate 70.8 PFLOP/s. recompute 'full': eq. (3) "
        "'assumes activation recomputation' (Megatron 2021 recomputes whole layers). "
        + _NARAYANAN_T1 + " " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # "| 76.1 | 80 | 10240 | 60 | 8 | 4 | 1024 | 1792 | 140 | 45% | 143.8 |"
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1",
        "url": _NARAYANAN,
        "model": _megatron_gpt(60, 10240, 80, "Table 1 row 76.1B"),
        "gpu": "A100",
        "gpus": 1024,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 4, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": None,
        "global_batch": 1792,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.45,
        "tflops_per_gpu": 140,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "Implied dp = 1024/(8*4) = 32 (not stated). Aggregate 143.8 PFLOP/s. "
        + _NARAYANAN_T1 + " " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # "| 145.6 | 96 | 12288 | 80 | 8 | 8 | 1536 | 2304 | 148 | 47% | 227.1 |"
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1",
        "url": _NARAYANAN,
        "model": _megatron_gpt(80, 12288, 96, "Table 1 row 145.6B"),
        "gpu": "A100",
        "gpus": 1536,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 8, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": None,
        "global_batch": 2304,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.47,
        "tflops_per_gpu": 148,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "Implied dp = 1536/(8*8) = 24 (not stated). Aggregate 227.1 PFLOP/s. "
        + _NARAYANAN_T1 + " " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # "| 310.1 | 128 | 16384 | 96 | 8 | 16 | 1920 | 2160 | 155 | 50% | 297.4 |"
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1",
        "url": _NARAYANAN,
        "model": _megatron_gpt(96, 16384, 128, "Table 1 row 310.1B"),
        "gpu": "A100",
        "gpus": 1920,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 16, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": None,
        "global_batch": 2160,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.50,
        "tflops_per_gpu": 155,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "Implied dp = 1920/(8*16) = 15 (not stated). Aggregate 297.4 PFLOP/s. "
        + _NARAYANAN_T1 + " " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # "| 529.6 | 128 | 20480 | 105 | 8 | 35 | 2520 | 2520 | 163 | 52% | 410.2 |"
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1",
        "url": _NARAYANAN,
        "model": _megatron_gpt(105, 20480, 128, "Table 1 row 529.6B"),
        "gpu": "A100",
        "gpus": 2520,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 35, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": None,
        "global_batch": 2520,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.52,
        "tflops_per_gpu": 163,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "Implied dp = 2520/(8*35) = 9 (not stated). Aggregate 410.2 PFLOP/s. 105 layers / 35 stages = 3 "
        "layers per stage, so at most 3 model chunks per device with interleaving. "
        + _NARAYANAN_T1 + " " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # "| 1008.0 | 160 | 25600 | 128 | 8 | 64 | 3072 | 3072 | 163 | 52% | 502.0 |"
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1",
        "url": _NARAYANAN,
        "model": _megatron_gpt(128, 25600, 160, "Table 1 row 1008.0B"),
        "gpu": "A100",
        "gpus": 3072,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 64, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": None,
        "global_batch": 3072,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.52,
        "tflops_per_gpu": 163,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "Implied dp = 3072/(8*64) = 6 (not stated). Aggregate 502.0 PFLOP/s. 128 layers / 64 stages = 2 "
        "layers per stage. Sec. 5.9: 'On the trillion-parameter model with 3072 GPUs, we observed that the "
        "effective bisection bandwidth of point-to-point communication among pipeline stages is 892 GB/s, "
        "while the effective bisection bandwidth of all-reduce operations among data-parallel replicas is "
        "12.9 TB/s.' " + _NARAYANAN_T1 + " " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # ==============================================================================================
    # Narayanan et al. 2021, Table 2 "Comparison of PTD Parallelism to ZeRO-3 (without model
    # parallelism)". Columns: Scheme | Number of parameters (billion) | Model-parallel size | Batch size |
    # Number of GPUs | Microbatch size | Achieved teraFLOP/s per GPU | Training time for 300B tokens (days).
    # Sec. 5.2: "We compare PTD-P to ZeRO-3 ... for the standard GPT-3 model architecture, as well as the
    # 530-billion-parameter model from Table 1."
    # ==============================================================================================
    # PTD Parallelism rows: "| 529.6 | 280 | 2240 | 560 | 1 | 171 | 156 |", "| | | | 1120 | 1 | 167 | 80 |",
    # "| | | | 2240 | 1 | 159 | 42 |"
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 2 (PTD-P rows)",
        "url": _NARAYANAN,
        "model": _megatron_gpt(105, 20480, 128, "Table 1 row 529.6B (Table 2 uses 'the 530-billion-parameter model from Table 1')"),
        "gpu": "A100",
        "gpus": 560,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 35},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 1,
        "global_batch": 2240,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": None,
        "tflops_per_gpu": 171,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "Table 2 states only 'Model-parallel size 280'; tp 8 / pp 35 are Table 1's split for the same "
        "529.6B model (8*35 = 280). Implied dp = 560/280 = 2 (not stated). Global batch fixed at 2240 as GPUs "
        "grow ('We keep the global batch size the same as we increase the number of GPUs'). Same table: 1120 "
        "GPUs 167 TFLOP/s, 2240 GPUs 159 TFLOP/s (see next entry). Schedule (interleaved or not) not stated "
        "for Table 2. Stored copy id 63285939983. " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # same table, PTD Parallelism 529.6B row "| | | | 2240 | 1 | 159 | 42 |" (model-parallel size 280,
    # batch size 2240)
    {
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 2 (PTD-P rows)",
        "url": _NARAYANAN,
        "model": _megatron_gpt(105, 20480, 128, "Table 1 row 529.6B (Table 2 uses 'the 530-billion-parameter model from Table 1')"),
        "gpu": "A100",
        "gpus": 2240,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 35},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 1,
        "global_batch": 2240,
        "global_batch_tokens": None,
        "recompute": "full",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": None,
        "tflops_per_gpu": 159,
        "memory_gib": None,
        "flops_include_recompute": True,
        "notes": "As the 560-GPU entry; implied dp = 2240/280 = 8 (not stated). Same layout, batch and GPU count as "
        "Korthikanti et al.'s 2240-GPU 530B run (full recompute here, selective + sequence parallel there). "
        "Stored copy id 63285939983. " + _NARAYANAN_FLOPS + " " + _SELENE,
    },
    # ==============================================================================================
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    # (MLSys 2023). Table 3 "Model configurations used during evaluation" (Model Size | Attention Heads |
    # Hidden Size | Layers | Tensor Parallel Size | Pipeline Parallel Size | Number of GPUs | Global Batch
    # Size | Micro Batch Size); Table 5 "End-to-end iteration time" (Model Size | Iteration Time (seconds)
    # Full Recompute | Present Work | Throughput Increase | Model FLOPs Utilization | Hardware FLOPs
    # Utilization). A100 80GB.
    # ==============================================================================================
    # Table 3 "| 1T | 160 | 25600 | 128 | 8 | 64 | 512 | 512 | 1 |"; Table 5 "| 1T | 94.42 | 71.49 | 32.1% |
    # 56.3% | 57.0% |"
    {
        "source": "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5",
        "url": _KORTHIKANTI,
        "model": _megatron_gpt(128, 25600, 160, "Korthikanti et al. Table 3 row 1T"),
        "gpu": "A100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 64, "dp": 1},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 1,
        "global_batch": 512,
        "global_batch_tokens": None,
        "recompute": "selective",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.563,
        "tflops_per_gpu": None,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "'Present Work' = sequence parallelism + selective activation recomputation (sequence parallel is on; "
        "the planner layout has no key for it). Iteration time 71.49 s; HFU 57.0%; the full-recompute baseline "
        "without sequence parallelism took 94.42 s (no MFU given for it). 'Note that no data parallelism is used "
        "in our evaluations' (dp = 1 stated). 'For all the cases, sequence length is set to s = 2048 and "
        "vocabulary size is set to v = 51200.' Interleaving: 'We use the interleaving schedule with three "
        "interleaving stages (m = 3) for the 175B and 530B models' -- not said for 1T, so presumably the "
        "default non-interleaved schedule (schedule left unset). MFU/HFU 'similar to Chowdhery, et al.': 'Model "
        "FLOPs are the floating point operations required to perform a single forward and backward pass ... "
        "regardless of the implementations' -> model FLOPs only; 'For our method, the hardware to model FLOPs "
        "ratio is approximately 1 + s/6h.' tflops_per_gpu not stated (MFU is of the 312 TFLOP/s A100 peak). "
        "GPU memory: 80GB ('Each cluster node has 8 NVIDIA 80GB A100 GPUs ... connected to each other by NVLink "
        "and NVSwitch. Each node has eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs'). 'All of our results "
        "are run with mixed precision' (fp16/bf16 not stated). Stored copy id 69442322288.",
    },
    # Sec. 6.3: "if we scale the 530B model to 8-way data parallellism (2240 GPUs) while keeping batch size
    # per model instance constant – i.e., the batch size is also multiplied by the data parallel size – the
    # time per iteration increases slightly from 37.83 seconds to 39.15 seconds. This results in an MFU drop
    # from 56.0% to 54.2%"; Table 3 "| 530B (MT-NLG) | 128 | 20480 | 105 | 8 | 35 | 280 | 280 | 1 |"
    {
        "source": "Korthikanti et al. 2022 (arXiv 2205.05198), sec. 6.3 (530B, 8-way DP)",
        "url": _KORTHIKANTI,
        "model": _megatron_gpt(105, 20480, 128, "Korthikanti et al. Table 3 row 530B (MT-NLG)"),
        "gpu": "A100",
        "gpus": 2240,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 35, "dp": 8, "virtual_stages": 3, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 1,
        "global_batch": 2240,
        "global_batch_tokens": None,
        "recompute": "selective",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.542,
        "tflops_per_gpu": None,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "global_batch = Table 3's 280 per model instance x 8 DP replicas, as the sentence says ('the batch "
        "size is also multiplied by the data parallel size'). Iteration 39.15 s. virtual_stages 3 from 'three "
        "interleaving stages (m = 3) for the 175B and 530B models'. Sequence parallel + selective recompute. "
        "'We note that we do not use any overlapping of gradient all-reduces with back-propagation'. Abstract: "
        "'when training a 530B parameter GPT-3 style model on 2240 NVIDIA A100 GPUs, we achieve a Model Flops "
        "Utilization of 54.2%, which is 29% faster than the 42.1% we achieve using recomputation.' MFU is model "
        "FLOPs (Chowdhery-style). GPU memory: 80GB (Selene, as the 1T entry). Mixed precision (fp16/bf16 not "
        "stated). Stored copy id 69442322288.",
    },
    # ==============================================================================================
    # Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models"), Table 4 "Scaling configurations and MFU
    # for each stage of Llama 3 405B pre-training." Columns: GPUs | TP | CP | PP | DP | Seq. Len. |
    # Batch size/DP | Tokens/Batch | TFLOPs/GPU | BF16 MFU
    # ==============================================================================================
    # "8,192 8 1 16 64 8,192 32 16M 430 43%"
    {
        "source": "Llama 3 paper (arXiv 2407.21783), Table 4",
        "url": _LLAMA3,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 8192,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "cp": 1, "pp": 16, "dp_shard": 64, "schedule": "Interleaved1F1B"},
        "pipeline_layers": _LLAMA3_PP_SPLIT,
        "seq_len": 8192,
        "micro_batch": None,
        "global_batch": 2048,
        "global_batch_tokens": None,
        "recompute": "none",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.43,
        "tflops_per_gpu": 430,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "global_batch = 'Batch size/DP' 32 x DP 64 = 2048 sequences (the row's 'Tokens/Batch' is '16M' = "
        "2048 x 8192). recompute 'none': 'With these optimizations, we could pre-train Llama 3 on sequences of "
        "8K tokens without activation checkpointing.' Micro-batch size not stated. " + _LLAMA3_HW,
    },
    # "16,384 8 1 16 128 8,192 16 16M 400 41%"
    {
        "source": "Llama 3 paper (arXiv 2407.21783), Table 4",
        "url": _LLAMA3,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 16384,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "cp": 1, "pp": 16, "dp_shard": 128, "schedule": "Interleaved1F1B"},
        "pipeline_layers": _LLAMA3_PP_SPLIT,
        "seq_len": 8192,
        "micro_batch": None,
        "global_batch": 2048,
        "global_batch_tokens": None,
        "recompute": "none",
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.41,
        "tflops_per_gpu": 400,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "global_batch = 'Batch size/DP' 16 x DP 128 = 2048 sequences ('16M' tokens). 'The slight drop in MFU "
        "to 41% on 16K GPUs with DP=128 compared to 43% on 8K GPUs with DP=64 is due to the lower batch size per "
        "DP group needed to keep the global tokens per batch constant during training.' recompute 'none' as the "
        "8K-GPU row. 16K GPUs span pods: 'a pod of 3,072 GPUs with full bisection bandwidth ... network "
        "connectivity at the aggregation layer ... has an oversubscription ratio of 1:7'. " + _LLAMA3_HW,
    },
    # "16,384 8 16 16 8 131,072 16 16M 380 38%" (arXiv v3; the v1 text read, stored copy id 55567177796,
    # prints DP as 4: "16,384 8 16 16 4 131,072 16 16M 380 38%")
    {
        "source": "Llama 3 paper (arXiv 2407.21783), Table 4 (long-context stage)",
        "url": _LLAMA3,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 16384,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "cp": 16, "pp": 16, "dp_shard": 8, "schedule": "Interleaved1F1B"},
        "pipeline_layers": _LLAMA3_PP_SPLIT,
        "seq_len": 131072,
        "micro_batch": None,
        "global_batch": 128,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.38,
        "tflops_per_gpu": 380,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "DP: arXiv v1 prints 4, which is inconsistent with 8*16*16*4 = 8192 GPUs; later copies of the table "
        "(e.g. stored copy id 62360967329, and a note quoting arXiv v3 of 23 Nov 2024) print 8, consistent with "
        "16,384 GPUs and with 'Batch size/DP' 16 x 8 = 128 sequences x 131,072 = 16.8M ('16M') tokens. "
        "global_batch = 16 x 8 = 128. CP: 'we partition the input sequence into 2xCP chunks so each CP rank "
        "receives two chunks for better load balancing'; 'our CP implementation adopts an all-gather based "
        "method where we first all-gather the key (K) and value (V) tensors'. Activation checkpointing at 128K "
        "not stated. " + _LLAMA3_HW,
    },
    # ==============================================================================================
    # NVIDIA DGX Cloud benchmarking recipes (NVIDIA/dgxc-benchmarking), NeMo Launcher on DGX H100.
    # ==============================================================================================
    # README_175b.md: "| NeMo Megatron BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048) | 128x H100 GPUs (GBS=256) |
    # 256x H100 GPUs (GBS=512) | 512x H100 GPUs (GBS=1024) | 1024x H100 GPUs (GBS=2048) | 2048x H100 GPUs
    # (GBS=4096)"; "| Training step time (seconds per step) | 8.309 | 8.408 | 8.42 | 8.453 | 8.49";
    # "| Throughput in tokens per second | 63099 | 124712 | 249068 | 496191 | 988057"; "| Model flops
    # utilization | 53.54% | 52.91% | 52.84% | 52.63% | 52.40%"  -> 512-GPU column
    {
        "source": "NVIDIA dgxc-benchmarking, nemo_megatron/README_175b.md, BF16 table",
        "url": _DGXC_175B,
        "model": _GPT3_175B_DGXC,
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"tp": 4, "pp": 8, "virtual_stages": 12, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 1,
        "global_batch": 1024,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5284,
        "tflops_per_gpu": None,
        "flops_per_sequence": 2.2e+15,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Step time 8.42 s; job throughput 249068 tokens/s (= 2048 x 1024 / 8.42), i.e. 249068/512 per GPU "
        "(derived, not stated). Implied dp = 512/(4*8) = 16. VP 12 with PP 8 -> 96 chunks of 1 layer. "
        "MFU formula (README notes): 'model flops = (sequence length) * ((attention flops) + (mlp flops) + "
        "(embedding flops))', attention = 24 l h^2 + 12 l h s, mlp = 48 l h^2, embedding = 6 V h; GPT3 175B "
        "'2.20E+15' per sequence -> model FLOPs (3 x forward, no recompute). Recompute setting not stated in "
        "the README. Same table: 1024 GPUs 8.453 s / 496191 tok/s / 52.63%. Container version not stated in the "
        "README version read. " + _DGXC_HW,
    },
    # same BF16 table, 2048-GPU column: step 8.49, throughput 988057, MFU 52.40%
    {
        "source": "NVIDIA dgxc-benchmarking, nemo_megatron/README_175b.md, BF16 table",
        "url": _DGXC_175B,
        "model": _GPT3_175B_DGXC,
        "gpu": "H100",
        "gpus": 2048,
        "gpus_per_node": 8,
        "layout": {"tp": 4, "pp": 8, "virtual_stages": 12, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 1,
        "global_batch": 4096,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5240,
        "tflops_per_gpu": None,
        "flops_per_sequence": 2.2e+15,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Step time 8.49 s; job throughput 988057 tokens/s (per GPU = /2048, derived). Implied dp = 64. "
        "MFU formula as the 512-GPU entry. " + _DGXC_HW,
    },
    # README_175b.md: "| NeMo Megatron FP8 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048) | ... 512x H100 GPUs (GBS=1024) ...";
    # "| Training step time (seconds per step) | 5.626 | 5.725 | 5.774 | 5.82 | 5.96"; "| Throughput in
    # tokens per second | 93190 | 183157 | 363206 | 720671 | 1407485"; "| Model flops utilization | 39.52% |
    # 38.84% | 38.51% | 38.20% | 37.30%"  -> 512-GPU column
    {
        "source": "NVIDIA dgxc-benchmarking, nemo_megatron/README_175b.md, FP8 table",
        "url": _DGXC_175B,
        "model": _GPT3_175B_DGXC,
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"tp": 4, "pp": 8, "virtual_stages": 12, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 1,
        "global_batch": 1024,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.3851,
        "tflops_per_gpu": None,
        "flops_per_sequence": 2.2e+15,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "FP8 ROW. MFU is relative to the FP8 peak: 'MFU = 256 * 2.20E+15 / 5.90 / 128 / 1979E+12' in the "
        "README's worked example -- not comparable with BF16-peak MFUs without rescaling (x 1979/989). Step time "
        "5.774 s; job throughput 363206 tokens/s (per GPU = /512, derived). Same config as the BF16 512-GPU "
        "entry. " + _DGXC_HW,
    },
    # nemotron/README_340b.md: "| Nemotron4 340b 24.11 BF16 (TP=8, PP=8, MBS=1, GA=16, VP=12) | Throughput on
    # 128x H100 GPUs (GBS=32) | ... 256x (GBS=64) | ... 512x H100 GPUs (GBS=128) | ... 1024x (GBS=256) | ...
    # 2048x H100 GPUs (GBS=512) |"; "| Training step time (seconds per step) |  4.61 | 4.67 | 4.7 | 4.73 |
    # 4.84 |"; "| Throughput in tokens per second | 28432 | 56134 | 111551 | 221686 | 433296 |"; "| Model
    # flops utilization | 55.38% | 54.67% | 54.32% | 53.98% | 52.75% |"  -> 512-GPU column
    {
        "source": "NVIDIA dgxc-benchmarking, nemotron/README_340b.md, Nemotron4 340b 24.11 BF16 table",
        "url": _DGXC_340B,
        "model": _NEMOTRON4_340B,
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 8, "virtual_stages": 12, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 4096,
        "micro_batch": 1,
        "global_batch": 128,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5432,
        "tflops_per_gpu": None,
        "flops_per_sequence": 1.01e+16,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Step 4.7 s; job throughput 111551 tokens/s (per GPU = /512, derived). GA 16 stated; implied dp = "
        "512/(8*8) = 8 (= GBS 128 / (MBS 1 x GA 16)). VP 12 with PP 8 -> 96 chunks of 1 layer. Table title says "
        "24.11 but the README's setup step converts 'nvcr.io/nvidia/nemo:24.09'. MFU formula (README notes): "
        "attention = 24 l h^2 + 12 l h s, mlp = 48 l h^2, embedding = 6 V h, times seq; '1.01e16' per sequence "
        "-> model FLOPs, and it counts full-width K/V projections although the model has 8 KV groups (slight "
        "overcount vs a GQA-exact count). Synthetic data. Recompute not stated. " + _DGXC_HW,
    },
    # same BF16 table, 2048-GPU column: step 4.84, throughput 433296, MFU 52.75%
    {
        "source": "NVIDIA dgxc-benchmarking, nemotron/README_340b.md, Nemotron4 340b 24.11 BF16 table",
        "url": _DGXC_340B,
        "model": _NEMOTRON4_340B,
        "gpu": "H100",
        "gpus": 2048,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 8, "virtual_stages": 12, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 4096,
        "micro_batch": 1,
        "global_batch": 512,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5275,
        "tflops_per_gpu": None,
        "flops_per_sequence": 1.01e+16,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Step 4.84 s; job throughput 433296 tokens/s (per GPU = /2048, derived). GA 16; implied dp = 32. "
        "Same table: 1024 GPUs 4.73 s / 221686 tok/s / 53.98%. Same FP8 table at 512 GPUs: 3.26 s / 160825 "
        "tok/s / 39.14% (FP8-peak MFU). MFU formula as the 512-GPU entry. " + _DGXC_HW,
    },
    # llama3.1/README_405b.md: "| Llama 3.1 405b 24.09 BF16 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63) | ... |
    # Throughput on 576x H100 GPUs | Throughput on 1152x H100 GPUs | Throughput on 2304x H100 GPUs |";
    # "| Layers | 7 | 21 | 42 | 126 | 126 | 126 |"; "| GBS | 126 | 126 | 252 | 252 | 504 | 1008 |";
    # "| PP | 1 | 3 | 3 | 9 | 9 | 9 |"; "| VP | n/a | 7 | 7 | 7 | 7 | 7 |"; "| Training step time (seconds
    # per step) | 8.85 | 8.7  5 | 16.93 | 17.20 | 17.52 | 17.62 |"; "| Throughput in tokens per second |
    # 116632 | 117965 | 121936 | 120022 | 235660 | 468646 |"; "| Model flops utilization | 58.63% | 56.17% |
    # 57.25% | 55.78% | 54.76% | 54.45% |"  -> 576-GPU column
    {
        "source": "NVIDIA dgxc-benchmarking, llama3.1/README_405b.md, Llama 3.1 405b 24.09 BF16 table",
        "url": _DGXC_405B,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 576,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 9, "cp": 2, "virtual_stages": 7, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 252,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5578,
        "tflops_per_gpu": None,
        "flops_per_sequence": 2.17e+16,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Full 126-layer model (the <576-GPU columns are reduced-layer 'proxy configs'). Step 17.20 s; job "
        "throughput 120022 tokens/s (per GPU = /576, derived). GA 63; implied dp = 576/(8*9*2) = 4 (= 252/63). "
        "PP 9 x VP 7 = 63 chunks of 2 layers. Vocab caveat: 'Llama3.1 405B uses the GPT2BPETokenizer as a "
        "proxy' (synthetic data), so the run's embedding/output layer likely has GPT-2's ~50K vocab, not "
        "128,256; the MFU formula nevertheless uses 'embedding flops = 6 * 128256 * 16384'. MFU formula: "
        "attention = 12 l h^2 (1 + groups/heads + s/h), mlp = 18 l F h, embedding = 6 V h per token, '2.17E16' "
        "per sequence -> model FLOPs. Container nemo:24.09. Recompute not stated. " + _DGXC_HW,
    },
    # same BF16 table, 2304-GPU column: GBS 1008, step 17.62, throughput 468646, MFU 54.45%
    {
        "source": "NVIDIA dgxc-benchmarking, llama3.1/README_405b.md, Llama 3.1 405b 24.09 BF16 table",
        "url": _DGXC_405B,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 2304,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 9, "cp": 2, "virtual_stages": 7, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 1008,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5445,
        "tflops_per_gpu": None,
        "flops_per_sequence": 2.17e+16,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Step 17.62 s; job throughput 468646 tokens/s (per GPU = /2304, derived). GA 63; implied dp = 16. "
        "Same table: 1152 GPUs (GBS 504) 17.52 s / 235660 tok/s / 54.76%. GPT-2 tokenizer proxy caveat and MFU "
        "formula as the 576-GPU entry. " + _DGXC_HW,
    },
    # llama3.1/README_405b.md: "| Llama 3.1 405b 24.09 FP8 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63) | ...";
    # "| Training step time (seconds per step) | 5.80 | 5.71 | 11.00 | 11.24 | 11.31 | 12.35 |"; "| Throughput
    # in tokens per second | 178118 | 180674 | 187740 | 183664 | 365055 | 668626 |"; "| Model flops
    # utilization | 44.77% | 43.01% | 44.07% | 42.71% | 42.45% | 38.87% |"  -> 576-GPU column
    {
        "source": "NVIDIA dgxc-benchmarking, llama3.1/README_405b.md, Llama 3.1 405b 24.09 FP8 table",
        "url": _DGXC_405B,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 576,
        "gpus_per_node": 8,
        "layout": {"tp": 8, "pp": 9, "cp": 2, "virtual_stages": 7, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 252,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.4271,
        "tflops_per_gpu": None,
        "flops_per_sequence": 2.17e+16,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "FP8 ROW. MFU relative to the 1979 TFLOP/s FP8 peak ('MFU = 252 * 2.17E+16 / 11.24 / 576 / 1979E+12 "
        "= 42.71%'). Step 11.24 s; job throughput 183664 tokens/s (per GPU = /576, derived). Same config, "
        "tokenizer caveat and formula as the BF16 576-GPU entry. " + _DGXC_HW,
    },
    # llama3.1/README_70b.md: "| Llama 3.1 70b 24.09 BF16 (TP=4, PP=4, CP=2, VP=5, MBS=1, GA=64) | Throughput
    # on 64x H100 GPUs (GBS=128) | ... | Throughput on 512x H100 GPUs (GBS=1024) | Throughput on 1024x H100
    # GPUs (GBS=2048) | Throughput on 2048x H100 GPUs (GBS=4096)"; "| Training step time (seconds per step)
    # | 14.72  | 14.73  | 14.8   | 14.89  | 14.92   | 14.98"; "| Throughput in tokens per second | 71235  |
    # 142373 | 283399 | 563372 | 1124478 | 2248957"; "| Model flops utilization | 54.10% | 54.06% | 53.81% |
    # 53.48% | 53.38%  | 53.38%"  -> 512-GPU column
    {
        "source": "NVIDIA dgxc-benchmarking, llama3.1/README_70b.md, Llama 3.1 70b 24.09 BF16 table",
        "url": _DGXC_70B,
        "model": "llama3_70b",
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": 8,
        "layout": {"tp": 4, "pp": 4, "cp": 2, "virtual_stages": 5, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 1024,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5348,
        "tflops_per_gpu": None,
        "flops_per_sequence": 3.94e+15,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Step 14.89 s; job throughput 563372 tokens/s (per GPU = /512, derived). GA 64; implied dp = "
        "512/(4*4*2) = 16 (= 1024/64). PP 4 x VP 5 = 20 chunks of 4 layers. Real Llama 3 tokenizer ('Llama3.1 "
        "8B and 70B use the same Llama3 tokenizer'), Pile data. MFU formula: attention = 12 l h^2 (1 + "
        "groups/heads + s/h), mlp = 18 l F h, embedding = 6 V h (V = 128256) per token, '3.94E+15' per sequence "
        "-> model FLOPs. Same FP8 table at 512 GPUs: 11.18 s / 750323 tok/s / 35.62% (FP8-peak MFU). Container "
        "nemo:24.09. Recompute not stated. " + _DGXC_HW,
    },
    # same BF16 table, 2048-GPU column: GBS 4096, step 14.98, throughput 2248957, MFU 53.38%
    {
        "source": "NVIDIA dgxc-benchmarking, llama3.1/README_70b.md, Llama 3.1 70b 24.09 BF16 table",
        "url": _DGXC_70B,
        "model": "llama3_70b",
        "gpu": "H100",
        "gpus": 2048,
        "gpus_per_node": 8,
        "layout": {"tp": 4, "pp": 4, "cp": 2, "virtual_stages": 5, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 4096,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.5338,
        "tflops_per_gpu": None,
        "flops_per_sequence": 3.94e+15,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "Step 14.98 s; job throughput 2248957 tokens/s (per GPU = /2048, derived). GA 64; implied dp = 64. "
        "Same table: 1024 GPUs 14.92 s / 1124478 tok/s / 53.38%. MFU formula as the 512-GPU entry. " + _DGXC_HW,
    },
    # ==============================================================================================
    # Megatron-Bridge performance summary, 26.02 NeMo container (commit df0289c), "#### System: DGX-H100"
    # Columns: Model | #-GPUs | Precision | GBS | MBS | Sequence Length | FSDP | TP | PP | CP | VP | EP | GA |
    # Tokens / sec / GPU | Model TFLOP / sec / GPU
    # ==============================================================================================
    # "| LLAMA3.1_405B | 1024 | FP8-CS | 1536 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | n/a | 192 | 311 | 784 |"
    {
        "source": "Megatron-Bridge performance summary (26.02 NeMo container), DGX-H100 table",
        "url": _MBRIDGE_2602,
        "model": "llama3_405b",
        "gpu": "H100",
        "gpus": 1024,
        "gpus_per_node": None,
        "layout": {"tp": 8, "pp": 8, "cp": 2, "virtual_stages": 8, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 8192,
        "micro_batch": 1,
        "global_batch": 1536,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 311,
        "mfu": None,
        "tflops_per_gpu": 784,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "FP8 ROW (FP8-CS = FP8 current scaling). FSDP 0 (DDP with distributed optimizer), GA 192; implied "
        "dp = 1024/(8*8*2) = 8 (= 1536/192). Differs from the 25.11 row already in planner_published.py (GBS 512, "
        "GA 64, 292 tok/s, 737 TFLOP/s): GBS 1536 here. The same row appears in docs/performance-summary-archive.md "
        "('| DGX-H100 | 1024 | FP8 | 1536 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | n/a | 311 | 784 |'). 'Model TFLOP/sec/GPU: "
        "Model floating-point operations per second per GPU' (model FLOPs; exact formula not on the page). "
        "Megatron-Bridge performance recipes; DGX-H100 (GPU memory not stated on the page; DGX H100 = 80GB).",
    },
    # ==============================================================================================
    # NeMo Framework performance summary, "Container: NeMo 25.02" ("The table below shows the pre-training
    # performance of various models at FP8 precision (using NeMo 2.0)"). Columns: Model | #-GPUs | GBS | MBS |
    # Sequence Length | TP | PP | CP | VP | EP | GA | Tokens / sec / GPU | Model TFLOP / sec / GPU
    # ==============================================================================================
    # "System: DGX-H100" ... "GPT3-175B | 512 | 2048 | 2 | 2048 | 4 | 8 | 1 | 6 | 1 | 64 | 866 | 932"
    {
        "source": "NeMo performance summary (NeMo 25.02 container), DGX-H100 pre-training table",
        "url": _NEMO_2502,
        "model": {**_GPT3_175B_DGXC, "vocab": None,
                  "config": "NVIDIA/NeMo nemo/collections/llm/gpt/model/base.py GPTConfig175B (NeMo 2.0): 96 layers, "
                  "hidden 12288, ffn 49152, 96 heads, seq 2048; the table does not restate the architecture and the "
                  "vocab (from the tokenizer) is not stated. kv_heads = heads (MHA)."},
        "gpu": "H100",
        "gpus": 512,
        "gpus_per_node": None,
        "layout": {"tp": 4, "pp": 8, "cp": 1, "ep": 1, "virtual_stages": 6, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 2,
        "global_batch": 2048,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 866,
        "mfu": None,
        "tflops_per_gpu": 932,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "FP8 ROW. GA 64; implied dp = 512/(4*8) = 16 (= 2048/(2*64)). Same config as the NeMo 24.07 row "
        "already in planner_published.py (782 tok/s, 842 TFLOP/s) two releases later; the NeMo 24.12 page "
        "(https://docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html) "
        "has 'GPT3-175B 512 2048 2 2048 4 8 1 6 825 888' for the same config (system line not in the excerpt "
        "read). Read from the search tool's page excerpts of the stored 'latest' page whose text says "
        "'Container: NeMo 25.02'. DGX-H100; GPU memory not stated on the page.",
    },
    # same page, "System: DGX-B200" ... "GPT3-175B | 512 | 2048 | 2 | 2048 | 4 | 4 | 1 | 6 | 1 | 32 | 1600 | 1722"
    {
        "source": "NeMo performance summary (NeMo 25.02 container), DGX-B200 pre-training table",
        "url": _NEMO_2502,
        "model": {**_GPT3_175B_DGXC, "vocab": None,
                  "config": "NVIDIA/NeMo nemo/collections/llm/gpt/model/base.py GPTConfig175B (NeMo 2.0): 96 layers, "
                  "hidden 12288, ffn 49152, 96 heads, seq 2048; vocab not stated. kv_heads = heads (MHA)."},
        "gpu": "B200",
        "gpus": 512,
        "gpus_per_node": None,
        "layout": {"tp": 4, "pp": 4, "cp": 1, "ep": 1, "virtual_stages": 6, "schedule": "Interleaved1F1B"},
        "pipeline_layers": None,
        "seq_len": 2048,
        "micro_batch": 2,
        "global_batch": 2048,
        "global_batch_tokens": None,
        "recompute": None,
        "precision": "fp8",
        "tokens_per_s_per_gpu": 1600,
        "mfu": None,
        "tflops_per_gpu": 1722,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "FP8 ROW, B200. GA 32; implied dp = 512/(4*4) = 32 (= 2048/(2*32)). One page excerpt shows this "
        "row's TFLOP/s cell empty ('1600 |\\n|'), another shows '1600\\n\\n1722' -- the 1722 is from the "
        "latter excerpt of the same page. DGX-B200; B200 memory size not stated on the page (DGX B200 ships "
        "180GB-class B200s -- not from this source).",
    },
    # ==============================================================================================
    # GLM-130B (Zeng et al. 2022, ICLR 2023), sec. 2.3
    # ==============================================================================================
    # "GLM-130B is trained on a cluster of 96 DGX-A100 GPU (8×40G) servers with a 60-day access." ...
    # "we adopt 4-way tensor parallelism and 8-way pipeline parallelism ... Following the calculation in
    # (Chowdhery et al., 2022), we report hardware FLOPs utilization (HFU) of 43.3% and model FLOPs
    # utilization (MFU) of 32.5% due to re-materialization."
    {
        "source": "GLM-130B (arXiv 2210.02414), sec. 2.3",
        "url": _GLM130B,
        "model": _GLM_130B,
        "gpu": "A100",
        "gpus": 768,
        "gpus_per_node": 8,
        "layout": {"tp": 4, "pp": 8, "schedule": "1F1B"},
        "pipeline_layers": "9 layer slots per stage x 8 stages, minus one layer on the first and last stages "
        "('we balance the pipeline partition by removing one layer from them, making 9×8-2=70 transformer "
        "layers'): first and last stages 8 layers (+ word embedding), the six middle stages 9",
        "seq_len": 2048,
        "micro_batch": None,
        "global_batch": 4224,
        "global_batch_tokens": None,
        "recompute": None,
        "recompute_assumed": ("full", "re-materialization is stated, its granularity not; HFU/MFU = 43.3/32.5 = 4/3, "
                              "what recomputing the whole forward adds"),
        "precision": "bf16",
        "tokens_per_s_per_gpu": None,
        "mfu": 0.325,
        "tflops_per_gpu": None,
        "memory_gib": None,
        "flops_include_recompute": False,
        "notes": "PRECISION IS FP16, not bf16: 'mixed-precision ... strategy (Apex O2), i.e., FP16 for forwards and "
        "backwards and FP32 for optimizer states and master weights'. GPU memory: 40GB ('96 DGX-A100 GPU (8×40G) "
        "servers'; '40G rather than 80G A100s are used'). 96 x 8 = 768 GPUs; implied dp = 768/(4*8) = 24 (not "
        "stated). Schedule: 'we leverage the PipeDream-Flush ... implementation from DeepSpeed' (= 1F1B, "
        "non-interleaved). Global batch 4224 after warm-up ('We warm-up the batch size from 192 to 4224 over the "
        "first 2.5% samples'); whether the MFU is for the 4224 phase is not stated. HFU 43.3% (counts "
        "recompute); mfu field = the stated MFU 32.5% (model FLOPs). Activation recomputation is used ('due to "
        "re-materialization') but its granularity is not stated (HFU/MFU = 1.33 suggests full-layer). The "
        "[MASK]/multi-task objectives pack four 512-token samples into 2048. DeepSpeed/SwissArmyTransformer "
        "stack; DeepNorm post-LN. Stored copy id 68957833359 (arXiv HTML).",
    },
]


# ------------------------------------------------------------------------------------------------
# Sources looked at and not used (and why)
# ------------------------------------------------------------------------------------------------
# - Nemotron-4 340B technical report (arXiv 2406.11704), Table 2 (DP 16/32/64 on 1536/3072/6144 H100,
#   TP 8, PP 12 with interleaving, iteration 10.3/10.3/8.0 s, MFU 42.4/42.3/41.0%, batch 768/1536/2304):
#   only third-party transcriptions and notes were found in the index (several agree with each other),
#   never the report's own text -> left out per the verbatim rule. Worth adding if the report is read.
# - MT-NLG 530B (arXiv 2201.11990; 280/350/420 DGX A100, TP 8 PP 35, "126 ... 113 TFLOP/s"): only
#   second-hand mentions (a Reddit comment, a DeepSpeed blog sentence "showed the peak throughput of
#   126 TFLOPS/GPU") -- no verbatim table with GPU count, batch and throughput -> left out.
# - MegaScale (arXiv 2402.15627), Table 2 (175B, TP 8 PP 8 VP 6, 256..12288 GPUs, Megatron-LM baseline and
#   MegaScale rows with iteration time, tokens/s, MFU): the paper only says "NVIDIA Ampere GPUs" (A100 vs
#   A800 and memory size not stated; export controls make A800 plausible) and MegaScale's own rows use a
#   modified model (parallel transformer block, sliding-window attention, LAMB) -> left out. The
#   Megatron-LM baseline rows would be usable if the GPU type were confirmed.
# - Megatron-LM README (current): weak/strong scaling of GPT models up to 462B on up to 6144 H100, and
#   GPT-3 strong scaling "from 96 H100 GPUs to 4608 GPUs ... MFU from 47% to 42%" -- the per-config table
#   (TP/PP/batch) is an image (images/model_table.png), so no stated layout -> left out. The 2022 README's
#   MFU/HFU table (22B/175B/530B/1T) repeats Korthikanti et al. Table 5 without GPU counts (used the paper).
# - Narayanan et al. 2021 Table 2, 175B PTD-P rows (768 and 1536 GPUs, 149/141 TFLOP/s): the table gives
#   only "Model-parallel size 96" without the TP/PP split -> left out.
# - Megatron-Bridge 25.09 DGX-H100 row "LLAMA3.1_405B | 1024 | 512 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | 1 | 64 |
#   302 | 763": the 25.09 tables have no precision column and the page does not say which precision
#   they are -> left out.
# - NeMo / Megatron-Bridge tables for GB200/GB300 (not in the planner's GPU list) and all rows below 512
#   GPUs; NeMo 25.04/25.07 H100 rows at >= 512 GPUs were not visible in the page excerpts available.
# - Falcon-180B (model card / arXiv 2311.16867): "trained on up to 4,096 A100 40GB GPUs, using a 3D
#   parallelism strategy (TP=8, PP=8, DP=64) combined with ZeRO" but no throughput figure found -> left out.
# - BLOOM-176B (384 A100 80GB) and OPT-175B (992 A100, FSDP + TP, no PP): below 512 GPUs / no PP.
# - torchtitan paper (arXiv 2410.06511): its 405B 512-GPU 3D rows are the benchmark rows already in
#   planner_published.py.
# - Skywork-MoE (1536 A800, PP 12) and ERNIE 5.0: MoE and/or A800 -> out of scope.
# - NVIDIA/dgxc-benchmarking newer READMEs (nemotron4-340b/README.md, llama3.1/README.md): list configs
#   (e.g. Nemotron4 340B H100 TP8 PP8 VP12 at 256..2048 GPUs) but no performance tables.


PUBLISHED_RUNS += PIPELINED_AT_SCALE
