"""LlamaIndex integration: ``from llama_index.llms.ensemble import EnsembleLLM``.

``llama_index`` and ``llama_index.llms`` are implicit namespace packages (no
``__init__.py``), so this package sits next to ``llama_index.core`` from site-packages.
"""

from ensemble_core.runtime import clear_shared, shared_ensemble

from .base import EnsembleLLM, default_context_margin
from .embeddings import LocalSentenceEmbedding

__all__ = ["EnsembleLLM", "LocalSentenceEmbedding", "clear_shared", "default_context_margin", "shared_ensemble"]
