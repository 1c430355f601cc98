"""Supervised fine-tuning throughput, TRL's `SFTTrainer` beside `ultrascale fit --config recipes/hf_finetune.yaml`
(issue 77): target tokens/s (tokens that carry a loss, labels != -100) and the peak memory of each run, unpacked and
packed, for two Qwen2 sizes, 1 and 2 processes, fp32 and bf16-mixed, on CPU.

The fixture, built offline in a temp folder: a BPE tokenizer (tests/test_chat_data.py's `save_chat_tokenizer`, EOS
`<|endoftext|>`, pad `<pad>`, no BOS added), two `transformers.Qwen2Config` checkpoints saved with `save_pretrained`
(`12m`: 12 layers, hidden 256, MLP 1024, 4 heads, 2 KV heads, about 12M parameters; `140k`: 2 layers, hidden 64, MLP
192, about 140k), and `--records` (512) prompt/completion records of the tokenizer's words, lengths drawn
log-normal (about 130 tokens a record on average, 55 of them prompt, at most 256 with the EOS, so nothing is cut),
written twice: TRL's non-conversational prompt-completion form `{"prompt", "completion"}` and ultrascale's
`{"prompt", "response"}` JSONL. Before any timing the tokens and learned positions of every record are checked equal
on both sides (TRL appends EOS to the completion and tokenizes prompt + completion; ultrascale appends EOS after the
response, `prompt_template: "{prompt}"`; the prompts end on a newline, so no token spans the seam).

Four trainings per (size, precision, processes), each in a fresh process (tree) of its own:

* TRL default: `SFTTrainer` (TRL 1.16) on the prompt-completion records, completion-only loss, its collator padding
  each batch to its longest sequence (`packing=False`), `max_length=256`.
* TRL packed: the same with `packing=True` (best-fit decreasing into rows of `max_length=256`, padding-free: the 8
  rows of a step flattened into one with `position_ids`).
* ultrascale pack=False: `ultrascale fit --config recipes/hf_finetune.yaml --data.init_args.pack false
  --data.init_args.prompt_template "{prompt}"`: one record per block of `seq_len` 256, each rank's batch laid end to
  end in one row without padding (`padding_free`, the default for `HFCausalLM`; each record attends to itself alone).
* ultrascale pack=True: the same with `pack: true` (whole records next-fit into blocks of 256 inputs).

Everything else is the same on both sides: 8 sequences (records, or packed rows/blocks) per step, AdamW lr 1e-3 at
a constant rate (TRL `lr_scheduler_type="constant"`; ultrascale `warmup_steps 0, min_lr_ratio 1.0`), betas (0.9,
0.95), eps 1e-8, no weight decay (HFCausalLM's defaults; TRL's optimizer `adamw_torch_fused`, as HFCausalLM's),
clipping at global norm 1.0, SDPA attention, the weights in fp32; `bf16` is mixed precision on both (TRL
`bf16=True`, ultrascale `--trainer.precision bf16-mixed`); `fp32` is TRL `bf16=False` (SFTConfig turns bf16 on by
default, on CPU too) and ultrascale `32-true`. TRL's `gradient_checkpointing` (on by default in SFTConfig, off in the
recipe) is turned off so that both compute the same. 2 processes: TRL under DDP (`torchrun --standalone
--nproc-per-node 2`, gloo, 4 sequences per process), ultrascale with `--strategy` (default `ultrascale_zero1`) over 2
(`--trainer.devices 2`). ZeRO-1 is the like of DDP: parameters and gradients replicated, the gradients reduced once
per step in buckets, and only the optimizer state sharded. The recipe's ZeRO-3 (`--strategy ultrascale_zero3`) saves
the memory of a model that does not fit replicated, and costs more here: on gloo each block's all-gather and
reduce-scatter are host copies on the cores the compute uses (measured 2026-12-03 on 2 cores, fp32, pack=False, 3
alternating runs each: 12m 2.06-2.74 s a step against ZeRO-1's 1.21-1.56, 140k 0.089-0.175 against 0.071-0.127).
No validation, no checkpoint, a log line every step on both (TRL `logging_steps=1`, ultrascale `log_every_n_steps
1`).

What is timed: `--warmup` steps (3) are run first and not counted; the `--steps` (10) after them are, from the end
of the last warm-up step to the end of the last step: TRL's times from a `TrainerCallback.on_step_end` on rank 0,
ultrascale's from the wall times of the `train_loss` TensorBoard events (written when each step ends), as
benchmarks/peers/trl_sft.py does. Target tokens are counted from the data of those steps on both sides, not from a
logged rate: on TRL's side from the batches `training_step` receives (labels after the shift, summed over the
ranks); on ultrascale's by rebuilding its batches here (`InstructionDataModule` + `ResumableBlockSampler`, the same
seed and epochs), checked against the non-padding token count the run logged every step
(`throughput/tokens_seen`), which must match exactly. Peak memory: the largest sum of the resident set sizes of a
run's processes (the launcher, torchrun's agent and every rank included; pages shared between processes are counted
in each), sampled every 50 ms with psutil (a sample in which a process appeared counts no more than the one before: a
child forked and not yet exec'd counts its parent's pages twice for a moment, `PeakRss`); the largest single process too. Each figure is the
median of `--repeats` (3) runs; the four trainings of a repeat run one after another, in reversed order every other
repeat, so drift of the machine touches both sides alike. The ratios are ultrascale / TRL of those medians,
pack=False against TRL's default and pack=True against TRL packed; with 2 or more repeats the range of the
per-repeat ratios is given too.

Every process runs `--threads` intra-op threads (default 1: each TRL rank through `torch.set_num_threads` and
OMP_NUM_THREADS, each ultrascale rank through OMP_NUM_THREADS): on a 2-core machine that two ranks (and often other
processes) share, two OpenMP threads per process measured 30-40x slower steps (threads spinning in barriers waiting
for a core, benchmarks/peers/trl_sft.py), which would compare thread contention, not the trainers. With 1 thread a
1-process run uses one core and a 2-process run both.

    pip install -e ".[peers]"
    python benchmarks/peers/sft_throughput.py [--sizes 12m,140k] [--precisions fp32,bf16] [--processes 1,2] \
        [--steps 10] [--warmup 3] [--repeats 3] [--records 512] [--threads 1] [--out benchmarks/results/peers.md]
    # a smoke run: python benchmarks/peers/sft_throughput.py --sizes 140k --precisions fp32 --processes 1 \
    #     --steps 3 --warmup 2 --repeats 1 --records 128 --out /tmp/peers.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SEQ_LEN = 256  # recipes/hf_finetune.yaml's seq_len; TRL's max_length (packed row length, and the truncation length)
GLOBAL_BATCH = 8  # sequences per optimizer step, summed over the processes
LR = 1e-3
BETAS = (0.9, 0.95)  # HFCausalLM's defaults (the recipe sets none)
EPS = 1e-8
WEIGHT_DECAY = 0.0  # HFCausalLM's default, and TrainingArguments'
MAX_GRAD_NORM = 1.0  # the recipe's gradient_clip_val, and TrainingArguments' max_grad_norm
SEED = 1234  # the recipe's seed_everything and InstructionDataModule's default data seed; TRL's seed
EOS = "<|endoftext|>"

SIZES = {  # Qwen2Config fields; the vocabulary is the tokenizer's
    "12m": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 4,
            "num_key_value_heads": 2},
    "140k": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
}
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}  # ultrascale's --trainer.precision; TRL: bf16=False / True
VARIANTS = ("trl", "ultrascale", "trl_packed", "ultrascale_packed")
LABELS = {"trl": "TRL default", "ultrascale": "ultrascale pack=False", "trl_packed": "TRL packing=True",
          "ultrascale_packed": "ultrascale pack=True"}


# ----------------------------------------------------------------------------- the fixture


def make_records(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, completion) pairs of the tokenizer's words: log-normal lengths, the prompt ending on a newline."""
    import numpy as np

    from tests.test_chat_data import WORDS

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(np.clip(rng.lognormal(np.log(36), 0.7), 4, 160))
        c = int(np.clip(rng.lognormal(np.log(56), 0.8), 2, 228 - p))  # <= 256 tokens with the rest
        prompt = f"question {i}: " + " ".join(rng.choice(WORDS, p)) + "\n"
        out.append((prompt, " ".join(rng.choice(WORDS, c))))
    return out


def make_fixture(root: Path, sizes: list[str], records: int) -> tuple[dict[str, Path], dict[str, int], Path, Path]:
    """({size: checkpoint folder with the tokenizer}, {size: parameters}, TRL JSONL, ultrascale JSONL)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tests.test_chat_data import save_chat_tokenizer

    save_chat_tokenizer(root / "tokenizer", eos=EOS)  # one tokenizer, copied into every checkpoint folder
    folders, params = {}, {}
    for size in sizes:
        folder = root / f"qwen2_{size}"
        shutil.copytree(root / "tokenizer", folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        config = Qwen2Config(
            vocab_size=len(tokenizer), max_position_embeddings=2 * SEQ_LEN, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, **SIZES[size],
        )
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        params[size] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)  # safetensors, fp32: both sides load these weights
        folders[size] = folder
    pairs = make_records(records)
    trl_data, us_data = root / "trl.jsonl", root / "ultrascale.jsonl"
    trl_data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    us_data.write_text("".join(json.dumps({"prompt": p, "response": c}) + "\n" for p, c in pairs))
    return folders, params, trl_data, us_data


# ----------------------------------------------------------------------------- TRL (this file, run as a worker)


def trl_worker(spec_path: str) -> None:
    """One TRL training (or, with `check`, only its data preparation), as given by the JSON file `spec_path`; run
    directly or by torchrun. Each rank writes `rank{N}.json` into the spec's `out` folder."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    class StepEnds(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

    class CountingSFTTrainer(SFTTrainer):
        """SFTTrainer counting what each step computes: the targets (labels after the model's shift that are not
        -100), the positions, the non-padding positions."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.counts: list[tuple[int, int, int]] = []

        def training_step(self, model, inputs, *args, **kwargs):
            labels, ids = inputs["labels"], inputs["input_ids"]
            mask = inputs.get("attention_mask")
            content = int(mask.sum()) if mask is not None else ids.numel()
            self.counts.append((int((labels[:, 1:] != -100).sum()), ids.numel(), content))
            return super().training_step(model, inputs, *args, **kwargs)

    config = SFTConfig(
        output_dir=str(Path(spec["out"]) / "trl"),
        packing=spec["packing"],
        max_length=SEQ_LEN,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        gradient_accumulation_steps=1,
        max_steps=spec["max_steps"],
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch_fused",
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        bf16=spec["bf16"],
        fp16=False,
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=SEED,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
    )
    dataset = load_dataset("json", data_files=spec["data"], split="train",
                           cache_dir=str(Path(spec["out"]) / "hf_datasets"))
    timer = StepEnds()
    trainer = CountingSFTTrainer(model=spec["model"], args=config, train_dataset=dataset, callbacks=[timer])
    result: dict = {"rows": len(trainer.train_dataset),
                    "row_tokens": sum(len(r) for r in trainer.train_dataset["input_ids"])}
    if spec.get("check"):
        result["prepared"] = [[list(r["input_ids"]), list(r["labels"])] for r in trainer.train_dataset]
    else:
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        result.update(ends=timer.ends, counts=trainer.counts, losses=[e["loss"] for e in logs],
                      learning_rates=sorted({e["learning_rate"] for e in logs}))
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))


def trl_command(spec_path: Path, processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, str(Path(__file__).resolve()), "_trl", str(spec_path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            str(Path(__file__).resolve()), "_trl", str(spec_path)]


# ----------------------------------------------------------------------------- ultrascale


def ultrascale_command(folder: Path, data: Path, logs: Path, processes: int, max_steps: int, precision: str,
                       pack: bool, strategy: str) -> list[str]:
    exe = Path(sys.executable).with_name("ultrascale")
    return [
        str(exe) if exe.exists() else "ultrascale", "fit", "--config", str(ROOT / "recipes" / "hf_finetune.yaml"),
        "--model.pretrained_path", str(folder), "--data.data_path", str(data),
        "--trainer.devices", str(processes), "--trainer.strategy", strategy, "--trainer.max_steps", str(max_steps),
        "--trainer.precision", precision,
        "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        # the recipe's ModelCheckpoint: no step checkpoints, no last one
        "--trainer.callbacks.init_args.every_n_train_steps", "0", "--trainer.callbacks.init_args.save_last", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(logs),
        "--model.init_args.learning_rate", repr(LR),
        "--model.init_args.warmup_steps", "0", "--model.init_args.min_lr_ratio", "1.0",  # constant
        "--model.init_args.attn_implementation", "sdpa",
        "--data.init_args.pack", "true" if pack else "false",
        "--data.init_args.prompt_template", "{prompt}",
        "--data.init_args.val_fraction", "0",
        "--data.init_args.global_batch_size", str(GLOBAL_BATCH), "--data.init_args.seq_len", str(SEQ_LEN),
    ]


def ultrascale_data(folder: Path, data: Path, pack: bool):
    from ultrascale.data import InstructionDataModule

    dm = InstructionDataModule(data_path=str(data), tokenizer_path=str(folder), prompt_template="{prompt}",
                               seq_len=SEQ_LEN, pack=pack, val_fraction=0.0, global_batch_size=GLOBAL_BATCH)
    dm.setup()
    return dm


def ultrascale_step_counts(dm, max_steps: int, processes: int, precision: str) -> list[tuple[int, int, int]]:
    """(targets, positions, non-padding positions) of each of the run's first `max_steps` steps, from its data: the
    same blocks, sampler, seed and epochs as the run, each rank's share collated as the run collates it for
    `HFCausalLM` on the CPU (`padding_free` by default: `PaddingFree` at the CPU's multiple for `precision`, the rows
    end to end; with `padding_free: false`, `PadToLongest`)."""
    import torch

    from ultrascale.data import ResumableBlockSampler
    from ultrascale.data.collate import PaddingFree, PadToLongest
    from ultrascale.parallel.device import compute_dtype, sequence_length_multiple
    from ultrascale.parallel.loss import content_lengths

    multiple = sequence_length_multiple(torch.device("cpu"), compute_dtype(PRECISIONS[precision]))
    collate = (PadToLongest(multiple, dm.seq_len) if dm.padding_free is False
               else PaddingFree(multiple, dm.seq_len, dm.pad_id))

    dataset = dm.train_dataset
    sampler = ResumableBlockSampler(dataset, GLOBAL_BATCH, shuffle=True, seed=dm.seed)
    labels = torch.from_numpy(dataset.labels.astype("int64"))
    positions = torch.from_numpy(dataset.position_ids.astype("int64"))
    lengths = content_lengths(positions, labels)  # (num_blocks,)
    batches = sampler.num_global_batches
    out, order = [], None
    for step in range(max_steps):
        epoch, b = divmod(step, batches)
        if b == 0:
            sampler.set_epoch(epoch)
            order = sampler.global_batches()  # (num_global_batches, G)
        rows = order[b]
        targets = int((labels[rows] != -100).sum())
        local = rows.view(processes, -1)  # (dp, G // dp): rank r's slice
        computed = sum(collate([dataset[i] for i in r.tolist()])["input_ids"].numel() for r in local)
        out.append((targets, computed, int(lengths[rows].sum())))
    return out


def read_events(logs: Path) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(logs.rglob("events.out.tfevents.*"))
    if len(events) != 1:
        raise RuntimeError(f"expected one TensorBoard event file under {logs}, found {events}")
    checkpoints = sorted(logs.rglob("*.ckpt"))
    if checkpoints:
        raise RuntimeError(f"the run saved checkpoints, which it should not: {checkpoints}")
    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    losses = sorted(acc.Scalars("train_loss"), key=lambda e: e.step)
    seen = sorted(acc.Scalars("throughput/tokens_seen"), key=lambda e: e.step)
    return {"ends": [e.wall_time for e in losses], "losses": [e.value for e in losses],
            "tokens_seen": [e.value for e in seen]}


# ----------------------------------------------------------------------------- running a command, measured


class PeakRss:
    """The peak of the sum of the resident set sizes of a process and all its descendants, sampled every `period`
    s, and the peak of the largest one of them. A child forked and not yet exec'd (`subprocess` from a rank)
    counts its parent's pages a second time for a moment, so a sample in which a process appeared counts no more
    than the sample before it."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.pid, self.period = pid, period
        self.peak = self.largest = self.processes = 0
        self.cpu: dict[int, float] = {}  # CPU seconds (user + system) each process of the tree was last seen at
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        previous = count = 0
        while not self._stop.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            sizes = []
            for p in tree:
                try:
                    sizes.append(p.memory_info().rss)
                    times = p.cpu_times()
                    self.cpu[p.pid] = times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            total = sum(sizes)
            self.peak = max(self.peak, min(previous, total) if len(sizes) > count else total)
            self.largest, self.processes = max(self.largest, *sizes, 0), max(self.processes, len(sizes))
            previous, count = total, len(sizes)
            self._stop.wait(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(command: list[str], threads: int, log: Path) -> dict:
    """Run `command` to its end: its wall seconds, peak memory, and the share of the machine's cores that other
    processes used meanwhile. That share is the machine's busy CPU time less this process's and that of every process
    of the run's tree as sampled (`_common.ForeignLoad` counts the children a process waited for, and Lightning's
    script launcher does not wait for its child ranks: their CPU would pass for another process's)."""
    import resource

    from _common import _machine_busy_s, cores

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    def own_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    busy, own = _machine_busy_s(), own_s()
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        rss = PeakRss(proc.pid)
        code = proc.wait()
    peak = rss.stop()
    seconds = time.perf_counter() - started
    others = (_machine_busy_s() - busy) - (own_s() - own) - sum(rss.cpu.values())
    foreign = max(0.0, others) / (seconds * cores())
    if code != 0:
        text = log.read_text()
        sys.stderr.write(text[-8000:])
        last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "no output")
        raise RuntimeError(f"exited {code} ({last[:200]}): {' '.join(command)}")
    return {"seconds": seconds, "foreign": foreign, "peak_rss": peak, "largest_rss": rss.largest,
            "processes": rss.processes}


def rate(ends: list[float], counts: list[tuple[int, int, int]], warmup: int) -> dict:
    """Target tokens/s of the steps after the first `warmup`: from the end of step `warmup` to the end of the last."""
    timed = counts[warmup:]
    seconds = ends[-1] - ends[warmup - 1] if warmup > 0 else None
    if seconds is None:
        raise ValueError("--warmup must be >= 1: the first timed step starts where a warm-up step ends")
    targets = sum(c[0] for c in timed)
    return {"targets_per_s": targets / seconds, "step_s": seconds / len(timed), "targets_per_step": targets / len(timed),
            "padding": 1 - sum(c[2] for c in timed) / sum(c[1] for c in timed),
            "positions_per_step": sum(c[1] for c in timed) / len(timed)}


def run_trl(work: Path, folder: Path, data: Path, processes: int, precision: str, packed: bool, max_steps: int,
            warmup: int, threads: int) -> dict:
    out = work / "out"
    out.mkdir(parents=True)
    spec = {"model": str(folder), "data": str(data), "packing": packed, "bf16": precision == "bf16",
            "max_steps": max_steps, "threads": threads, "out": str(out)}
    (work / "spec.json").write_text(json.dumps(spec))
    measured = run_measured(trl_command(work / "spec.json", processes), threads, work / "log.txt")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]
    if ranks[0]["learning_rates"] != [LR]:
        raise RuntimeError(f"TRL's learning rate was not constant at {LR}: {ranks[0]['learning_rates']}")
    counts = [tuple(map(sum, zip(*step))) for step in zip(*(r["counts"] for r in ranks))]  # summed over the ranks
    ends = ranks[0]["ends"]
    if len(ends) != max_steps or len(counts) != max_steps:
        raise RuntimeError(f"TRL: {len(ends)} step ends / {len(counts)} steps counted, expected {max_steps}")
    return {**measured, **rate(ends, counts, warmup), "rows": ranks[0]["rows"], "losses": ranks[0]["losses"]}


def run_ultrascale(work: Path, folder: Path, data: Path, processes: int, precision: str, packed: bool,
                   max_steps: int, warmup: int, threads: int, counts: list[tuple[int, int, int]],
                   strategy: str) -> dict:
    logs = work / "runs"
    work.mkdir(parents=True)
    command = ultrascale_command(folder, data, logs, processes, max_steps, PRECISIONS[precision], packed, strategy)
    measured = run_measured(command, threads, work / "log.txt")
    events = read_events(logs)
    if len(events["ends"]) != max_steps:
        raise RuntimeError(f"ultrascale: {len(events['ends'])} steps logged, expected {max_steps}")
    # The rebuilt batches are the ones the run trained on: their non-padding tokens add up to what it logged.
    cumulative = [sum(c[2] for c in counts[: i + 1]) for i in range(max_steps)]
    if [int(v) for v in events["tokens_seen"]] != cumulative:
        raise RuntimeError(f"ultrascale logged tokens_seen {events['tokens_seen']}, its rebuilt batches hold "
                           f"{cumulative}: the rebuilt data is not what it trained on")
    return {**measured, **rate(events["ends"], counts, warmup), "losses": events["losses"]}


# ----------------------------------------------------------------------------- the token check


def check_same_tokens(work: Path, folder: Path, trl_data: Path, us_data: Path, threads: int) -> dict:
    """TRL's prepared rows (ids, labels unshifted) against InstructionDataModule's blocks (inputs, labels shifted),
    record by record; returns TRL's packed row count and the data's token counts."""
    import numpy as np

    rows = {}
    for packed in (False, True):
        out = work / f"check_{int(packed)}"
        out.mkdir(parents=True)
        spec = {"model": str(folder), "data": str(trl_data), "packing": packed, "bf16": False, "max_steps": 1,
                "threads": threads, "out": str(out), "check": True}
        (out / "spec.json").write_text(json.dumps(spec))
        run_measured(trl_command(out / "spec.json", 1), threads, out / "log.txt")
        rows[packed] = json.loads((out / "rank0.json").read_text())
    prepared = rows[False]["prepared"]
    dm = ultrascale_data(folder, us_data, pack=False)
    blocks = dm.packed
    if len(blocks.examples) != len(prepared):
        raise RuntimeError(f"ultrascale kept {len(blocks.examples)} records, TRL {len(prepared)}")
    targets = 0
    for block, (index,) in enumerate(blocks.examples):
        ids, labels = prepared[index]
        n = len(ids) - 1
        if not np.array_equal(blocks.input_ids[block, :n], ids[:-1]) or ids[-1] != dm.tokenizer.eos_id:
            raise RuntimeError(f"record {index}: other input tokens on the two sides")
        if not np.array_equal(blocks.labels[block, :n], labels[1:]) or (blocks.labels[block, n:] != -100).any():
            raise RuntimeError(f"record {index}: other learned positions on the two sides")
        targets += int((np.asarray(labels[1:]) != -100).sum())
    packed_dm = ultrascale_data(folder, us_data, pack=True)
    return {"records": len(prepared), "tokens": sum(len(ids) for ids, _ in prepared), "targets": targets,
            "longest": max(len(ids) for ids, _ in prepared), "shortest": min(len(ids) for ids, _ in prepared),
            "trl_packed_rows": rows[True]["rows"], "ultrascale_blocks": packed_dm.packed.num_blocks,
            "ultrascale_density": packed_dm.packed.density}


# ----------------------------------------------------------------------------- the tables


def run_retrying_once(run, label: str, retried: list[str]) -> dict:
    """`run(1)`, or where it fails `run(2)`: a process that crashes once (TRL's 2-process DDP ended once with
    "terminate called without an active exception" after its last step) does not throw away the runs before it. The
    failure is kept in `retried` for the results; a second failure ends the benchmark."""
    try:
        return run(1)
    except RuntimeError as error:
        reason = str(error).split(": ", 1)[0]
        retried.append(f"{label}: {reason}")
        print(f"{label}: failed ({reason}); running it once more", flush=True)
        return run(2)


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def ratio_text(us: list[dict], trl: list[dict], key: str = "targets_per_s") -> str:
    text = f"{median(us, key) / median(trl, key):.2f}"
    if len(us) > 1:
        pairs = [u[key] / t[key] for u, t in zip(us, trl)]
        text += f" ({min(pairs):.2f}-{max(pairs):.2f})"
    return text


def tables(results: dict, params: dict, data: dict, options, versions: str, machine_line: str,
           wall: float, retried: list[str]) -> tuple[list[str], list[str]]:
    """(markdown lines, one summary line per row for stdout)."""
    lines = [
        f"Target tokens/s (tokens with a loss) of supervised fine-tuning: TRL `SFTTrainer` against `ultrascale fit "
        f"--config recipes/hf_finetune.yaml --trainer.strategy {options.strategy}` (TRL's 2 processes: DDP), written by "
        f"benchmarks/peers/sft_throughput.py. {data['records']} "
        f"prompt/completion records of {data['shortest']}-{data['longest']} tokens ({data['tokens']:,} tokens, "
        f"{data['targets']:,} of them targets), checked token for token equal on both sides; 8 sequences per step "
        f"(records, or packed rows of {SEQ_LEN}: TRL {data['trl_packed_rows']} rows best-fit, ultrascale "
        f"{data['ultrascale_blocks']} blocks next-fit, {100 * data['ultrascale_density']:.0f}% full), AdamW lr {LR:g} "
        f"constant, betas {BETAS}, clip {MAX_GRAD_NORM:g}, CPU. {options.steps} timed steps after {options.warmup} "
        f"warm-up steps, median of {options.repeats} run(s) per figure (range of the per-run ratios in brackets). "
        f"{versions}",
        f"Machine: {machine_line}. The whole benchmark took {wall / 60:.1f} min. Command: `python "
        f"benchmarks/peers/sft_throughput.py {' '.join(sys.argv[1:])}`. "
        + (f"Runs that failed once and were run again: {'; '.join(retried)}." if retried else "No run failed."),
        "",
        "| model | precision | processes | TRL default | ultrascale pack=False | ratio | TRL packing=True | "
        "ultrascale pack=True | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    for (size, precision, processes), runs in results.items():
        model = f"Qwen2 {size} ({params[size] / 1e6:.2f}M)"
        cells = [f"{median(runs[v], 'targets_per_s'):,.0f}" for v in VARIANTS]
        unpacked, packed = ratio_text(runs["ultrascale"], runs["trl"]), ratio_text(runs["ultrascale_packed"], runs["trl_packed"])
        lines.append(f"| {model} | {precision} | {processes} | {cells[0]} | {cells[1]} | {unpacked} | {cells[2]} | "
                     f"{cells[3]} | {packed} |")
        summary.append(f"{size} {precision} {processes}p: pack=False/TRL default {unpacked}, "
                       f"pack=True/TRL packed {packed}")
    lines += [
        "",
        "Peak memory: the largest sum of the resident set sizes of a run's processes (MiB; the launcher, torchrun's "
        "agent and every rank, pages shared between processes counted in each), and ultrascale / TRL.",
        "",
        "| model | precision | processes | TRL default | ultrascale pack=False | ratio | TRL packing=True | "
        "ultrascale pack=True | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (size, precision, processes), runs in results.items():
        mib = [f"{median(runs[v], 'peak_rss') / 2**20:,.0f}" for v in VARIANTS]
        lines.append(f"| {size} | {precision} | {processes} | {mib[0]} | {mib[1]} | "
                     f"{median(runs['ultrascale'], 'peak_rss') / median(runs['trl'], 'peak_rss'):.2f} | {mib[2]} | "
                     f"{mib[3]} | {median(runs['ultrascale_packed'], 'peak_rss') / median(runs['trl_packed'], 'peak_rss'):.2f} |")
    lines += [
        "",
        "Per run (medians): seconds per timed step, target tokens per step, positions computed per step, the share "
        "of them that is padding, the loss of the first step (of the first run), the peak RSS of the run's largest "
        "process, the whole command's wall seconds "
        "(start-up included), and the share of the cores other processes used meanwhile. TRL's sampler and "
        "ultrascale's draw the same permutation from seed 1234, so unpacked both train on the same batches (their "
        "first losses agree); TRL's padded rows hold the last token as an input too, one position more per row.",
        "",
        "| model | precision | processes | run | s/step | targets/step | positions/step | padding | loss, step 1 | "
        "largest process MiB | wall s | other processes |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (size, precision, processes), runs in results.items():
        for v in VARIANTS:
            r = runs[v]
            lines.append(f"| {size} | {precision} | {processes} | {LABELS[v]} | {median(r, 'step_s'):.3f} | "
                         f"{median(r, 'targets_per_step'):,.0f} | {median(r, 'positions_per_step'):,.0f} | "
                         f"{100 * median(r, 'padding'):.0f}% | {r[0]['losses'][0]:.4f} | "
                         f"{median(r, 'largest_rss') / 2**20:,.0f} | {median(r, 'seconds'):.1f} | "
                         f"{100 * median(r, 'foreign'):.0f}% |")
    return lines, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="12m,140k", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--precisions", default="fp32,bf16", help=f"comma-separated, of {', '.join(PRECISIONS)}")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts (1 or 2 on this CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--records", type=int, default=512, help="prompt/completion records")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every process, both sides")
    parser.add_argument("--strategy", default="ultrascale_zero1",
                        help="ultrascale's --trainer.strategy (the recipe's is ultrascale_zero3)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peers.md"))
    options = parser.parse_args()
    sizes, precisions = options.sizes.split(","), options.precisions.split(",")
    processes_list = [int(p) for p in options.processes.split(",")]
    for name, given, valid in (("--sizes", sizes, SIZES), ("--precisions", precisions, PRECISIONS)):
        if not set(given) <= set(valid):
            parser.error(f"{name} {','.join(given)}: valid are {', '.join(valid)}")
    if options.warmup < 1 or options.steps < 1 or options.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be >= 1")
    if any(GLOBAL_BATCH % p for p in processes_list):
        parser.error(f"--processes must divide the batch of {GLOBAL_BATCH}")

    import lightning
    import torch
    import transformers
    import trl
    from _common import machine, write_results

    torch.set_num_threads(options.threads)
    versions = (f"{options.threads} intra-op thread(s) per process; torch {torch.__version__}, transformers "
                f"{transformers.__version__}, trl {trl.__version__}, lightning {lightning.__version__}.")
    max_steps = options.warmup + options.steps
    started = time.perf_counter()
    results: dict = {}
    retried: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sft_throughput_") as tmp:
        work = Path(tmp)
        folders, params, trl_data, us_data = make_fixture(work, sizes, options.records)
        data = check_same_tokens(work / "check", folders[sizes[-1]], trl_data, us_data, options.threads)
        print(f"{data['records']} records, {data['tokens']:,} tokens ({data['shortest']}-{data['longest']} each), "
              f"{data['targets']:,} targets: the same on both sides. Packed rows of {SEQ_LEN}: TRL "
              f"{data['trl_packed_rows']}, ultrascale {data['ultrascale_blocks']}; "
              + ", ".join(f"{s}: {params[s]:,} parameters" for s in sizes), flush=True)
        dms = {pack: ultrascale_data(folders[sizes[-1]], us_data, pack) for pack in (False, True)}
        n = 0
        for size in sizes:
            for precision in precisions:
                for processes in processes_list:
                    counts = {pack: ultrascale_step_counts(dms[pack], max_steps, processes, precision)
                              for pack in (False, True)}
                    runs: dict[str, list] = {v: [] for v in VARIANTS}
                    for repeat in range(options.repeats):
                        for variant in (VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]):
                            n += 1
                            packed = variant.endswith("_packed")

                            def run(attempt: int) -> dict:
                                run_dir = work / f"run{n}_{variant}_{attempt}"
                                if variant.startswith("trl"):
                                    return run_trl(run_dir, folders[size], trl_data, processes, precision, packed,
                                                   max_steps, options.warmup, options.threads)
                                return run_ultrascale(run_dir, folders[size], us_data, processes, precision, packed,
                                                      max_steps, options.warmup, options.threads, counts[packed],
                                                      options.strategy)

                            label = f"{size} {precision} {processes}p #{repeat + 1} {LABELS[variant]}"
                            r = run_retrying_once(run, label, retried)
                            runs[variant].append(r)
                            print(f"{size} {precision} {processes}p #{repeat + 1} {LABELS[variant]}: "
                                  f"{r['targets_per_s']:,.0f} target tokens/s ({r['step_s']:.3f} s/step, "
                                  f"{r['targets_per_step']:.0f} targets/step, {100 * r['padding']:.0f}% padding), "
                                  f"peak RSS {r['peak_rss'] / 2**20:,.0f} MiB, {r['seconds']:.1f} s, other "
                                  f"processes {100 * r['foreign']:.0f}%", flush=True)
                    results[(size, precision, processes)] = runs
    wall = time.perf_counter() - started
    lines, summary = tables(results, params, data, options, versions, machine(), wall, retried)
    write_results("\n".join(lines) + "\n", options.out)
    print("\n".join(summary))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_trl":
        trl_worker(sys.argv[2])
    else:
        main()
