"""Offline sentence embeddings for RAG next to the ensemble.

``from llama_index.embeddings.ensemble import LocalSentenceEmbedding``.

``llama_index.embeddings`` is an implicit namespace package (no ``__init__.py``), like
``llama_index.llms``, so this package sits next to the other LlamaIndex embedding packages.
"""

from .base import LocalSentenceEmbedding, packaged_minilm_path

__all__ = ["LocalSentenceEmbedding", "packaged_minilm_path"]
