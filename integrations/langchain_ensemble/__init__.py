"""LangChain integration for ``ensemble_core``: :class:`ChatEnsemble` and :class:`EnsembleLLM`.

.. code-block:: python

    from langchain_ensemble import ChatEnsemble

    chat = ChatEnsemble(members=["smollm2-135m-instruct", "gemma3-270m"], method="safe", max_tokens=64)
    chat.invoke("Name the capital of France.")

See ``README.md`` next to this file for the parameters, the metadata and the choices made.
"""

from ensemble_core.errors import GenerationTimeout, UnsupportedContentError

from .chat_models import ChatEnsemble
from .llms import EnsembleLLM

__all__ = ["ChatEnsemble", "EnsembleLLM", "GenerationTimeout", "UnsupportedContentError"]
