"""Sequence parallel on Hugging Face decoders, read from their structure.

Under tensor parallel alone every tp rank holds the whole (batch, seq, hidden) residual stream and the norms'
activations. Sequence parallel (Korthikanti et al. 2022) keeps them 1/tp per rank: the stream is sharded on the
sequence between the tensor-parallel branches, each branch all-gathers its input and its last row-parallel layer
reduce-scatters its output back to this rank's slice.

transformers' `base_model_tp_plan` places only the branches' linears. The rest comes from the model's structure:

- the model's own forward runs whole (its rotary embeddings, its causal and sliding masks are made for the whole
  sequence from the replicated embedding output); the first decoder layer takes this rank's slice of it;
- in each decoder layer the children the plan reaches into (attention, MLP) gather their `hidden_states`; every other
  child with parameters must be a norm over the hidden size (input, post-attention, Gemma's pre/post-feedforward,
  OLMo2's post norms), which runs on the slice (`SequenceParallel`: its weight's gradient summed over tp);
- the row-parallel layers of the plan return the slice (reduce-scatter instead of all-reduce);
- a Mixture-of-Experts block (a branch holding fused experts) runs whole on its gathered input, as under tensor
  parallel alone: its router routes every token on every tp rank, its output is whole (the experts' sums
  all-reduced, or under EP x TP gathered; a shared expert's row-parallel layer keeps its all-reduce), and the
  stream takes this rank's slice of it;
- the base model's final norm runs on the slice, and the head gathers it (or keeps the vocabulary sharded for
  loss parallel);
- under pipeline parallel the stream crosses a stage boundary whole: the stage's last layer gathers it, the next
  stage's first layer takes the slice again (the next stage runs the model's own forward, its masks and positions).

What does not fit (a layer child with other parameters, another layout of the base model) is refused, naming the
piece.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Optional

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["hf_sequence_parallel_problem", "hf_sequence_parallel_styles"]


def _branches(base_plan: Mapping[str, str]) -> set[str]:
    """The decoder-layer children the plan places layers in: 'self_attn' of 'layers.*.self_attn.q_proj'."""
    return {key.split(".")[2] for key in base_plan if key.startswith("layers.*.") and key.count(".") >= 3}


def _is_hidden_norm(module: nn.Module, hidden: int) -> bool:
    params = list(module.parameters())
    return bool(params) and all(p.dim() == 1 and p.shape[0] == hidden for p in params)


def _pieces(hf: nn.Module, base_plan: Mapping[str, str]) -> Iterator[tuple[str, Optional[int], nn.Module, str]]:
    """What sequence parallel does with each child of the base model's layers and of the base model itself, as
    (name, layer index or None for the base model's own, module, role): "branch" (the plan places linears in it:
    gathers its input), "experts" (a branch holding fused experts: gathers its input and slices its output), "norm"
    (parameters only over the hidden size: runs on the slice) or "other" (parameters of another kind: refused).
    Children without parameters are left out; so are the layers and the embedding."""
    from ultrascale.models.moe import hf_experts_modules

    base, hidden, branches = hf.base_model, hf.config.hidden_size, _branches(base_plan)
    for index, layer in enumerate(base.layers):
        for name, child in layer.named_children():
            if name in branches:
                yield name, index, child, "experts" if hf_experts_modules(child) else "branch"
            elif any(True for _ in child.parameters()):
                yield name, index, child, "norm" if _is_hidden_norm(child, hidden) else "other"
    embedding = hf.get_input_embeddings()
    for name, child in base.named_children():
        if child is not base.layers and child is not embedding and any(True for _ in child.parameters()):
            yield name, None, child, "norm" if _is_hidden_norm(child, hidden) else "other"


def hf_sequence_parallel_problem(hf: nn.Module, base_plan: Mapping[str, str], name: str) -> Optional[str]:
    """Why `hf`'s residual stream cannot be sharded on the sequence between its plan's branches; None: it can."""
    where = f"sequence parallel on {name}"
    layers = getattr(hf.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or not _branches(base_plan):
        return f"{where}: its base model has no `layers` list the tp plan places its linears in"
    for child_name, index, child, role in _pieces(hf, base_plan):
        if role == "other" and index is not None:
            return (f"{where}: layer {index}'s `{child_name}` ({type(child).__name__}) holds parameters outside the "
                    "tp plan that are not a norm over the hidden size, so it cannot run on a slice of the sequence")
        if role == "other":
            return (f"{where}: the base model's `{child_name}` ({type(child).__name__}) holds parameters that are "
                    "neither the layers, the embedding nor a final norm")
    return None


def hf_sequence_parallel_styles(hf: nn.Module, styles: Mapping[str, ParallelStyle], base_plan: Mapping[str, str], *,
                                base: str, prefix: str, loss_parallel: bool,
                                stage_layers: Sequence[range] = ()) -> dict[str, ParallelStyle]:
    """`styles` (the plan `hf_tp_plan` made, keyed from the LightningModule: `prefix` is `hf`'s path, `base` its base
    model's) with the residual stream sharded on the sequence between the branches (`hf_sequence_parallel_problem`
    has found nothing in the way)."""
    from ultrascale.parallel.tensor_styles import HiddenStatesLayout

    result: dict[str, ParallelStyle] = {}
    layers_path = f"{base}layers."
    pieces = list(_pieces(hf, base_plan))
    experts_blocks = {id(child) for _, _, child, role in pieces if role == "experts"}
    for key, style in styles.items():
        # A branch's last layer reduce-scatters, unless it sits in an experts block (a shared expert's: the block
        # adds it to the routed experts' whole output).
        if (key.startswith(layers_path) and type(style) is RowwiseParallel
                and not _inside(hf.base_model.layers, key[len(layers_path):], experts_blocks)):
            style = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Shard(1))
        result[key] = style
    # The model's forward made the stream whole: the first layer takes this rank's slice. Under pipeline parallel
    # each stage's first layer does, and each stage's last layer (but the model's) gathers the stream whole again:
    # the next stage runs the model's own forward, which builds its masks and positions from the whole sequence.
    starts = {0} | {layers[0] for layers in stage_layers[1:] if len(layers)}
    ends = {layers[-1] for layers in stage_layers[:-1] if len(layers)}
    for index in sorted(starts | ends):
        result[f"{layers_path}{index}"] = HiddenStatesLayout(
            Replicate() if index in starts else Shard(1), Shard(1), output=(Shard(1), Replicate()) if index in ends else None)
    for child_name, index, _, role in pieces:
        path = f"{base}{child_name}" if index is None else f"{layers_path}{index}.{child_name}"  # None: the final norm
        result[path] = {"branch": HiddenStatesLayout(Shard(1), Replicate()),
                        "experts": HiddenStatesLayout(Shard(1), Replicate(), output=(Replicate(), Shard(1)))
                        }.get(role, SequenceParallel(use_local_output=True))
    head = hf.get_output_embeddings()
    paths = {id(module): name for name, module in hf.named_modules()}
    if head is not None and id(head) in paths:
        result[prefix + paths[id(head)]] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel)
    return result


def _inside(layers: nn.ModuleList, path: str, blocks: set[int]) -> bool:
    """Whether every module `path` ("*.mlp.shared_experts.down_proj", below the layers) reaches lies inside one of
    `blocks` (and it reaches one)."""
    index, _, rest = path.partition(".")
    found = []
    for number, layer in enumerate(layers):
        if index not in ("*", str(number)):
            continue
        module, holders = layer, []
        for part in rest.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
            holders.append(id(module))
        if module is not None:
            found.append(any(holder in blocks for holder in holders[:-1]))
    return bool(found) and all(found)
