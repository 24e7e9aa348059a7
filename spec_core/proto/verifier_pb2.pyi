from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Coupling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COUPLING_REJECTION: _ClassVar[Coupling]
    COUPLING_GUMBEL: _ClassVar[Coupling]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOT_FINISHED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    CONTEXT: _ClassVar[FinishReason]
COUPLING_REJECTION: Coupling
COUPLING_GUMBEL: Coupling
NOT_FINISHED: FinishReason
STOP: FinishReason
LENGTH: FinishReason
CONTEXT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop_token_ids", "ignore_eos", "coupling")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    COUPLING_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    coupling: Coupling
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., coupling: _Optional[_Union[Coupling, str]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("prompt_token_ids", "resume_token_ids", "sampling", "tokenizer_fingerprint", "open_key", "prompt_text", "prompt_messages", "draft_tokenizer_fingerprint", "slo")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OPEN_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    tokenizer_fingerprint: str
    open_key: bytes
    prompt_text: str
    prompt_messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    draft_tokenizer_fingerprint: str
    slo: SessionSlo
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., open_key: _Optional[bytes] = ..., prompt_text: _Optional[str] = ..., prompt_messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., draft_tokenizer_fingerprint: _Optional[str] = ..., slo: _Optional[_Union[SessionSlo, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SessionSlo(_message.Message):
    __slots__ = ("tpot_ms", "ttft_ms")
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    tpot_ms: float
    ttft_ms: float
    def __init__(self, tpot_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ...) -> None: ...

class DraftBudget(_message.Message):
    __slots__ = ("max_gamma", "max_tree_nodes", "price")
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    max_gamma: int
    max_tree_nodes: int
    price: float
    def __init__(self, max_gamma: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., price: _Optional[float] = ...) -> None: ...

class DraftDist(_message.Message):
    __slots__ = ("token_ids", "weights", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class QPayload(_message.Message):
    __slots__ = ("format", "scale_bits", "positions")
    class Format(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[QPayload.Format]
        FIXED: _ClassVar[QPayload.Format]
        FLOAT32: _ClassVar[QPayload.Format]
    NONE: QPayload.Format
    FIXED: QPayload.Format
    FLOAT32: QPayload.Format
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SCALE_BITS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    format: QPayload.Format
    scale_bits: int
    positions: _containers.RepeatedCompositeFieldContainer[DraftDist]
    def __init__(self, format: _Optional[_Union[QPayload.Format, str]] = ..., scale_bits: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[DraftDist, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "round", "committed_length", "open", "draft_token_ids", "q", "draft_parents", "assumed_tokens", "continuations", "next_continuations")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    committed_length: int
    open: OpenSession
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: QPayload
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    assumed_tokens: _containers.RepeatedScalarFieldContainer[int]
    continuations: _containers.RepeatedCompositeFieldContainer[Continuation]
    next_continuations: _containers.RepeatedCompositeFieldContainer[Continuation]
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., committed_length: _Optional[int] = ..., open: _Optional[_Union[OpenSession, _Mapping]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[QPayload, _Mapping]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., assumed_tokens: _Optional[_Iterable[int]] = ..., continuations: _Optional[_Iterable[_Union[Continuation, _Mapping]]] = ..., next_continuations: _Optional[_Iterable[_Union[Continuation, _Mapping]]] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("assumed_tokens", "draft_token_ids", "draft_parents", "q")
    ASSUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    assumed_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    q: QPayload
    def __init__(self, assumed_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., q: _Optional[_Union[QPayload, _Mapping]] = ...) -> None: ...

class StreamRound(_message.Message):
    __slots__ = ("tag", "request")
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    tag: int
    request: VerifyRequest
    def __init__(self, tag: _Optional[int] = ..., request: _Optional[_Union[VerifyRequest, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    retry_after_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class StreamReply(_message.Message):
    __slots__ = ("tag", "reply", "error")
    TAG_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tag: int
    reply: VerifyReply
    error: StreamError
    def __init__(self, tag: _Optional[int] = ..., reply: _Optional[_Union[VerifyReply, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class ServerTimings(_message.Message):
    __slots__ = ("model_ms", "queue_ms", "total_ms")
    MODEL_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    model_ms: float
    queue_ms: float
    total_ms: float
    def __init__(self, model_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("session_id", "round", "num_accepted", "next_token_id", "committed_length", "finish_reason", "timings", "kept_nodes", "base_mismatch", "prompt_token_ids", "budget", "continuation", "next_round")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KEPT_NODES_FIELD_NUMBER: _ClassVar[int]
    BASE_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    num_accepted: int
    next_token_id: int
    committed_length: int
    finish_reason: FinishReason
    timings: ServerTimings
    kept_nodes: _containers.RepeatedScalarFieldContainer[int]
    base_mismatch: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    budget: DraftBudget
    continuation: int
    next_round: VerifyReply
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., committed_length: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[ServerTimings, _Mapping]] = ..., kept_nodes: _Optional[_Iterable[int]] = ..., base_mismatch: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., budget: _Optional[_Union[DraftBudget, _Mapping]] = ..., continuation: _Optional[int] = ..., next_round: _Optional[_Union[VerifyReply, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseReply(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "prompt_text", "prompt_messages")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    prompt_text: str
    prompt_messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_text: _Optional[str] = ..., prompt_messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "model_ms", "prompt_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    model_ms: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., model_ms: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("backend", "model", "n_vocab", "n_ctx", "tokenizer_fingerprint", "max_gamma", "max_sessions", "eos_token_ids", "version", "max_tree_nodes", "max_tree_branching", "batching", "text_prompts", "chat_prompts", "draft_budgets", "slo", "verify_stream", "max_window", "couplings")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_GAMMA_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_BRANCHING_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    TEXT_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CHAT_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BUDGETS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STREAM_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_FIELD_NUMBER: _ClassVar[int]
    COUPLINGS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    model: str
    n_vocab: int
    n_ctx: int
    tokenizer_fingerprint: str
    max_gamma: int
    max_sessions: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    version: str
    max_tree_nodes: int
    max_tree_branching: int
    batching: bool
    text_prompts: bool
    chat_prompts: bool
    draft_budgets: bool
    slo: SessionSlo
    verify_stream: bool
    max_window: int
    couplings: _containers.RepeatedScalarFieldContainer[Coupling]
    def __init__(self, backend: _Optional[str] = ..., model: _Optional[str] = ..., n_vocab: _Optional[int] = ..., n_ctx: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_gamma: _Optional[int] = ..., max_sessions: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., version: _Optional[str] = ..., max_tree_nodes: _Optional[int] = ..., max_tree_branching: _Optional[int] = ..., batching: _Optional[bool] = ..., text_prompts: _Optional[bool] = ..., chat_prompts: _Optional[bool] = ..., draft_budgets: _Optional[bool] = ..., slo: _Optional[_Union[SessionSlo, _Mapping]] = ..., verify_stream: _Optional[bool] = ..., max_window: _Optional[int] = ..., couplings: _Optional[_Iterable[_Union[Coupling, str]]] = ...) -> None: ...

class VocabularyRequest(_message.Message):
    __slots__ = ("fingerprint",)
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    def __init__(self, fingerprint: _Optional[str] = ...) -> None: ...

class Vocabulary(_message.Message):
    __slots__ = ("fingerprint", "n_vocab", "token_bytes_zlib", "special_token_ids", "eog_token_ids", "byte_token_ids")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_ZLIB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EOG_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    n_vocab: int
    token_bytes_zlib: bytes
    special_token_ids: _containers.RepeatedScalarFieldContainer[int]
    eog_token_ids: _containers.RepeatedScalarFieldContainer[int]
    byte_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, fingerprint: _Optional[str] = ..., n_vocab: _Optional[int] = ..., token_bytes_zlib: _Optional[bytes] = ..., special_token_ids: _Optional[_Iterable[int]] = ..., eog_token_ids: _Optional[_Iterable[int]] = ..., byte_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
