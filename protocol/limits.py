"""Protocol version and the hard limits every decoder enforces before it allocates anything."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from .errors import VERSION, ProtocolError

PROTOCOL_VERSION = "1.1"  # 1.1: token-tree windows (Forward / DraftWindow parents and keep)
PROTOCOL_MAJOR = 1

# Positions, lengths and token ids fit in a signed 32-bit int; epochs and nonces in 64 bits.
MAX_POSITION = 2**31 - 1
MAX_U63 = 2**63 - 1
MAX_U64 = 2**64 - 1
# Shard transfer (`shard.py`): file data travels in chunks of at most this many bytes; offsets and
# lengths of a file range stay below MAX_FILE_BYTES (1 TiB: more than any weight file).
SHARD_CHUNK_BYTES = 4 * 1024 * 1024
MAX_FILE_BYTES = 2**40

_VERSION_RE = re.compile(r"\A(\d{1,4})\.(\d{1,4})\Z")


@dataclass(frozen=True)
class Limits:
    """Upper bounds for one peer's decoder; the defaults fit a 4096-wide model and a 152k vocabulary."""

    max_frame_bytes: int = 64 * 1024 * 1024
    max_tensor_elements: int = 1 << 24
    max_rank: int = 4
    max_route: int = 32
    max_str: int = 1024
    max_list: int = 64
    max_tokens_per_window: int = 1024
    max_topk: int = 1 << 18
    max_payload: int = 1 << 20
    max_tree_nodes: int = 64  # nodes of a token-tree window (EAGLE-2 drafts 48-60)
    max_chunk_bytes: int = SHARD_CHUNK_BYTES  # data of one FileChunk
    max_manifest_bytes: int = 4 * 1024 * 1024  # a store's manifest.json in a ManifestData reply

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive int, got {value!r}")
        if self.max_tree_nodes > self.max_tokens_per_window:
            raise ValueError("Limits.max_tree_nodes must not exceed max_tokens_per_window (a tree is a window)")
        if self.max_frame_bytes > 2**32 - 1:
            raise ValueError("Limits.max_frame_bytes must fit the 4-byte frame header (< 4 GiB)")


DEFAULT_LIMITS = Limits()


def parse_version(version: object, field: str = "v") -> tuple[int, int]:
    """Split a "major.minor" version string; anything else is a ProtocolError naming `field`."""
    if not isinstance(version, str):
        raise ProtocolError(f"version must be a 'major.minor' string, got {type(version).__name__}", field, VERSION)
    m = _VERSION_RE.match(version)
    if m is None:
        raise ProtocolError(f"version must look like 'major.minor', got {version[:32]!r}", field, VERSION)
    return int(m.group(1)), int(m.group(2))


def check_version(version: object, field: str = "v") -> tuple[int, int]:
    """Accept any minor of our major version (newer minors only add fields); other majors are refused."""
    major, minor = parse_version(version, field)
    if major != PROTOCOL_MAJOR:
        raise ProtocolError(
            f"unsupported protocol major version {major} (this peer speaks {PROTOCOL_VERSION})", field, VERSION
        )
    return major, minor
