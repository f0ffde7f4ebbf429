"""LlamaIndex integration: ``from llama_index.llms.ensemble import EnsembleLLM``.

``llama_index`` and ``llama_index.llms`` are implicit namespace packages (no
``__init__.py``), so this package sits next to ``llama_index.core`` from site-packages.

``LocalSentenceEmbedding`` moved to ``llama_index.embeddings.ensemble``; it is re-exported
here for one release.
"""

from llama_index.embeddings.ensemble import LocalSentenceEmbedding

from ensemble_core.serving.runtime import clear_shared, shared_ensemble

from .base import EnsembleLLM, default_context_margin

__all__ = ["EnsembleLLM", "LocalSentenceEmbedding", "clear_shared", "default_context_margin", "shared_ensemble"]
