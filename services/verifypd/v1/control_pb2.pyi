from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LanePriorities(_message.Message):
    __slots__ = ("draft", "verify", "prefill")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    draft: int
    verify: int
    prefill: int
    def __init__(self, draft: _Optional[int] = ..., verify: _Optional[int] = ..., prefill: _Optional[int] = ...) -> None: ...

class RuntimeConfig(_message.Message):
    __slots__ = ("k_min", "k_max", "k_initial", "adaptive", "priorities", "prefill_token_budget", "revision")
    K_MIN_FIELD_NUMBER: _ClassVar[int]
    K_MAX_FIELD_NUMBER: _ClassVar[int]
    K_INITIAL_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    k_min: int
    k_max: int
    k_initial: int
    adaptive: bool
    priorities: LanePriorities
    prefill_token_budget: int
    revision: int
    def __init__(self, k_min: _Optional[int] = ..., k_max: _Optional[int] = ..., k_initial: _Optional[int] = ..., adaptive: _Optional[bool] = ..., priorities: _Optional[_Union[LanePriorities, _Mapping]] = ..., prefill_token_budget: _Optional[int] = ..., revision: _Optional[int] = ...) -> None: ...

class UpdateConfigRequest(_message.Message):
    __slots__ = ("config", "requested_by", "reason")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    config: RuntimeConfig
    requested_by: str
    reason: str
    def __init__(self, config: _Optional[_Union[RuntimeConfig, _Mapping]] = ..., requested_by: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
