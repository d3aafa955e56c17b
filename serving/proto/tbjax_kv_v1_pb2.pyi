from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferMessage(_message.Message):
    __slots__ = ("announce", "chunk")
    ANNOUNCE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    announce: AnnounceRequest
    chunk: KVChunk
    def __init__(self, announce: _Optional[_Union[AnnounceRequest, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("grant", "result")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    grant: AnnounceResponse
    result: PushResult
    def __init__(self, grant: _Optional[_Union[AnnounceResponse, _Mapping]] = ..., result: _Optional[_Union[PushResult, _Mapping]] = ...) -> None: ...

class PageLayout(_message.Message):
    __slots__ = ("dtype", "shape", "scales_shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SCALES_SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    scales_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., scales_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class AnnounceRequest(_message.Message):
    __slots__ = ("request_id", "num_pages", "num_tokens", "layout", "codecs", "host_id", "shm", "ipc", "pid")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_pages: int
    num_tokens: int
    layout: PageLayout
    codecs: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    shm: bool
    ipc: bool
    pid: int
    def __init__(self, request_id: _Optional[str] = ..., num_pages: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., codecs: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., shm: _Optional[bool] = ..., ipc: _Optional[bool] = ..., pid: _Optional[int] = ...) -> None: ...

class AnnounceResponse(_message.Message):
    __slots__ = ("reservation_id", "codec", "timeout_ms", "shm_name", "shm_offset", "ipc_handle", "ipc_offset")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    IPC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    codec: str
    timeout_ms: int
    shm_name: str
    shm_offset: int
    ipc_handle: bytes
    ipc_offset: int
    def __init__(self, reservation_id: _Optional[str] = ..., codec: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., ipc_offset: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("reservation_id", "first_page", "num_pages", "codec", "raw_nbytes", "payload", "crc32", "last", "in_shm", "checksum64", "scales", "scales_crc32", "in_ipc")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    IN_SHM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM64_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    SCALES_CRC32_FIELD_NUMBER: _ClassVar[int]
    IN_IPC_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    first_page: int
    num_pages: int
    codec: str
    raw_nbytes: int
    payload: bytes
    crc32: int
    last: bool
    in_shm: bool
    checksum64: int
    scales: bytes
    scales_crc32: int
    in_ipc: bool
    def __init__(self, reservation_id: _Optional[str] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., codec: _Optional[str] = ..., raw_nbytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32: _Optional[int] = ..., last: _Optional[bool] = ..., in_shm: _Optional[bool] = ..., checksum64: _Optional[int] = ..., scales: _Optional[bytes] = ..., scales_crc32: _Optional[int] = ..., in_ipc: _Optional[bool] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("reservation_id", "pages", "raw_bytes", "wire_bytes", "shm", "path")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    pages: int
    raw_bytes: int
    wire_bytes: int
    shm: bool
    path: str
    def __init__(self, reservation_id: _Optional[str] = ..., pages: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., shm: _Optional[bool] = ..., path: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation_id", "reason")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    reason: str
    def __init__(self, reservation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
