"""What a fetch is asked (`FetchRequest`, checked when built) and what it works with: the source peers, progress
snapshots, and how it fails."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsd.protocol.limits import SHARD_CHUNK_BYTES
from dsd.shard_store.manifest import LAYERS_DIR

TRUST_HELP = (
    "the manifest's sha256 is the trust root of a fetch: every file is checked against the manifest, so "
    "without a pinned manifest any peer could hand you one listing tampered weights and every file would "
    "still verify"
)


class FetchError(RuntimeError):
    """The fetch cannot finish: no peer announces the model, no manifest matches, or files no peer could send."""


@dataclass
class FetchRequest:
    """What to fetch and how: the model, its trust root, where to put it, piece and chunk sizes, peers at once."""

    model: str
    manifest_sha256: str | None = None
    trust_first: bool = False  # no pinned hash: trust the manifest most peers announce
    out: Path | None = None  # default: default_fetch_dir(model, manifest sha256, fetch_root)
    fetch_root: Path | None = None
    piece_bytes: int = 32 * 1024 * 1024
    chunk_bytes: int = SHARD_CHUNK_BYTES
    max_peers: int = 8
    find_timeout_s: float = 60.0  # wait this long for a peer announcing the model
    connect_timeout_s: float = 10.0
    reply_timeout_s: float = 60.0  # a peer silent this long mid-request is dropped
    busy_retries: int = 20  # back off this many times on a busy peer before leaving it

    def __post_init__(self) -> None:
        if self.manifest_sha256 is not None:
            sha = self.manifest_sha256.strip().lower()
            if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
                raise ValueError(f"--manifest-sha256 must be 64 hex characters, got {self.manifest_sha256!r}")
            self.manifest_sha256 = sha
        elif not self.trust_first:
            raise ValueError(f"fetching {self.model} needs --manifest-sha256 HEX: {TRUST_HELP}. "
                             "--trust-first-manifest accepts the manifest most peers announce (and prints its hash)")
        if not 1 <= self.chunk_bytes <= SHARD_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {SHARD_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.piece_bytes < 1 or self.max_peers < 1:
            raise ValueError("piece_bytes and max_peers must be >= 1")


@dataclass
class Source:
    """A peer announcing the model: its addresses, announced spans and how it fared in this fetch."""

    peer_id: str
    addrs: tuple[str, ...]
    spans: list[tuple[int, int]] = field(default_factory=list)
    manifest_sha256: str | None = None
    state: str = "ok"  # ok | dropped | blacklisted
    reason: str = ""
    bytes: int = 0

    def announces_layer(self, index: int) -> bool:
        return any(a <= index < b for a, b in self.spans)


@dataclass(frozen=True)
class FetchProgress:
    """A snapshot for progress displays."""

    received: int
    total: int
    peers: int
    files_done: int
    files_total: int


def _layer_index(relpath: str) -> int | None:
    prefix = f"{LAYERS_DIR}/layer_"
    if relpath.startswith(prefix) and relpath.endswith(".safetensors"):
        digits = relpath[len(prefix):-len(".safetensors")]
        return int(digits) if digits.isdigit() else None
    return None
