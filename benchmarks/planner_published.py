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
