"""Data pipeline: tokenizers and the causal-LM data module with a dp-size-independent, resumable layout."""

from ultrascale.data.datamodule import (
    CausalLMDataModule,
    TokenBlockDataset,
    stdlib_files,
    tokenize_corpus,
)
from ultrascale.data.errors import DataError, DataNotFound
from ultrascale.data.sampling import BlockDataModule, ResumableBlockSampler
from ultrascale.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BlockDataModule",
    "ByteTokenizer",
    "CausalLMDataModule",
    "DataError",
    "DataNotFound",
    "HFTokenizer",
    "ResumableBlockSampler",
    "TokenBlockDataset",
    "Tokenizer",
    "load_tokenizer",
    "stdlib_files",
    "tokenize_corpus",
]
from ultrascale.data.instruct import (  # noqa: E402
    InstructionBlockDataset,
    InstructionDataModule,
    PackedBlocks,
    pack_examples,
    read_examples,
)

__all__ += ["InstructionBlockDataset", "InstructionDataModule", "PackedBlocks", "pack_examples", "read_examples"]
