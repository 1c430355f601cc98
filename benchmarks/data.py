"""Pretraining data: `ultrascale prepare-data` throughput, and what a fit pays for a large corpus.

On a generated corpus (random sentences over a 2,000-word vocabulary, JSONL shards; no downloads) and
a 512-entry byte-level BPE tokenizer trained on a sample of it:

1. Prepare throughput: tokens/s of `prepare_data` with 1 and 2 worker processes on the large corpus
   (default 105M, so that at least 100M are prepared), wall time of the whole command (reading,
   tokenizing, writing); the two outputs are checked to be byte-identical.
2. A fit on the large prepared folder against one of about 2M tokens (a prefix of the same corpus),
   each in a fresh interpreter: `Trainer(devices=2, strategy="ultrascale_zero3")`, the built-in tiny
   Llama, 5 steps, 3 runs of each in alternation (medians). Per rank (the slower rank): time from the
   child's start of `fit` to the start of the first training batch, and the peak resident set (VmHWM)
   at the end. Target (issue 33): the large corpus within 10% and 50 MB of
   the small one.
3. Data-loading time per step: mean time to fetch one rank's batch from the train DataLoader
   (memory-mapped blocks, shuffled order, 0 workers), large against small.

    python benchmarks/data.py [--tokens 105_000_000] [--out benchmarks/results/data.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_results  # noqa: E402

SEQ, GLOBAL_BATCH, STEPS = 256, 8, 5
SMALL_TOKENS = 2_000_000
TOKENS_PER_WORD = 4.0  # measured at 100M tokens: random 2-8 letter words under the 512-entry BPE trained on them
FIT_RUNS = 3


def make_corpus(folder: Path, tokens: int, shards: int = 8, seed: int = 0) -> list[Path]:
    """JSONL shards of random sentences, about `tokens` tokens under the benchmark's tokenizer
    (`TOKENS_PER_WORD`; the table reports the count actually prepared)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = np.array(["".join(rng.choice(letters, int(n))) for n in rng.integers(2, 9, 2000)])
    folder.mkdir(parents=True, exist_ok=True)
    words_needed = int(tokens / TOKENS_PER_WORD)
    per_shard = words_needed // shards
    paths = []
    for shard in range(shards):
        path = folder / f"shard{shard:02d}.jsonl"
        with path.open("w") as sink:
            left = per_shard
            while left > 0:
                lengths = rng.integers(50, 400, 2000)
                picks = words[rng.integers(0, len(words), int(lengths.sum()))]
                cut = np.cumsum(lengths)[:-1]
                for document in np.split(picks, cut):
                    sink.write(json.dumps({"text": " ".join(document)}) + "\n")
                left -= int(lengths.sum())
        paths.append(path)
    return paths


def make_tokenizer(folder: Path, sample: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with sample.open() as lines:
        texts = [json.loads(next(lines))["text"] for _ in range(2000)]
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


def fit_child(prepared: str, result: str) -> None:
    """One fit on `prepared` (run in a fresh interpreter): time to the first batch and peak RSS per rank."""
    import lightning as L

    import ultrascale  # noqa: F401  (registers the strategies)
    from ultrascale.data import CausalLMDataModule
    from ultrascale.models.lm import LlamaLM

    started = time.time()

    class Measure(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                self.first = time.time() - started

        def on_train_end(self, trainer, pl_module):
            hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
            Path(f"{result}.rank{trainer.global_rank}").write_text(json.dumps({"first_batch_s": self.first,
                                                                               "peak_rss_mb": hwm / 1024}))

    data = CausalLMDataModule(data_path=prepared, seq_len=SEQ, global_batch_size=GLOBAL_BATCH, val_fraction=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ultrascale_zero3", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Measure()])
    trainer.fit(LlamaLM(preset="tiny", vocab_size=data.vocab_size), data)


def loading_ms(prepared: str, batches: int = 200) -> float:
    """Mean ms to fetch one dp rank's batch (dp 2, rank 0) from the train DataLoader."""
    from types import SimpleNamespace

    from ultrascale.data import CausalLMDataModule

    data = CausalLMDataModule(data_path=prepared, seq_len=SEQ, global_batch_size=GLOBAL_BATCH, val_fraction=0.0)
    progress = SimpleNamespace(current=SimpleNamespace(processed=0))
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0}),
                                   current_epoch=0, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    data.setup()
    loader = iter(data.train_dataloader())
    next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return (time.perf_counter() - start) / batches * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=105_000_000)  # >= 100M prepared
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "data.md"))
    parser.add_argument("--fit-child", nargs=2, metavar=("PREPARED", "RESULT"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.fit_child:
        fit_child(*options.fit_child)
        return
    from ultrascale.data.prepared import PreparedTokens, prepare_data

    root = Path(tempfile.mkdtemp(prefix="ultrascale-data-bench-"))
    started = time.perf_counter()
    shards = make_corpus(root / "corpus", options.tokens)
    small_corpus = root / "small.jsonl"
    with shards[0].open() as lines, small_corpus.open("w") as sink:
        written = 0
        for line in lines:
            sink.write(line)
            written += len(json.loads(line)["text"].split()) * TOKENS_PER_WORD
            if written >= SMALL_TOKENS:
                break
    print(f"corpus: {sum(p.stat().st_size for p in shards) / 1e6:.0f} MB of JSONL in {time.perf_counter() - started:.0f} s")
    make_tokenizer(root / "tokenizer", shards[0])

    prepare = {}
    for workers in (1, 2):
        out = root / f"large-w{workers}"
        start = time.perf_counter()
        prepare_data([str(p) for p in shards], root / "tokenizer", out, workers=workers, progress=False)
        seconds = time.perf_counter() - start
        tokens = PreparedTokens.open(out).metadata["num_tokens"]
        prepare[workers] = (tokens, seconds)
        print(f"prepare, {workers} worker(s): {tokens:,} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tokens/s")
    identical = (root / "large-w1" / "tokens.bin").read_bytes() == (root / "large-w2" / "tokens.bin").read_bytes()
    large = str(root / "large-w2")
    small = str(prepare_data([str(small_corpus)], root / "tokenizer", root / "small", progress=False))
    small_tokens = PreparedTokens.open(small).metadata["num_tokens"]

    runs: dict[str, list[tuple[float, float]]] = {"small": [], "large": []}
    for run in range(FIT_RUNS):  # alternating, so that a slow moment of the machine hits both
        for name, folder in (("small", small), ("large", large)):
            result = str(root / f"fit-{name}-{run}")
            subprocess.run([sys.executable, __file__, "--fit-child", folder, result], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            ranks = [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(2)]
            runs[name].append((max(r["first_batch_s"] for r in ranks), max(r["peak_rss_mb"] for r in ranks)))
            print(f"fit on {name}: first batch after {runs[name][-1][0]:.1f} s, peak RSS {runs[name][-1][1]:.0f} MB per rank")
    fits = {name: (float(np.median([r[0] for r in rs])), float(np.median([r[1] for r in rs]))) for name, rs in runs.items()}
    loading = {name: loading_ms(folder) for name, folder in (("small", small), ("large", large))}

    (t1, s1), (t2, s2) = prepare[1], prepare[2]
    time_ratio = fits["large"][0] / fits["small"][0]
    rss_delta = fits["large"][1] - fits["small"][1]
    lines = [
        f"Pretraining data (`benchmarks/data.py`, {os.cpu_count()} CPU cores), a generated corpus with a 512-entry "
        "byte-level BPE tokenizer. Figures from one run.",
        "",
        "| prepare | tokens | seconds | tokens/s |",
        "|---|---|---|---|",
        f"| 1 worker | {t1:,} | {s1:.1f} | {t1 / s1:,.0f} |",
        f"| 2 workers | {t2:,} | {s2:.1f} | {t2 / s2:,.0f} |",
        "",
        f"2 workers / 1 worker: {s1 / s2:.2f}x; outputs byte-identical: {identical}.",
        "",
        f"| fit (2 ranks, ZeRO-3, tiny Llama, seq {SEQ}; median of {FIT_RUNS}) | prepared tokens | first batch after (s) "
        "| peak RSS per rank (MB) "
        "| data loading per step (ms) |",
        "|---|---|---|---|---|",
        f"| small corpus | {small_tokens:,} | {fits['small'][0]:.2f} | {fits['small'][1]:.0f} | {loading['small']:.3f} |",
        f"| large corpus | {t2:,} | {fits['large'][0]:.2f} | {fits['large'][1]:.0f} | {loading['large']:.3f} |",
        "",
        f"Large / small: time to the first batch {time_ratio:.3f} (target within 10%), peak RSS "
        f"{rss_delta:+.0f} MB (target within 50 MB).",
    ]
    text = "\n".join(lines)
    print(text)
    write_results(text, options.out)


if __name__ == "__main__":
    main()
