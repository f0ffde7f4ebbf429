"""ensemble_core: training-free multi-model LLM ensembles (SAFE, SpecEM) on transformers.

The public API, curated (as httpx's ``__init__``): the facade (:class:`Ensemble`), members
and how to load them, the generation types, the method registry, every error, and the few
text helpers users reach for. Everything else is importable from its layer (docs/architecture.md):
``ensemble_core.text``, ``.models``, ``.constraints``, ``.decoding``, ``.methods``,
``.serving``, ``.remote``, ``.server``, ``.bench``. No LangChain or LlamaIndex import lives
here; the adapters in ``integrations/`` wrap :class:`Ensemble`.
"""

from ensemble_core.constraints.structured import StructuredOutput, ToolCall
from ensemble_core.decoding.generation import (
    Chunk,
    EnsembleMethod,
    GenerationConfig,
    GenerationResult,
    GenerationStream,
)
from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.decoding.scheduler import BatchingConfig
from ensemble_core.ensemble import DEFAULT_MEMBERS, Ensemble, resolve_members
from ensemble_core.errors import (
    ApiError,
    ClientDisconnected,
    ConfigurationError,
    ConstraintError,
    EnsembleError,
    GenerationCancelled,
    GenerationTimeout,
    InputError,
    InvalidOptionError,
    InvalidSchemaError,
    MemberUnavailableError,
    MissingDependencyError,
    ModelLoadError,
    NoMembersError,
    NotPicklableError,
    PromptTooLongError,
    StateLostError,
    UnknownAliasError,
    UnknownOptionError,
    UnknownToolError,
    UnsupportedAttentionError,
    UnsupportedContentError,
    UnsupportedModelError,
    UnsupportedParameterError,
    UnsupportedSchemaFeatureError,
    UnsupportedTokenizerError,
)
from ensemble_core.methods import METHODS, method_class
from ensemble_core.models.bundled import BUNDLED
from ensemble_core.models.loading import MemberSpec
from ensemble_core.remote import RayMemberSpec, RayOptions
from ensemble_core.text.alignment import Tokenized, encode_continuation, is_common_boundary, tokenize
from ensemble_core.text.chat import FALLBACK_TEMPLATE, normalize_messages

__version__ = "0.1.0"

__all__ = [
    # the facade and its registry
    "DEFAULT_MEMBERS", "METHODS", "Ensemble", "method_class", "resolve_members",
    # members
    "BUNDLED", "DecodeState", "Member", "MemberSpec", "RayMemberSpec", "RayOptions",
    # generation
    "BatchingConfig", "Chunk", "EnsembleMethod", "GenerationConfig", "GenerationResult", "GenerationStream",
    "StructuredOutput", "ToolCall",
    # errors (ensemble_core.errors)
    "ApiError", "ClientDisconnected", "ConfigurationError", "ConstraintError", "EnsembleError", "GenerationCancelled",
    "GenerationTimeout", "InputError", "InvalidOptionError", "InvalidSchemaError", "MemberUnavailableError",
    "MissingDependencyError", "ModelLoadError", "NoMembersError", "NotPicklableError", "PromptTooLongError", "StateLostError",
    "UnknownAliasError", "UnknownOptionError", "UnknownToolError", "UnsupportedAttentionError", "UnsupportedContentError",
    "UnsupportedModelError", "UnsupportedParameterError", "UnsupportedSchemaFeatureError", "UnsupportedTokenizerError",
    # text
    "FALLBACK_TEMPLATE", "Tokenized", "encode_continuation", "is_common_boundary", "normalize_messages", "tokenize",
]
