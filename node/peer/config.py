"""What `dsd-node start` was asked to do, as one settings object (light: no torch, no network stack)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dsd.node.server.faults import Fault
from dsd.node.server.limits import BatchOptions, ServerLimits
from dsd.protocol import WireFormat

from .metrics_http import DEFAULT_METRICS_HOST
from .shaper import LinkProfile

if TYPE_CHECKING:
    from dsd.node.fetch.request import FetchRequest


@dataclass
class DaemonConfig:
    """Everything `dsd-node start` was asked to do."""

    identity: Path
    listen: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    bootstrap: list[str] = field(default_factory=list)
    store: Path | None = None
    fetch: FetchRequest | None = None  # `start --model`: no store yet; fetch the span's files first (`serving.fetch_store`)
    blocks: str | None = None  # "A:B" or "auto"
    num_blocks: int | None = None  # for auto
    memory_gb: float | None = None  # for auto without num_blocks: serve as many layers as fit
    link: LinkProfile = field(default_factory=LinkProfile)
    limits: ServerLimits = field(default_factory=ServerLimits)
    wire: WireFormat = field(default_factory=lambda: WireFormat("auto"))  # auto: the codec of the compute dtype
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps (shard_store.devices)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16: the compute dtype, whatever the store holds
    weights: str = "auto"  # auto | fp32 | bf16 | fp16 | int8 | int4: the served layers' weight format
    threads: int | None = None
    throughput: float | None = None  # tokens/s to announce instead of measuring at start (`--throughput`)
    ready_file: Path | None = None
    allow_peers: set[str] | None = None
    record_ttl_s: float = 30.0
    drain_s: float = 30.0  # on SIGTERM/SIGINT: how long open sessions may go on before they are ended (`--drain-s`)
    rebalance_s: float = 60.0  # how often (jittered) a block peer checks whether to move its span; 0 = never
    status_s: float = 60.0  # a status line to stdout (and into the ready file) this often; 0 = none
    seed: int | None = None
    federated: bool = False  # serve the whole model as a federated worker (`/dsd/federated/1`)
    topk_cap: int | None = None  # federated: largest K returned (default: the vocabulary)
    topk_codec: str = "fp16"  # federated: probability codec of the top-K answers
    metrics_port: int | None = None  # serve Prometheus metrics at http://metrics_host:port/metrics (0: any free port)
    metrics_host: str = DEFAULT_METRICS_HOST
    reachability: str = "auto"  # auto (AutoNAT dial-backs) | public | private (reached through relays)
    relay: bool | None = None  # serve circuit relay v2; None: only a bootstrap-only node does
    reachability_check_s: float = 300.0  # auto reachability: ask again this often (a network that changed); 0 = never
    port_mapping: bool = True  # auto reachability found private: ask the gateway for a port (UPnP), announce it if confirmed
    fault: Fault | None = None  # `--faulty`: the block server lies on purpose (tests and demos only)
    batching: BatchOptions = field(default_factory=BatchOptions)  # `--batching`, `--max-batch-tokens`


def parse_blocks(text: str, num_layers: int) -> tuple[int, int]:
    """Parse "A:B" into a half-open span inside [0, num_layers)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise ValueError(f"--blocks must look like START:END (e.g. 0:7) or auto, got {text!r}") from exc
    if not 0 <= a < b <= num_layers:
        raise ValueError(f"--blocks {text}: need 0 <= START < END <= {num_layers} (the model has {num_layers} layers)")
    return a, b
