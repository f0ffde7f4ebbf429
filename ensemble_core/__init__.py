"""ensemble_core: training-free multi-model LLM ensembles (SAFE, SpecEM) on transformers.

No LangChain or LlamaIndex import lives here; the adapters in ``integrations/`` wrap
:class:`Ensemble`.
"""

from ensemble_core.decoding.generation import (
    Chunk,
    EnsembleMethod,
    GenerationConfig,
    GenerationResult,
    GenerationStream,
)
from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.ensemble import DEFAULT_MEMBERS, Ensemble, resolve_members
from ensemble_core.errors import (
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
from ensemble_core.methods import METHODS, method_class
from ensemble_core.models.bundled import BUNDLED
from ensemble_core.models.loading import MemberSpec
from ensemble_core.text.alignment import Tokenized, encode_continuation, is_common_boundary, tokenize
from ensemble_core.text.chat import FALLBACK_TEMPLATE, normalize_messages

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
