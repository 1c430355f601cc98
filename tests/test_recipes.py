"""Every recipe is checked on CPU, nothing run: `ultrascale plan --recipe` parses it as `ultrascale fit` would,
builds the model on the meta device, runs the strategy's layout checks at the recipe's own world size and
prices the layout (exit 0 valid and fits, 1 does not fit, 2 invalid with the knob named).

The GPU recipes (8 to 512 H100s) are validated here at their real world size: no process group, no weight."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests._cli import run_main
from ultrascale.estimate import ModelShape
from ultrascale.models.llama import Llama, LlamaConfig
from ultrascale.planner.recipe_check import check_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
STRATEGY = "--trainer.strategy.init_args"
# The recipe knob behind each mesh axis of `ParallelDims`.
KNOBS = {"data_parallel_replicate": "dp_replicate", "data_parallel_shard": "dp_shard", "context_parallel": "cp",
         "tensor_parallel": "tp", "pipeline_parallel": "pp", "expert_parallel": "ep"}


def _hf_checkpoint(folder: Path) -> Path:
    """A 2-layer Hugging Face Llama folder (config.json + safetensors), as `--model.pretrained_path` expects."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _command_line_args(recipe: Path, tmp_path: Path) -> list[str]:
    """What a recipe leaves to the command line (its header says so): an HF checkpoint folder, a data file."""
    config = yaml.safe_load(recipe.read_text())
    args: list[str] = []
    model, data = config["model"], config["data"]
    if model["class_path"].endswith("HFCausalLM") and "pretrained_path" not in (model.get("init_args") or {}):
        args += ["--model.pretrained_path", str(_hf_checkpoint(tmp_path / "hf"))]
    if data["class_path"].endswith("InstructionDataModule") and "data_path" not in (data.get("init_args") or {}):
        args += ["--data.data_path", str(tmp_path / "train.jsonl")]  # read in `setup`, never by the check
    return args


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    return run_main(capsys, "plan", *args)


def _world(config: dict) -> int:
    return int(config["trainer"].get("num_nodes", 1)) * int(config["trainer"]["devices"])


def test_every_recipe_is_found():
    names = {recipe.name for recipe in RECIPES}
    assert {"tiny_cpu.yaml", "hf_finetune.yaml", "llama3_8b.yaml", "llama3_70b.yaml", "llama3_405b.yaml",
            "long_context.yaml", "moe.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[recipe.stem for recipe in RECIPES])
def test_recipe_is_valid_and_fits_at_its_world_size(recipe, tmp_path, capsys):
    config = yaml.safe_load(recipe.read_text())
    args = _command_line_args(recipe, tmp_path)
    code, out, err = _plan(capsys, "--recipe", str(recipe), *args)
    assert code == 0, out + err
    assert f"on {_world(config)} ranks" in out and "fits in the" in out, out

    plan = check_recipe(str(recipe), args)
    # The layout priced is the recipe's own: every degree it writes, at its world size.
    strategy = config["trainer"]["strategy"]
    written = strategy.get("init_args", {}) if isinstance(strategy, dict) else {}
    for knob, axis in KNOBS.items():
        if isinstance(written.get(knob), int) and written[knob] > 0:
            assert getattr(plan.dims, axis) == written[knob], (knob, plan.dims)
    assert plan.dims.world_size == _world(config)
    assert plan.work.seq_len == config["data"]["init_args"].get("seq_len", plan.work.seq_len)
    # Nothing was allocated: every parameter and buffer of the built network is on the meta device.
    tensors = list(plan.module.parameters()) + list(plan.module.buffers())
    assert tensors and sum(p.numel() for p in plan.module.parameters()) > 0
    assert all(t.device.type == "meta" for t in tensors)


GPU_RECIPES = [recipe for recipe in RECIPES if yaml.safe_load(recipe.read_text())["trainer"].get("accelerator") == "gpu"]


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[recipe.stem for recipe in GPU_RECIPES])
def test_gpu_recipe_header_matches_the_recipe(recipe):
    """The launch line a user copies starts the world the recipe asks for, and the planned GiB it quotes is
    the planner's (within 2%: a header gone stale fails here)."""
    text = recipe.read_text()
    config = yaml.safe_load(text)
    trainer = config["trainer"]
    launch = re.search(r"torchrun --nnodes (\d+) --nproc-per-node (\d+) --rdzv-backend c10d --rdzv-endpoint \$HEAD:29500"
                       r" \\\n#\s+-m ultrascale\.cli fit --config recipes/(\S+)", text)
    assert launch, f"{recipe.name}: no torchrun line in the header"
    assert (int(launch[1]), int(launch[2]), launch[3]) == (trainer["num_nodes"], trainer["devices"], recipe.name)
    assert trainer["precision"] == "bf16-mixed" and trainer["strategy"]["init_args"]["meta_init"] is True
    quoted = re.search(r"Planned \(`ultrascale plan --recipe recipes/" + re.escape(recipe.name) + r"`, H100 80GB\): ([\d.]+) GiB",
                       text.replace("\n# ", " "))
    assert quoted, f"{recipe.name}: no planned GiB in the header"
    planned = check_recipe(str(recipe)).row.memory["total"] / 2**30
    assert float(quoted[1]) == pytest.approx(planned, rel=0.02)


def test_every_recipe_is_in_the_docs_table():
    page = (ROOT / "docs" / "cli-and-recipes.md").read_text()
    missing = [recipe.name for recipe in RECIPES if f"| `recipes/{recipe.name}` |" not in page]
    assert not missing, f"the recipe table of docs/cli-and-recipes.md lacks {missing}"


def test_the_405b_check_allocates_nothing():
    """`python -m ultrascale.cli plan --recipe recipes/llama3_405b.yaml` (the module's `__main__`, as torchrun runs
    it) in a child process: its peak memory stays far below one 405B layer (~13 GB in fp32)."""
    probe = (
        "import resource, runpy, sys\n"
        "sys.argv = ['ultrascale.cli', 'plan', '--recipe', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('ultrascale.cli', run_name='__main__')\n"
        "finally:\n"
        "    usage = resource.getrusage(resource.RUSAGE_SELF)\n"
        "    print('PROBE', usage.ru_maxrss, usage.ru_utime + usage.ru_stime, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(ROOT / "recipes" / "llama3_405b.yaml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "405.85B parameters" in done.stdout and "0.0 MiB of real tensors" in done.stdout
    rss_kib, cpu_s = re.search(r"PROBE (\d+) ([\d.]+)", done.stderr).groups()
    assert int(rss_kib) < 2 * 2**20, f"peak RSS {int(rss_kib) / 2**20:.2f} GiB"  # imports are ~0.5 GiB
    assert float(cpu_s) < 60, f"{cpu_s} s of CPU"


def _broken_70b(tmp_path: Path) -> Path:
    """llama3_70b.yaml with tp=16: the layout multiplies to 64 ranks but 16 does not divide the 8 KV heads."""
    config = yaml.safe_load((ROOT / "recipes" / "llama3_70b.yaml").read_text())
    config["trainer"]["strategy"]["init_args"].update(tensor_parallel=16, data_parallel_shard=4)
    path = tmp_path / "broken_70b.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


BROKEN = {
    "tp_not_dividing_kv_heads": ("tiny_cpu_2d.yaml", [f"{STRATEGY}.data_parallel_shard", "1", f"{STRATEGY}.tensor_parallel", "4"],
                                 "`tensor_parallel=4` must divide n_kv_heads=2"),
    "pp_above_the_layers": ("llama3_405b.yaml", [f"{STRATEGY}.pipeline_parallel", "128", f"{STRATEGY}.data_parallel_shard", "1",
                                                 f"{STRATEGY}.context_parallel", "1", f"{STRATEGY}.tensor_parallel", "4"],
                            "pipeline_parallel=128 x pipeline_virtual_stages=1 = 128 stages, but the model has only 126 layers"),
    "world_not_the_degrees": ("llama3_70b.yaml", ["--trainer.num_nodes", "4"],
                              "world size 32 from trainer.num_nodes 4 x trainer.devices 8; strategy knobs: pp = pipeline_parallel"),
    "gpus_not_the_degrees": ("llama3_8b.yaml", ["--gpus", "16"], "dp_shard = data_parallel_shard"),
    "seq_not_split_by_cp": ("long_context.yaml", ["--data.seq_len", "131000"], "must be a multiple of 32"),
    "seq_past_the_rope_table": ("llama3_405b.yaml", ["--model.max_seq_len", "8192"], "set `model.init_args.max_seq_len`"),
    "batch_not_split_by_dp": ("llama3_70b.yaml", ["--data.global_batch_size", "12"], "global_batch_size=12"),
    "microbatches_not_dividing": ("tiny_cpu_pp.yaml", [f"{STRATEGY}.pipeline_microbatches", "3"], "pipeline_microbatches=3"),
    "ep_not_dividing_the_experts": ("moe.yaml", [f"{STRATEGY}.expert_parallel", "16"],
                                    "8 experts per layer, which ep=16 does not divide"),
    "tp_across_nodes": ("tiny_cpu_2d.yaml", ["--gpus-per-node", "1"], "spans nodes"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_recipe_exits_2_naming_the_knob(case, capsys):
    recipe, args, message = BROKEN[case]
    code, out, err = _plan(capsys, "--recipe", str(ROOT / "recipes" / recipe), *args)
    assert code == 2, out + err
    assert message in err, err[-2000:]
    assert "per GPU" not in out  # refused before any pricing


def test_a_broken_recipe_file(tmp_path, capsys):
    code, out, err = _plan(capsys, "--recipe", str(_broken_70b(tmp_path)))
    assert code == 2
    assert "`tensor_parallel=16` must divide n_kv_heads=8" in err


def test_a_recipe_that_does_not_fit_exits_1(capsys):
    # 4 sequences of 8192 tokens per GPU per micro-step: the activations alone outgrow an H100.
    code, out, _ = _plan(capsys, "--recipe", str(ROOT / "recipes" / "llama3_8b.yaml"), "--data.global_batch_size", "32")
    assert code == 1
    assert "micro_batch=4" in out and "does NOT fit" in out
    # The same recipe on 141 GB H200s fits.
    code, out, _ = _plan(capsys, "--recipe", str(ROOT / "recipes" / "llama3_8b.yaml"), "--data.global_batch_size", "16",
                         "--gpu", "h200")
    assert code == 0, out


def test_recipe_json_and_refused_flags(capsys):
    code, out, _ = _plan(capsys, "--recipe", str(ROOT / "recipes" / "moe.yaml"), "--json")
    assert code == 0
    row = json.loads(out)
    assert (row["world"], row["dp_shard"], row["ep"], row["zero_stage"], row["recompute"]) == (32, 32, 8, 3, "full")
    assert row["fits"] and 0 < row["memory_gib"]["total"] < 80
    assert any("expert parallel ep=8" in check for check in row["checks"])
    # The recipe fixes the batch and layout: flags that would contradict it are refused.
    code, _, err = _plan(capsys, "--recipe", str(ROOT / "recipes" / "moe.yaml"), "--seq-len", "4096")
    assert code == 2 and "--seq-len" in err and "--data.seq_len" in err


def test_mixtral_preset_is_mistrals_size():
    # Mixtral-8x7B's model.safetensors.index.json: total_size 93,405,585,408 bytes of bf16, 2 bytes per parameter.
    config = LlamaConfig.from_preset("mixtral_8x7b")
    assert ModelShape.from_llama_config(config).num_params == 93_405_585_408 // 2
    with torch.device("meta"):
        assert sum(p.numel() for p in Llama(config).parameters()) == 93_405_585_408 // 2


def test_plan_recipe_runs_the_strategys_own_model_checks(tmp_path):
    """`plan --recipe` runs `UltraScaleStrategy.check_model`, what `setup` runs: tensor parallel on the MoE recipe
    (expert tensor parallel) passes, and a degree the model does not divide fails with the strategy's message."""
    recipe = ROOT / "recipes" / "tiny_cpu_moe.yaml"
    config = yaml.safe_load(recipe.read_text())
    config["trainer"]["strategy"] = {"class_path": "ultrascale.UltraScaleStrategy", "init_args": {"tensor_parallel": 2}}
    moe_tp = tmp_path / "moe_tp.yaml"
    moe_tp.write_text(yaml.safe_dump(config))
    plan = check_recipe(str(moe_tp), _command_line_args(recipe, tmp_path))
    assert plan.dims.tp == 2
    assert any("each of the 8 experts split on its width" in check for check in plan.checks), plan.checks
    config["trainer"]["devices"] = 4
    config["trainer"]["strategy"]["init_args"]["tensor_parallel"] = 4  # tiny_moe has 2 KV heads
    moe_tp.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"`tensor_parallel=4` must divide n_kv_heads=2"):
        check_recipe(str(moe_tp), _command_line_args(recipe, tmp_path))
