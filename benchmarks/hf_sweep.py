"""Every causal LM the installed transformers ships, tiny, under each layout of tests/test_hf_matrix.py.

The matrix holds twenty architectures to parity in CI; this script asks the same of all the others, as a user who
brings one would: a tiny config made from the model type's defaults (2 layers, hidden 32, 4 heads, small vocabulary;
dropout and router jitter off, since they draw differently per process), `save_pretrained`, then each layout at
world 2 against the one-process reference (`tests/_parity.py`: first-step loss, every gradient, weights after step 1,
the 10-step curve). A cell is `exact`, `refused` (ultrascale's own error, before or at the first step), or `FAILS`
(another error, or no parity). A model type whose tiny config cannot be built from its defaults is listed apart:
that is the shrinking here, not ultrascale. Encoders and encoder-decoders are left out. A multimodal type (a
`text_config` beside a vision tower: Gemma 3, Llama 4, Qwen 3.5) is saved whole, as the Hub ships it, its text config
shrunk as above and its other parts to one small layer; ultrascale trains the text model.

    python benchmarks/hf_sweep.py [--types llama,qwen3]   # about 10 minutes on 2 cores for all of them
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import tests.test_hf_matrix as matrix  # noqa: E402
from tests._dist import run_ranks  # noqa: E402
from tests._parity import save_perturbed_hf, save_perturbed_multimodal  # noqa: E402

NOT_DECODERS = set(
    "bart bert bert-generation big_bird bigbird_pegasus blenderbot blenderbot-small camembert cpmant ctrl data2vec-text "
    "electra ernie git marian mbart megatron-bert musicgen musicgen_melody mvp pegasus plbart prophetnet reformer "
    "rembert roberta roberta-prelayernorm roc_bert roformer trocr whisper xglm xlm xlm-roberta xlm-roberta-xl xlnet xmod "
    "fuyu got_ocr2 mllama emu3 moshi openai-gpt moss_transcribe_diarize".split()
)
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, moe_intermediate_size=32,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=4, shared_expert_intermediate_size=32,
            tie_word_embeddings=False, pad_token_id=None, bos_token_id=1, eos_token_id=2, sliding_window=12,
            num_experts=4, num_local_experts=4, n_routed_experts=4, n_shared_experts=1, router_jitter_noise=0.0,
            input_jitter_noise=0.0, decoder_sparse_step=1, mlp_only_layers=[])
MAX_PARAMS = 2_000_000
TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=4, num_heads=4,
                  out_hidden_size=32, image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                  projector_output_dim=32, hidden_dim=32, embed_dim=32)
"""A multimodal checkpoint's vision / audio parts, one small layer (the fields its config has)."""


def tiny_fields(model_type: str) -> dict:
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    fields = {k: v for k, v in TINY.items() if hasattr(defaults, k)}
    if getattr(defaults, "kv_lora_rank", None):  # multi-head latent attention: K/V heads are the query heads
        fields["num_key_value_heads"] = 4
        fields.pop("head_dim", None)
    fields.update({k: 0.0 for k, v in vars(defaults).items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float)})
    kinds = list(getattr(defaults, "layer_types", None) or [])
    if kinds:  # two layers, of two kinds where the model has two
        fields["layer_types"] = [kinds[0], next((k for k in kinds if k != kinds[0]), kinds[0])]
    return fields


def tiny_config(model_type: str):
    """The tiny config of `model_type`, and whether it is multimodal (saved whole, `tests._parity.save_perturbed_multimodal`)."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    text = getattr(defaults, "text_config", None)
    if text is None:
        return CONFIG_MAPPING[model_type](**tiny_fields(model_type)), False
    subs = {"text_config": tiny_fields(text.model_type)}
    for name in getattr(defaults, "sub_configs", {}):
        part = getattr(defaults, name, None)
        if name != "text_config" and part is not None:
            subs[name] = {"model_type": part.model_type, **{k: v for k, v in TINY_TOWER.items() if hasattr(part, k)}}
    extra = {"mm_tokens_per_image": 4} if hasattr(defaults, "mm_tokens_per_image") else {}
    return CONFIG_MAPPING[model_type](**subs, **extra), True


def outcome(error: str) -> str:
    found = re.findall(r"(LayoutError|LayoutNotImplemented|NotImplementedError|ValueError): ([^\n]*)", error)
    if found and ("UltraScaleStrategy" in found[-1][1] or found[-1][0] != "ValueError" or "ultrascale" in error):
        return f"refused: {found[-1][1].removeprefix('UltraScaleStrategy: ')[:90]}"
    last = [line for line in error.splitlines() if re.match(r"^[A-Za-z.]*(Error|Exception)", line)]
    return f"FAILS: {(last[-1] if last else error.splitlines()[-1])[:110]}"


def sweep(types: list[str], folder: Path) -> list[dict]:
    import transformers

    from ultrascale.models.adapters import hf_num_experts

    rows = []
    for model_type in types:
        started = time.time()
        try:
            config, multimodal = tiny_config(model_type)
            whole = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
            with torch.device("meta"):
                size = sum(p.numel() for p in whole.from_config(config).parameters())
            if size > MAX_PARAMS:
                raise ValueError(f"the tiny config still has {size:,} parameters")
            save = save_perturbed_multimodal if multimodal else save_perturbed_hf
            path = save(config, folder / model_type)
            reference = matrix._reference(model_type, path)
        except Exception as error:  # the tiny config, not ultrascale
            rows.append({"type": model_type, "setup": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"})
            continue
        moe = hf_num_experts(config.get_text_config()) > 0
        cells = {}
        for layout, knobs in matrix.LAYOUTS.items():
            if layout == "EP 2" and not moe:
                cells[layout] = "-"
                continue
            try:
                results = run_ranks(matrix._train, matrix.WORLD, path, knobs, tempfile.mkdtemp(dir=folder))
                matrix.assert_stage_parity(results, reference)
                cells[layout] = "exact"
            except AssertionError as error:
                text = str(error)
                cells[layout] = outcome(text) if "distributed worker failed" in text else f"FAILS: no parity: {text.splitlines()[0][:120]}"
        rows.append({"type": model_type, "params": size, "cells": cells, "seconds": round(time.time() - started, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    import transformers

    layouts = list(matrix.LAYOUTS)
    swept = [r for r in rows if "cells" in r]
    counts = {kind: sum(c.startswith(kind) for r in swept for c in r["cells"].values()) for kind in ("exact", "refused", "FAILS")}
    lines = [
        "# Every causal LM of transformers, tiny, under each layout",
        "",
        f"`python benchmarks/hf_sweep.py` on {machine()}; transformers {transformers.__version__}, torch {torch.__version__}.",
        f"{len(swept)} model types swept: {counts['exact']} cells exact, {counts['refused']} refused by ultrascale, "
        f"{counts['FAILS']} failing; {len(rows) - len(swept)} types whose tiny config was not built from their defaults.",
        "",
        "| model type | parameters | " + " | ".join(layouts) + " |",
        "|---" * (len(layouts) + 2) + "|",
    ]
    for row in swept:
        cells = [row["cells"][layout].replace("|", "/") for layout in layouts]
        lines.append(f"| `{row['type']}` | {row['params']:,} | " + " | ".join(cells) + " |")
    lines += ["", "Not swept (the tiny config, not ultrascale):", ""]
    lines += [f"- `{row['type']}`: {row['setup']}" for row in rows if "setup" in row]
    return "\n".join(lines) + "\n"


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every decoder)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_sweep.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    types = args.types.split(",") if args.types else sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in NOT_DECODERS)
    with tempfile.TemporaryDirectory() as folder:
        rows = sweep(types, Path(folder))
    write_results(table(rows), args.out)


if __name__ == "__main__":
    main()
