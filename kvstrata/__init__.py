"""kvstrata: a hierarchical, rank-consistent prefix KV cache for long-context LLM serving."""

__version__ = "0.1.0"
