"""Sans-IO wire protocol: messages, framing, session rules, token-tree rules (`tree_rules`), tensor and top-K codecs,
shard transfer (`shard`).

Bytes in, typed messages out, or a `ProtocolError` naming the field that was wrong.
No sockets, no event loop, no model code.
"""

from .errors import ProtocolError, SessionRuleError
from .federated import DraftWindow, TopKResult
from .framing import FrameDecoder, decode_body, encode
from .limits import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, check_version, parse_version
from .messages import (
    ERROR_CODES,
    MESSAGE_TYPES,
    Ack,
    Attach,
    CloseSession,
    Error,
    Forward,
    Hello,
    Hop,
    Message,
    Move,
    Moved,
    OpenSession,
    Ping,
    Pong,
    Result,
    Truncate,
)
from .peer_session import SessionState
from .records import RECORDS_LIMITS, RecordsFound, RecordsGet, RecordsPut, RecordsStored
from .shard import FileChunk, FileEnd, GetFile, GetManifest, ManifestData
from .tensors import CODECS, WireFormat, WireTensor, codec_for_dtype, decode_tensor, encode_tensor
from .topk import aggregate, decode_ids, encode_ids, reconstruct, topk_from_probs

__all__ = [
    "CODECS",
    "DEFAULT_LIMITS",
    "ERROR_CODES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "RECORDS_LIMITS",
    "Ack",
    "Attach",
    "CloseSession",
    "DraftWindow",
    "Error",
    "FileChunk",
    "FileEnd",
    "FrameDecoder",
    "Forward",
    "GetFile",
    "GetManifest",
    "Hello",
    "Hop",
    "Limits",
    "ManifestData",
    "Message",
    "Move",
    "Moved",
    "OpenSession",
    "Ping",
    "Pong",
    "ProtocolError",
    "RecordsFound",
    "RecordsGet",
    "RecordsPut",
    "RecordsStored",
    "Result",
    "SessionRuleError",
    "SessionState",
    "TopKResult",
    "Truncate",
    "WireFormat",
    "WireTensor",
    "aggregate",
    "check_version",
    "codec_for_dtype",
    "decode_body",
    "decode_ids",
    "decode_tensor",
    "encode",
    "encode_ids",
    "encode_tensor",
    "parse_version",
    "reconstruct",
    "topk_from_probs",
]
