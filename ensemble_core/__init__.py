"""ensemble_core: training-free multi-model LLM ensembles (SAFE, SpecEM) on transformers.

No LangChain or LlamaIndex import lives here; the adapters in ``integrations/`` wrap
:class:`Ensemble`.
"""

from .alignment import Tokenized, encode_continuation, is_common_boundary, tokenize
from .bundled import BUNDLED
from .chat import FALLBACK_TEMPLATE, normalize_messages
from .ensemble import DEFAULT_MEMBERS, METHODS, Ensemble, method_class, resolve_members
from .errors import (
    ConfigurationError,
    EnsembleError,
    GenerationCancelled,
    GenerationTimeout,
    InputError,
    InvalidOptionError,
    MissingDependencyError,
    ModelLoadError,
    NoMembersError,
    PromptTooLongError,
    UnknownAliasError,
    UnsupportedAttentionError,
    UnsupportedContentError,
    UnsupportedModelError,
)
from .generation import Chunk, EnsembleMethod, GenerationConfig, GenerationResult, GenerationStream
from .members import DecodeState, Member, MemberSpec

__version__ = "0.1.0"

__all__ = [
    "BUNDLED", "DEFAULT_MEMBERS", "FALLBACK_TEMPLATE", "METHODS",
    "Chunk", "ConfigurationError", "DecodeState", "Ensemble", "EnsembleError", "EnsembleMethod",
    "GenerationCancelled", "GenerationConfig", "GenerationTimeout", "GenerationResult", "GenerationStream", "InputError",
    "InvalidOptionError", "Member", "MemberSpec", "MissingDependencyError", "ModelLoadError",
    "NoMembersError", "PromptTooLongError", "Tokenized", "UnknownAliasError",
    "UnsupportedAttentionError", "UnsupportedContentError", "UnsupportedModelError",
    "encode_continuation", "is_common_boundary", "method_class", "normalize_messages",
    "resolve_members", "tokenize",
]
