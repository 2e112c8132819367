from verifypd.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_ROLE_UNSPECIFIED: _ClassVar[PoolRole]
    POOL_ROLE_TARGET: _ClassVar[PoolRole]
    POOL_ROLE_DRAFT: _ClassVar[PoolRole]

class LaneMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANE_METHOD_UNSPECIFIED: _ClassVar[LaneMethod]
    LANE_METHOD_PREFILL: _ClassVar[LaneMethod]
    LANE_METHOD_DRAFT: _ClassVar[LaneMethod]
    LANE_METHOD_VERIFY: _ClassVar[LaneMethod]
POOL_ROLE_UNSPECIFIED: PoolRole
POOL_ROLE_TARGET: PoolRole
POOL_ROLE_DRAFT: PoolRole
LANE_METHOD_UNSPECIFIED: LaneMethod
LANE_METHOD_PREFILL: LaneMethod
LANE_METHOD_DRAFT: LaneMethod
LANE_METHOD_VERIFY: LaneMethod

class CudaIpcHandle(_message.Message):
    __slots__ = ("mem_handle", "storage_offset_bytes", "storage_size_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    storage_offset_bytes: int
    storage_size_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, mem_handle: _Optional[bytes] = ..., storage_offset_bytes: _Optional[int] = ..., storage_size_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("pool_id", "generation", "role", "host_boot_id", "device_uuid", "layout", "dtype", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "window", "shm_path", "cuda_ipc", "owner_pid", "kv_transfer_addr", "rank_shards")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOST_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDR_FIELD_NUMBER: _ClassVar[int]
    RANK_SHARDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    generation: int
    role: PoolRole
    host_boot_id: str
    device_uuid: str
    layout: str
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    window: int
    shm_path: str
    cuda_ipc: CudaIpcHandle
    owner_pid: int
    kv_transfer_addr: str
    rank_shards: _containers.RepeatedCompositeFieldContainer[PoolDescriptor]
    def __init__(self, pool_id: _Optional[str] = ..., generation: _Optional[int] = ..., role: _Optional[_Union[PoolRole, str]] = ..., host_boot_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., layout: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., window: _Optional[int] = ..., shm_path: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., owner_pid: _Optional[int] = ..., kv_transfer_addr: _Optional[str] = ..., rank_shards: _Optional[_Iterable[_Union[PoolDescriptor, _Mapping]]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("pool_id", "generation", "block_ids", "seq_len", "committed_len")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    generation: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    seq_len: int
    committed_len: int
    def __init__(self, pool_id: _Optional[str] = ..., generation: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., seq_len: _Optional[int] = ..., committed_len: _Optional[int] = ...) -> None: ...

class LaneSampling(_message.Message):
    __slots__ = ("params", "seed")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    params: _generate_pb2.SamplingParams
    seed: int
    def __init__(self, params: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("rows", "dense_f32", "vocab_size", "sparse_width", "sparse_ids_u32", "sparse_probs_f32")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DENSE_F32_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    SPARSE_IDS_U32_FIELD_NUMBER: _ClassVar[int]
    SPARSE_PROBS_F32_FIELD_NUMBER: _ClassVar[int]
    rows: int
    dense_f32: bytes
    vocab_size: int
    sparse_width: int
    sparse_ids_u32: bytes
    sparse_probs_f32: bytes
    def __init__(self, rows: _Optional[int] = ..., dense_f32: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., sparse_width: _Optional[int] = ..., sparse_ids_u32: _Optional[bytes] = ..., sparse_probs_f32: _Optional[bytes] = ...) -> None: ...

class LaneInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LaneInfo(_message.Message):
    __slots__ = ("lane", "target_model", "draft_model", "pools", "vocab_size", "max_context", "eos_token_ids", "kv_bytes_received", "call_port", "draft_handoff", "feeds_tokens")
    LANE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CALL_PORT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    FEEDS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lane: str
    target_model: str
    draft_model: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolDescriptor]
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_bytes_received: int
    call_port: int
    draft_handoff: DraftHandoff
    feeds_tokens: bool
    def __init__(self, lane: _Optional[str] = ..., target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolDescriptor, _Mapping]]] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kv_bytes_received: _Optional[int] = ..., call_port: _Optional[int] = ..., draft_handoff: _Optional[_Union[DraftHandoff, _Mapping]] = ..., feeds_tokens: _Optional[bool] = ...) -> None: ...

class DraftHandoff(_message.Message):
    __slots__ = ("buffer", "device_uuid", "host_boot_id", "rows", "cols", "slot_events")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HOST_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    SLOT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    buffer: CudaIpcHandle
    device_uuid: str
    host_boot_id: str
    rows: int
    cols: int
    slot_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, buffer: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., device_uuid: _Optional[str] = ..., host_boot_id: _Optional[str] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., slot_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ImportPoolsRequest(_message.Message):
    __slots__ = ("pools", "kv_transport", "forward_kv_written_event", "draft_handoff")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_KV_WRITTEN_EVENT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolDescriptor]
    kv_transport: str
    forward_kv_written_event: bool
    draft_handoff: DraftHandoff
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolDescriptor, _Mapping]]] = ..., kv_transport: _Optional[str] = ..., forward_kv_written_event: _Optional[bool] = ..., draft_handoff: _Optional[_Union[DraftHandoff, _Mapping]] = ...) -> None: ...

class ImportPoolsReply(_message.Message):
    __slots__ = ("mode_by_pool", "import_seconds", "kv_written_event")
    class ModeByPoolEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODE_BY_POOL_FIELD_NUMBER: _ClassVar[int]
    IMPORT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_WRITTEN_EVENT_FIELD_NUMBER: _ClassVar[int]
    mode_by_pool: _containers.ScalarMap[str, str]
    import_seconds: float
    kv_written_event: bytes
    def __init__(self, mode_by_pool: _Optional[_Mapping[str, str]] = ..., import_seconds: _Optional[float] = ..., kv_written_event: _Optional[bytes] = ...) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("request_id", "token_ids", "start_pos", "target_kv", "draft_kv", "is_last_chunk", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TARGET_KV_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    target_kv: KvHandle
    draft_kv: KvHandle
    is_last_chunk: bool
    sampling: LaneSampling
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., target_kv: _Optional[_Union[KvHandle, _Mapping]] = ..., draft_kv: _Optional[_Union[KvHandle, _Mapping]] = ..., is_last_chunk: _Optional[bool] = ..., sampling: _Optional[_Union[LaneSampling, _Mapping]] = ...) -> None: ...

class PrefillBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ...) -> None: ...

class PrefillOutput(_message.Message):
    __slots__ = ("request_id", "first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("outputs", "kv_bytes_copied")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[PrefillOutput]
    kv_bytes_copied: int
    def __init__(self, outputs: _Optional[_Iterable[_Union[PrefillOutput, _Mapping]]] = ..., kv_bytes_copied: _Optional[int] = ...) -> None: ...

class DraftItem(_message.Message):
    __slots__ = ("request_id", "input_tokens", "start_pos", "draft_kv", "k", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_tokens: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    draft_kv: KvHandle
    k: int
    sampling: LaneSampling
    def __init__(self, request_id: _Optional[str] = ..., input_tokens: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., draft_kv: _Optional[_Union[KvHandle, _Mapping]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[LaneSampling, _Mapping]] = ...) -> None: ...

class DraftBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ...) -> None: ...

class DraftOutput(_message.Message):
    __slots__ = ("request_id", "draft_tokens", "probs", "resync_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    resync_from: int
    def __init__(self, request_id: _Optional[str] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., resync_from: _Optional[int] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DraftOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DraftOutput, _Mapping]]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("request_id", "pending_token", "start_pos", "draft_tokens", "draft_probs", "target_kv", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    TARGET_KV_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pending_token: int
    start_pos: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: DraftProbs
    target_kv: KvHandle
    sampling: LaneSampling
    def __init__(self, request_id: _Optional[str] = ..., pending_token: _Optional[int] = ..., start_pos: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., target_kv: _Optional[_Union[KvHandle, _Mapping]] = ..., sampling: _Optional[_Union[LaneSampling, _Mapping]] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class VerifyOutput(_message.Message):
    __slots__ = ("request_id", "accepted", "new_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., accepted: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[VerifyOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[VerifyOutput, _Mapping]]] = ...) -> None: ...

class RequestIntro(_message.Message):
    __slots__ = ("key", "request_id", "sampling")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    key: int
    request_id: str
    sampling: LaneSampling
    def __init__(self, key: _Optional[int] = ..., request_id: _Optional[str] = ..., sampling: _Optional[_Union[LaneSampling, _Mapping]] = ...) -> None: ...

class BlockTableDelta(_message.Message):
    __slots__ = ("pool_id", "generation", "keep_u32", "added_count_u32", "added_u32")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KEEP_U32_FIELD_NUMBER: _ClassVar[int]
    ADDED_COUNT_U32_FIELD_NUMBER: _ClassVar[int]
    ADDED_U32_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    generation: int
    keep_u32: bytes
    added_count_u32: bytes
    added_u32: bytes
    def __init__(self, pool_id: _Optional[str] = ..., generation: _Optional[int] = ..., keep_u32: _Optional[bytes] = ..., added_count_u32: _Optional[bytes] = ..., added_u32: _Optional[bytes] = ...) -> None: ...

class PackedBatch(_message.Message):
    __slots__ = ("intros", "released", "keys_u32", "start_pos_u32", "token_count_u32", "tokens_u32", "pending_u32", "k_u32", "last_chunk_u32", "target_blocks", "draft_blocks", "probs_items_u32", "draft_probs", "wait_event", "handoff_slot", "draft_rows_u32", "feed_call", "feed_rows_u32")
    INTROS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KEYS_U32_FIELD_NUMBER: _ClassVar[int]
    START_POS_U32_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_U32_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32_FIELD_NUMBER: _ClassVar[int]
    PENDING_U32_FIELD_NUMBER: _ClassVar[int]
    K_U32_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_U32_FIELD_NUMBER: _ClassVar[int]
    TARGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROBS_ITEMS_U32_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SLOT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROWS_U32_FIELD_NUMBER: _ClassVar[int]
    FEED_CALL_FIELD_NUMBER: _ClassVar[int]
    FEED_ROWS_U32_FIELD_NUMBER: _ClassVar[int]
    intros: _containers.RepeatedCompositeFieldContainer[RequestIntro]
    released: _containers.RepeatedScalarFieldContainer[int]
    keys_u32: bytes
    start_pos_u32: bytes
    token_count_u32: bytes
    tokens_u32: bytes
    pending_u32: bytes
    k_u32: bytes
    last_chunk_u32: bytes
    target_blocks: BlockTableDelta
    draft_blocks: BlockTableDelta
    probs_items_u32: bytes
    draft_probs: _containers.RepeatedCompositeFieldContainer[DraftProbs]
    wait_event: bytes
    handoff_slot: int
    draft_rows_u32: bytes
    feed_call: int
    feed_rows_u32: bytes
    def __init__(self, intros: _Optional[_Iterable[_Union[RequestIntro, _Mapping]]] = ..., released: _Optional[_Iterable[int]] = ..., keys_u32: _Optional[bytes] = ..., start_pos_u32: _Optional[bytes] = ..., token_count_u32: _Optional[bytes] = ..., tokens_u32: _Optional[bytes] = ..., pending_u32: _Optional[bytes] = ..., k_u32: _Optional[bytes] = ..., last_chunk_u32: _Optional[bytes] = ..., target_blocks: _Optional[_Union[BlockTableDelta, _Mapping]] = ..., draft_blocks: _Optional[_Union[BlockTableDelta, _Mapping]] = ..., probs_items_u32: _Optional[bytes] = ..., draft_probs: _Optional[_Iterable[_Union[DraftProbs, _Mapping]]] = ..., wait_event: _Optional[bytes] = ..., handoff_slot: _Optional[int] = ..., draft_rows_u32: _Optional[bytes] = ..., feed_call: _Optional[int] = ..., feed_rows_u32: _Optional[bytes] = ...) -> None: ...

class LaneCall(_message.Message):
    __slots__ = ("call_id", "method", "batch", "traceparent")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    method: LaneMethod
    batch: PackedBatch
    traceparent: str
    def __init__(self, call_id: _Optional[int] = ..., method: _Optional[_Union[LaneMethod, str]] = ..., batch: _Optional[_Union[PackedBatch, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class LaneReply(_message.Message):
    __slots__ = ("call_id", "status_code", "error", "count_u32", "tokens_u32", "probs_items_u32", "draft_probs", "resync_from_u32", "kv_bytes_copied")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COUNT_U32_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32_FIELD_NUMBER: _ClassVar[int]
    PROBS_ITEMS_U32_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FROM_U32_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    status_code: int
    error: str
    count_u32: bytes
    tokens_u32: bytes
    probs_items_u32: bytes
    draft_probs: _containers.RepeatedCompositeFieldContainer[DraftProbs]
    resync_from_u32: bytes
    kv_bytes_copied: int
    def __init__(self, call_id: _Optional[int] = ..., status_code: _Optional[int] = ..., error: _Optional[str] = ..., count_u32: _Optional[bytes] = ..., tokens_u32: _Optional[bytes] = ..., probs_items_u32: _Optional[bytes] = ..., draft_probs: _Optional[_Iterable[_Union[DraftProbs, _Mapping]]] = ..., resync_from_u32: _Optional[bytes] = ..., kv_bytes_copied: _Optional[int] = ...) -> None: ...

class KvBlockChunk(_message.Message):
    __slots__ = ("pool_id", "generation", "block_id", "layer", "data")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    generation: int
    block_id: int
    layer: int
    data: bytes
    def __init__(self, pool_id: _Optional[str] = ..., generation: _Optional[int] = ..., block_id: _Optional[int] = ..., layer: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("pool_id", "generation", "block_ids")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    generation: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool_id: _Optional[str] = ..., generation: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WriteBlocksReply(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...
