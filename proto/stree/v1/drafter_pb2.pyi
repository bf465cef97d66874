from stree.proto.stree.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_MODE_DETERMINISTIC: _ClassVar[DraftMode]
    DRAFT_MODE_IID: _ClassVar[DraftMode]
    DRAFT_MODE_WITHOUT_REPLACEMENT: _ClassVar[DraftMode]
DRAFT_MODE_DETERMINISTIC: DraftMode
DRAFT_MODE_IID: DraftMode
DRAFT_MODE_WITHOUT_REPLACEMENT: DraftMode

class DrafterRequest(_message.Message):
    __slots__ = ("open", "commit", "draft", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    commit: CommitTokens
    draft: DraftRequest
    close: CloseSession
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., commit: _Optional[_Union[CommitTokens, _Mapping]] = ..., draft: _Optional[_Union[DraftRequest, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "drafter", "budget", "sampling", "overlap")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter: str
    budget: _common_pb2.DraftBudget
    sampling: _common_pb2.SamplingParams
    overlap: OverlapOptions
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., drafter: _Optional[str] = ..., budget: _Optional[_Union[_common_pb2.DraftBudget, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., overlap: _Optional[_Union[OverlapOptions, _Mapping]] = ...) -> None: ...

class OverlapOptions(_message.Message):
    __slots__ = ("max_hypotheses",)
    MAX_HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    max_hypotheses: int
    def __init__(self, max_hypotheses: _Optional[int] = ...) -> None: ...

class CommitTokens(_message.Message):
    __slots__ = ("tokens", "context_length")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    context_length: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., context_length: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("request_id", "context_length", "budget", "predrafted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    context_length: int
    budget: _common_pb2.DraftBudget
    predrafted: bool
    def __init__(self, request_id: _Optional[int] = ..., context_length: _Optional[int] = ..., budget: _Optional[_Union[_common_pb2.DraftBudget, _Mapping]] = ..., predrafted: bool = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterResponse(_message.Message):
    __slots__ = ("opened", "tree", "error")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    tree: DraftTree
    error: DrafterError
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., error: _Optional[_Union[DrafterError, _Mapping]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "replica", "max_hypotheses")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MAX_HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    replica: str
    max_hypotheses: int
    def __init__(self, session_id: _Optional[str] = ..., replica: _Optional[str] = ..., max_hypotheses: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("request_id", "context_length", "tokens", "parents", "draft_probs", "vocab_size", "mode", "draft_seconds", "assumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    context_length: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: bytes
    vocab_size: int
    mode: DraftMode
    draft_seconds: float
    assumed_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[int] = ..., context_length: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., mode: _Optional[_Union[DraftMode, str]] = ..., draft_seconds: _Optional[float] = ..., assumed_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DrafterError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[DrafterError.Code]
        INVALID_ARGUMENT: _ClassVar[DrafterError.Code]
        UNAVAILABLE: _ClassVar[DrafterError.Code]
        DRAFTER_FAILED: _ClassVar[DrafterError.Code]
    CODE_UNSPECIFIED: DrafterError.Code
    INVALID_ARGUMENT: DrafterError.Code
    UNAVAILABLE: DrafterError.Code
    DRAFTER_FAILED: DrafterError.Code
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    code: DrafterError.Code
    message: str
    def __init__(self, request_id: _Optional[int] = ..., code: _Optional[_Union[DrafterError.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...
