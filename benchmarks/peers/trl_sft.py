"""TRL's `SFTTrainer` against ultrascale's chat fine-tuning: the same checkpoint, conversations and optimizer, run as
each one's users run it; the per-step losses side by side, and tokens/s.

One tiny Hugging Face checkpoint (a `LlamaConfig` of 2 layers, hidden 64, 4 heads, 2 KV heads, saved with
`save_pretrained`) and its tokenizer (tests/test_chat_data.py's offline BPE tokenizer, its ChatML template with
`{% generation %}` markers, EOS `<|im_end|>`) in a temp folder, and 8 conversations of 1-3 exchanges, 6 with a system
prompt (tests/test_chat_data.py's `conversations`) as JSONL `{"messages": [...]}`. Both sides load those saved weights,
learn the assistant turns and their `<|im_end|>` only, and train 10 optimizer steps of one global batch of all 8
conversations, fp32 on CPU, AdamW at a constant learning rate (no warm-up, no decay), the same betas, eps, weight
decay (matrices only on both: HF's `get_decay_parameter_names` leaves out the norms, ultrascale decays ndim >= 2)
and gradient clipping at global norm 1.0:

* TRL: `trl.SFTTrainer` in this process, `SFTConfig(assistant_only_loss=True, packing=False,
  per_device_train_batch_size=8, max_steps=10, lr_scheduler_type="constant", warmup_steps=0, ...)`; the loss of
  each step from `trainer.state.log_history`, its end time from a `TrainerCallback`'s `on_step_end`.
* ultrascale: `ultrascale fit --config recipes/hf_chat.yaml --model.pretrained_path DIR --data.data_path FILE ...`
  in a subprocess, once on 1 process (`--trainer.devices 1`) and once as the recipe runs, ZeRO-3 over 2 processes;
  a constant schedule is `warmup_steps=0, min_lr_ratio=1.0` (`ultrascale.models.lm.warmup_cosine` is then 1 at every
  step); no packing, no validation, no checkpoint. Each step's `train_loss` and end time from the TensorBoard event
  file.

Before training, the tokens and learned positions of every conversation are checked equal on both sides (TRL's
prepared dataset against `InstructionDataModule`'s blocks). The table gives the losses per step, the largest
relative difference from TRL (the script exits 1 above `--tolerance`, 1e-5), and tokens/s of each run: the real
(non-padding) tokens of the 8 conversations per step over the steady-state steps 2..10 (end of step 1 to end of
step 10). TRL pads each batch to its longest conversation, and so does ultrascale (`pack: false`, `pad_to: longest`,
`seq_len` set to the longest conversation's input length): both compute the same positions. TRL's
`gradient_checkpointing` (its default is on, recipes/hf_chat.yaml's off) is turned off so that both do the same work.
Every process runs `--threads` intra-op threads (default 1: TRL's process, and each ultrascale rank through
OMP_NUM_THREADS): on a 2-core machine that other processes share, two OpenMP threads per process measured 30-40x
slower steps (threads waiting in barriers for a core), which would compare thread contention, not the trainers.

    pip install -e ".[peers]"
    python benchmarks/peers/trl_sft.py [--lr 1e-3] [--weight-decay 0.1] [--steps 10] [--threads 1] \
        [--out benchmarks/results/trl_sft.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import ForeignLoad, machine, write_results  # noqa: E402

from tests.test_chat_data import CHATML_MARKED, conversations, save_chat_tokenizer, write_jsonl  # noqa: E402

GLOBAL_BATCH = 8  # conversations per step: the whole data set
BETAS = (0.9, 0.95)  # HFCausalLM's defaults (recipes/hf_chat.yaml sets none)
EPS = 1e-8  # HFCausalLM's default, and TrainingArguments'
MAX_GRAD_NORM = 1.0  # recipes/hf_chat.yaml's gradient_clip_val, and TrainingArguments' max_grad_norm


# ----------------------------------------------------------------------------- the shared checkpoint and data


def make_fixture(root: Path) -> tuple[Path, Path]:
    """(checkpoint folder with its tokenizer, conversations JSONL)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = root / "tiny_llama"
    save_chat_tokenizer(folder, CHATML_MARKED, eos="<|im_end|>")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)  # safetensors, fp32; both sides load these weights
    data = Path(write_jsonl(root / "chats.jsonl", [{"messages": m} for m in conversations(GLOBAL_BATCH)]))
    return folder, data


def chat_ids(folder: Path, data: Path) -> list[list[int]]:
    """Each conversation's token ids as the chat template renders them (what both sides train on)."""
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    out = []
    for line in data.read_text().splitlines():
        ids = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


# ----------------------------------------------------------------------------- TRL


def run_trl(folder: Path, data: Path, work: Path, steps: int, lr: float, weight_decay: float) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

    config = SFTConfig(
        output_dir=str(work / "trl"),
        assistant_only_loss=True,
        packing=False,
        per_device_train_batch_size=GLOBAL_BATCH,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch_fused",  # HFCausalLM's AdamW is fused too (ultrascale.estimate.ADAMW_KERNEL)
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=weight_decay,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        max_length=None,
        disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
    )
    dataset = load_dataset("json", data_files=str(data), split="train", cache_dir=str(work / "hf_datasets"))
    timer = StepTimes()
    trainer = SFTTrainer(model=str(folder), args=config, train_dataset=dataset, callbacks=[timer])
    prepared = [(list(r["input_ids"]), list(r["labels"])) for r in trainer.train_dataset]
    trainer.create_optimizer()
    decayed = {id(p) for g in trainer.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    matrices = {id(p) for p in trainer.model.parameters() if p.ndim >= 2}
    if weight_decay > 0 and decayed != matrices:
        names = sorted(n for n, p in trainer.model.named_parameters() if (id(p) in decayed) != (id(p) in matrices))
        raise RuntimeError(f"TRL decays other parameters than ultrascale (matrices only): {names}")
    load = ForeignLoad()
    load.start()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    rates = {entry["learning_rate"] for entry in logs}
    if rates != {lr}:
        raise RuntimeError(f"TRL's learning rate was not constant at {lr}: {sorted(rates)}")
    return {"losses": [e["loss"] for e in logs], "grad_norms": [e["grad_norm"] for e in logs], "ends": timer.ends,
            "seconds": seconds, "foreign": load.stop(), "prepared": prepared}


# ----------------------------------------------------------------------------- ultrascale


def ultrascale_command(folder: Path, data: Path, logs: Path, devices: int, steps: int, seq_len: int, lr: float,
                       weight_decay: float) -> list[str]:
    exe = Path(sys.executable).with_name("ultrascale")
    return [
        str(exe) if exe.exists() else "ultrascale", "fit", "--config", str(ROOT / "recipes" / "hf_chat.yaml"),
        "--model.pretrained_path", str(folder), "--data.data_path", str(data),
        "--trainer.devices", str(devices), "--trainer.max_steps", str(steps),
        "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.callbacks.init_args.save_last", "false",  # the recipe's ModelCheckpoint: nothing saved in 10 steps
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(logs),
        "--model.init_args.learning_rate", repr(lr),
        "--model.init_args.warmup_steps", "0", "--model.init_args.min_lr_ratio", "1.0",  # constant
        "--model.init_args.weight_decay", repr(weight_decay),
        "--data.init_args.pack", "false", "--data.init_args.val_fraction", "0",
        "--data.init_args.global_batch_size", str(GLOBAL_BATCH), "--data.init_args.seq_len", str(seq_len),
    ]


def run_ultrascale(command: list[str], logs: Path, threads: int) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    load = ForeignLoad()
    load.start()
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # every rank, the re-launched ones too
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    foreign = load.stop()
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise RuntimeError(f"ultrascale fit exited {done.returncode}: {' '.join(command)}")
    events = sorted(logs.rglob("events.out.tfevents.*"))
    if len(events) != 1:
        raise RuntimeError(f"expected one TensorBoard event file under {logs}, found {events}")
    checkpoints = sorted(logs.rglob("*.ckpt"))
    if checkpoints:
        raise RuntimeError(f"the run saved checkpoints, which it should not: {checkpoints}")
    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    losses = sorted(acc.Scalars("train_loss"), key=lambda e: e.step)
    norms = sorted(acc.Scalars("grad_norm"), key=lambda e: e.step)
    return {"losses": [e.value for e in losses], "grad_norms": [e.value for e in norms],
            "ends": [e.wall_time for e in losses], "seconds": seconds, "foreign": foreign}


# ----------------------------------------------------------------------------- checks and the table


def check_same_tokens(trl_prepared: list, folder: Path, data: Path, seq_len: int) -> None:
    """TRL's prepared rows (ids, labels unshifted) against InstructionDataModule's blocks (inputs, labels shifted)."""
    import numpy as np

    from ultrascale.data import InstructionDataModule

    dm = InstructionDataModule(data_path=str(data), tokenizer_path=str(folder), seq_len=seq_len, pack=False,
                               val_fraction=0.0, global_batch_size=GLOBAL_BATCH)
    dm.setup()
    assert dm.packed is not None
    if len(dm.packed.examples) != len(trl_prepared):
        raise RuntimeError(f"ultrascale kept {len(dm.packed.examples)} conversations, TRL {len(trl_prepared)}")
    for block, (index,) in enumerate(dm.packed.examples):
        ids, labels = trl_prepared[index]
        n = len(ids) - 1
        if not np.array_equal(dm.packed.input_ids[block, :n], ids[:-1]):
            raise RuntimeError(f"conversation {index}: other input tokens on the two sides")
        if not np.array_equal(dm.packed.labels[block, :n], labels[1:]) or (dm.packed.labels[block, n:] != -100).any():
            raise RuntimeError(f"conversation {index}: other learned positions on the two sides")


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def tokens_per_s(ends: list[float], tokens_per_step: int) -> float:
    """Steps 2..N: from the end of step 1 to the end of step N."""
    return (len(ends) - 1) * tokens_per_step / (ends[-1] - ends[0])


def table(runs: dict[str, dict], tokens_per_step: int, seq_len: int, lr: float, weight_decay: float,
          versions: str) -> tuple[list[str], float]:
    names = list(runs)
    reference = runs["TRL SFTTrainer"]
    worst = max(rel(a, b) for n in names[1:] for a, b in zip(runs[n]["losses"], reference["losses"]))
    lines = [
        f"TRL `SFTTrainer` vs `ultrascale fit --config recipes/hf_chat.yaml`: tiny Llama (2 layers, hidden 64, 4 heads, "
        f"2 KV heads), 8 multi-turn chats ({tokens_per_step} tokens, {seq_len + 1} the longest), loss on the assistant "
        f"turns, global batch 8, AdamW lr {lr:g} constant, betas {BETAS}, eps {EPS:g}, weight decay {weight_decay:g} "
        f"(matrices), clip {MAX_GRAD_NORM:g}, fp32, CPU. {versions}",
        f"Machine: {machine()}.",
        "",
        "| step | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for step in range(len(reference["losses"])):
        lines.append(f"| {step + 1} | " + " | ".join(f"{runs[n]['losses'][step]:.7f}" for n in names) + " |")
    lines.append("| max rel. diff of loss vs TRL | | " + " | ".join(
        f"{max(rel(a, b) for a, b in zip(runs[n]['losses'], reference['losses'])):.1e}" for n in names[1:]) + " |")
    lines.append("| max rel. diff of grad norm vs TRL | | " + " | ".join(
        f"{max(rel(a, b) for a, b in zip(runs[n]['grad_norms'], reference['grad_norms'])):.1e}" for n in names[1:]) + " |")
    rates = {n: tokens_per_s(runs[n]["ends"], tokens_per_step) for n in names}
    lines.append("| tokens/s (steps 2-10) | " + " | ".join(f"{rates[n]:,.0f}" for n in names) + " |")
    lines.append("| ratio ultrascale / TRL | | " + " | ".join(f"{rates[n] / rates[names[0]]:.2f}" for n in names[1:]) + " |")
    lines.append("| wall s (TRL: `trainer.train()`; ultrascale: the whole command) | "
                 + " | ".join(f"{runs[n]['seconds']:.1f}" for n in names) + " |")
    lines.append("| cores other processes used | " + " | ".join(f"{100 * runs[n]['foreign']:.0f}%" for n in names) + " |")
    lines += ["", f"Largest relative loss difference: {worst:.2e}."]
    return lines, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3, help="constant AdamW learning rate (large: the losses move)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every process, both sides")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative loss difference allowed")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trl_sft.md"))
    options = parser.parse_args()

    import lightning
    import torch
    import transformers
    import trl

    torch.set_num_threads(options.threads)  # TRL trains in this process
    versions = (f"{options.threads} intra-op thread(s) per process; torch {torch.__version__}, "
                f"transformers {transformers.__version__}, trl {trl.__version__}, lightning {lightning.__version__}.")
    with tempfile.TemporaryDirectory(prefix="trl_sft_") as tmp:
        work = Path(tmp)
        folder, data = make_fixture(work)
        lengths = [len(ids) for ids in chat_ids(folder, data)]
        tokens_per_step, seq_len = sum(lengths), max(lengths) - 1  # seq_len inputs hold the longest conversation
        print(f"8 conversations, {tokens_per_step} tokens ({min(lengths)}-{max(lengths)} each); seq_len {seq_len}",
              flush=True)
        runs: dict[str, dict] = {}
        runs["TRL SFTTrainer"] = run_trl(folder, data, work, options.steps, options.lr, options.weight_decay)
        check_same_tokens(runs["TRL SFTTrainer"]["prepared"], folder, data, seq_len)
        for name, devices in (("ultrascale, 1 process", 1), ("ultrascale, ZeRO-3 over 2", 2)):
            logs = work / f"runs_{devices}"
            command = ultrascale_command(folder, data, logs, devices, options.steps, seq_len, options.lr,
                                         options.weight_decay)
            print(f"{name}: {' '.join(command)}", flush=True)
            runs[name] = run_ultrascale(command, logs, options.threads)
        for name, run in runs.items():
            if len(run["losses"]) != options.steps or len(run["ends"]) != options.steps:
                raise RuntimeError(f"{name}: {len(run['losses'])} losses / {len(run['ends'])} step times logged, "
                                   f"expected {options.steps}")
    lines, worst = table(runs, tokens_per_step, seq_len, options.lr, options.weight_decay, versions)
    write_results("\n".join(lines) + "\n", options.out)
    if worst > options.tolerance:
        print(f"FAILED: a loss differs from TRL's by {worst:.2e} relative (tolerance {options.tolerance:g})")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
