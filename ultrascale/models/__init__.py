"""The built-in Llama (`llama`: plain torch), its training modules (`lm`), model adapters and
TP plans (`adapters`, `tp_plans`) and Hugging Face checkpoints (`hf`, imported on first use:
it loads transformers)."""

from typing import Any

from ultrascale.models.llama import Llama, LlamaConfig
from ultrascale.models.lm import CausalLMModule, LlamaLM

__all__ = ["CausalLMModule", "HFCausalLM", "Llama", "LlamaConfig", "LlamaLM"]


def __getattr__(name: str) -> Any:
    if name == "HFCausalLM":
        from ultrascale.models.hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
