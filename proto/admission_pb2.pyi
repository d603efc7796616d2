from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchBudgetRequest(_message.Message):
    __slots__ = ("router_id",)
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    def __init__(self, router_id: _Optional[str] = ...) -> None: ...

class TimeModelCoefficients(_message.Message):
    __slots__ = ("a_ms", "b_ms_per_new_token", "c_ms_per_context_token", "e_ms_per_chunk_prefix", "chunk_tokens")
    A_MS_FIELD_NUMBER: _ClassVar[int]
    B_MS_PER_NEW_TOKEN_FIELD_NUMBER: _ClassVar[int]
    C_MS_PER_CONTEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    E_MS_PER_CHUNK_PREFIX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    a_ms: float
    b_ms_per_new_token: float
    c_ms_per_context_token: float
    e_ms_per_chunk_prefix: float
    chunk_tokens: float
    def __init__(self, a_ms: _Optional[float] = ..., b_ms_per_new_token: _Optional[float] = ..., c_ms_per_context_token: _Optional[float] = ..., e_ms_per_chunk_prefix: _Optional[float] = ..., chunk_tokens: _Optional[float] = ...) -> None: ...

class ClassBudget(_message.Message):
    __slots__ = ("slo_class", "ttft_ms", "tpot_ms", "horizon_ms", "pab_ms", "pab_tokens", "decode_reservation_ms", "inflight_reservation_ms", "kv_free_tokens", "kv_limited_tokens", "decode_iterations", "slot_wait_ms")
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    HORIZON_MS_FIELD_NUMBER: _ClassVar[int]
    PAB_MS_FIELD_NUMBER: _ClassVar[int]
    PAB_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_RESERVATION_MS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_RESERVATION_MS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LIMITED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    slo_class: str
    ttft_ms: float
    tpot_ms: float
    horizon_ms: float
    pab_ms: float
    pab_tokens: int
    decode_reservation_ms: float
    inflight_reservation_ms: float
    kv_free_tokens: int
    kv_limited_tokens: int
    decode_iterations: int
    slot_wait_ms: float
    def __init__(self, slo_class: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., horizon_ms: _Optional[float] = ..., pab_ms: _Optional[float] = ..., pab_tokens: _Optional[int] = ..., decode_reservation_ms: _Optional[float] = ..., inflight_reservation_ms: _Optional[float] = ..., kv_free_tokens: _Optional[int] = ..., kv_limited_tokens: _Optional[int] = ..., decode_iterations: _Optional[int] = ..., slot_wait_ms: _Optional[float] = ...) -> None: ...

class BudgetSnapshot(_message.Message):
    __slots__ = ("replica_id", "seq", "timestamp_ms", "ttl_ms", "coefficients", "classes", "healthy", "num_running", "num_waiting", "kv_usage", "kv_capacity_tokens", "active_leases", "max_prompt_tokens", "status_detail", "inflight_prefill_ms", "inflight_prefill_done_ms", "prefix_queries_tokens", "prefix_hits_tokens", "inline_admission", "draining")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAIL_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PREFILL_DONE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INLINE_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    seq: int
    timestamp_ms: int
    ttl_ms: int
    coefficients: TimeModelCoefficients
    classes: _containers.RepeatedCompositeFieldContainer[ClassBudget]
    healthy: bool
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_capacity_tokens: int
    active_leases: int
    max_prompt_tokens: int
    status_detail: str
    inflight_prefill_ms: _containers.RepeatedScalarFieldContainer[float]
    inflight_prefill_done_ms: _containers.RepeatedScalarFieldContainer[float]
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    inline_admission: bool
    draining: bool
    def __init__(self, replica_id: _Optional[str] = ..., seq: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., coefficients: _Optional[_Union[TimeModelCoefficients, _Mapping]] = ..., classes: _Optional[_Iterable[_Union[ClassBudget, _Mapping]]] = ..., healthy: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_capacity_tokens: _Optional[int] = ..., active_leases: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., status_detail: _Optional[str] = ..., inflight_prefill_ms: _Optional[_Iterable[float]] = ..., inflight_prefill_done_ms: _Optional[_Iterable[float]] = ..., prefix_queries_tokens: _Optional[int] = ..., prefix_hits_tokens: _Optional[int] = ..., inline_admission: _Optional[bool] = ..., draining: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("slo_class", "prompt_tokens", "request_id", "router_id", "max_tokens", "waited_ms", "on_time_only")
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    ON_TIME_ONLY_FIELD_NUMBER: _ClassVar[int]
    slo_class: str
    prompt_tokens: int
    request_id: str
    router_id: str
    max_tokens: int
    waited_ms: float
    on_time_only: bool
    def __init__(self, slo_class: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., router_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., waited_ms: _Optional[float] = ..., on_time_only: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("granted", "lease_id", "reason", "pab_ms", "pab_tokens", "expires_ms", "seq")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PAB_MS_FIELD_NUMBER: _ClassVar[int]
    PAB_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    lease_id: str
    reason: str
    pab_ms: float
    pab_tokens: int
    expires_ms: int
    seq: int
    def __init__(self, granted: _Optional[bool] = ..., lease_id: _Optional[str] = ..., reason: _Optional[str] = ..., pab_ms: _Optional[float] = ..., pab_tokens: _Optional[int] = ..., expires_ms: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
