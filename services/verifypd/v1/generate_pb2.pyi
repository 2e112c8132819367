from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SpeculationOverride(_message.Message):
    __slots__ = ("disable", "max_k")
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    disable: bool
    max_k: int
    def __init__(self, disable: _Optional[bool] = ..., max_k: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "max_tokens", "stop", "speculation", "priority", "stop_at_eos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: SpeculationOverride
    priority: int
    stop_at_eos: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[SpeculationOverride, _Mapping]] = ..., priority: _Optional[int] = ..., stop_at_eos: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens", "verify_steps", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "applied_k", "server_elapsed_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_K_FIELD_NUMBER: _ClassVar[int]
    SERVER_ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    applied_k: int
    server_elapsed_s: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., applied_k: _Optional[int] = ..., server_elapsed_s: _Optional[float] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("target_model", "draft_model", "topology", "max_context", "version")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    topology: str
    max_context: int
    version: str
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., topology: _Optional[str] = ..., max_context: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...
