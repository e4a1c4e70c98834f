"""Options several commands share: the emulated WAN, CPU pinning, device and dtype, the allow list, the default
identity file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsd.node.head.levers import LEVERS, lever_options
from dsd.node.peer.cpus import parse_cpus, pin_head
from dsd.node.peer.shaper import LinkProfile
from dsd.node.route.audit_rules import AUDIT_TOLERANCES, DEFAULT_AUDIT_RATE
from dsd.node.testnet.link_profiles import PROFILES, build_link
from dsd.protocol.deadlines import DeadlineRule
from dsd.shard_store.manifest import STORE_DTYPES

if TYPE_CHECKING:
    from dsd.node.route.audit import AuditOptions
    from dsd.protocol.tensors import WireFormat

DEFAULT_IDENTITY = Path.home() / ".config" / "dsd" / "identity.key"


def add_wan_options(p: argparse.ArgumentParser, sender: str = "this process") -> argparse._ArgumentGroup:
    """The emulated-WAN options shared by every command that sends frames (sent by `sender`): a named profile,
    or its fields; returns their group (a command adds its own there)."""
    g = p.add_argument_group("emulated WAN (off by default; docs/link_profiles.md)")
    g.add_argument("--link-profile", choices=tuple(PROFILES), default=None, metavar="NAME", help=f"a named link for the frames sent by {sender}: {'; '.join(f'{n} = {q.emulates}' for n, q in PROFILES.items())}. A --wan-* option given with it overrides that field")
    g.add_argument("--wan-latency-ms", type=float, default=None, metavar="MS", help=f"one-way latency added to each frame sent by {sender} (default 0, or the --link-profile's)")
    g.add_argument("--wan-jitter-ms", type=float, default=None, metavar="MS", help="uniform jitter (± MS, at most the latency; default 0, or the --link-profile's)")
    g.add_argument("--wan-mbit", type=float, default=None, metavar="MBIT", help="bandwidth cap of each link in megabit/s (default unlimited, or the --link-profile's; 0 = unlimited)")
    return g


HIDDEN_CODECS = ("auto", "raw", "fp16", "bf16", "int8")  # the hidden-state codecs of `protocol.tensors`


def add_codec_options(p: argparse.ArgumentParser, whose: str) -> None:
    """`--codec` and `--zstd`: how `whose` hidden states go on the wire (`wire_format(args)`)."""
    p.add_argument("--codec", choices=HIDDEN_CODECS, default="auto", help=f"{whose} hidden-state codec on the wire (default auto: the compute dtype's, exact: raw for float32, bf16/fp16 for half precision; bf16/fp16 from float32 and int8 round the activations, so greedy output may change)")
    p.add_argument("--zstd", action="store_true", help=f"zstd-compress {whose} hidden states")


def wire_format(args: argparse.Namespace) -> WireFormat:
    """The wire format `add_codec_options` asked for."""
    from dsd.protocol.tensors import WireFormat

    return WireFormat(args.codec, args.zstd)


def cpu_list(text: str) -> frozenset[int]:
    """argparse type of a CPU list (`1`, `1-3`, `0,2-3`), checked against the CPUs this process may use."""
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_cpus_option(p: argparse.ArgumentParser) -> None:
    """`--cpus LIST`: the head process runs on these CPUs only, with one torch thread each unless --threads."""
    p.add_argument("--cpus", type=cpu_list, default=None, metavar="LIST", help="pin this process to these CPUs (e.g. 0 or 0-1 or 0,2), with one torch thread per CPU unless --threads says otherwise: on one box, keeps the head's drafting off the cores the peers run on (testnet up --peer-cpus)")


# Spelled out so `--help` loads no torch; tests check they match dsd.shard_store.devices.
DEVICE_HELP = "auto|cpu|cuda|cuda:N|mps"
COMPUTE_DTYPES = ("auto", *STORE_DTYPES)


def add_device_options(p: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype`: where this process computes and in which dtype (resolved by
    `dsd.shard_store.devices.resolve_placement(args.device, args.dtype)`)."""
    g = p.add_argument_group("device")
    g.add_argument("--device", default="auto", metavar=DEVICE_HELP, help="where models compute: auto = CUDA, else Apple MPS, else the CPU (default auto)")
    g.add_argument("--dtype", choices=COMPUTE_DTYPES, default="auto", help="compute dtype, whatever the store holds (cast at load): auto = bfloat16 on CUDA GPUs that support it, float16 on other GPUs, float32 on the CPU (bit-exact; default auto)")


WEIGHT_FORMATS = ("auto", "fp32", "bf16", "fp16", "int8", "int4", "q4k")  # spelled out: `--help` loads no torch


def add_weights_option(p: argparse.ArgumentParser, whose: str) -> None:
    """`--weights`: the format the layers' weights are held in (`dsd.shard_store.quant`)."""
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto", help=f"the format {whose} weights are held "
                   "in: auto = the --dtype's; fp32 | bf16 | fp16 set the dtype; int8 (per-channel scales) | int4 "
                   "(groups of 128) pack every linear of the layers and compute in bfloat16, on the CPU (5× and 8× "
                   "fewer bytes than fp32); q4k: a store converted with `convert --weights q4k` from a GGUF, its own "
                   "4-bit blocks as they are; embeddings and lm_head stay in the dtype (default auto)")


DEFAULT_LISTEN = "/ip4/127.0.0.1/tcp/0"


def add_listen_option(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument("--listen", action="append", default=None, metavar="MULTIADDR", help=f"{whose} listen address (default {DEFAULT_LISTEN}; behind a NAT, the LAN address lets hole punching reuse its port)")
    p.add_argument("--quic", choices=("on", "off"), default="off", help="also listen on QUIC (UDP) beside each TCP listen address, at the same IP and port number, and announce both: others dial TCP first and QUIC where TCP does not get through (a firewall or NAT that passes only UDP); QUIC costs more CPU per byte here (py-libp2p's aioquic is pure Python) (default off)")


def listen_addrs(args: argparse.Namespace) -> list[str] | None:
    """The listen addresses `--listen` and `--quic` ask for (None: the role's default, TCP on loopback)."""
    if args.quic != "on":
        return args.listen
    from dsd.discovery.addrs import with_quic  # here: `--help` and `testnet down` load no libp2p

    return with_quic(args.listen or [DEFAULT_LISTEN])


def add_head_options(p: argparse.ArgumentParser, store_help: str) -> None:
    """What every head role needs: the swarm to join, and its target's store or the model to fetch it as."""
    p.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR", help="a peer of the swarm (repeatable)")
    add_listen_option(p, "the head's")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--store", type=Path, metavar="TARGET_STORE", help=store_help)
    target.add_argument("--model", default=None, metavar="MODEL_ID", help="no local store: fetch the head's files (and --blocks' layers) from peers, checked against --manifest-sha256")


def add_overlap_options(p: argparse.ArgumentParser) -> None:
    """What dsd does while a window is in flight: the outcome branches it pre-drafts, the windows it sends ahead."""
    g = p.add_argument_group("dsd overlap")
    g.add_argument("--branches", type=int, default=8, metavar="N", help="outcome branches pre-drafted during each trip besides full acceptance (default 8; 0 = only that guess)")
    g.add_argument("--pipeline", type=int, default=2, metavar="W", help="windows in flight at once: while one flies, the next goes out on the bet that it is wholly accepted (default 2; 1 = wait for each verdict; at most 4)")
    g.add_argument("--levers", default="none", metavar="L[,L]", help=f"dsd's levers on its ahead-of-verdict work (docs/design.md): {', '.join(LEVERS)}, all or none (default none): budget = bets and branches only where their chance pays for their cost; trees = a ready chain gives way to a tree that pays more; deep = a third window while most bets win; fallback = decode as sd while working ahead does not pay")


def overlap_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `GenerationConfig` options of `add_overlap_options` (ValueError for an unknown lever)."""
    return {"branches": args.branches, "pipeline": args.pipeline,
            **lever_options(args.levers.split(","), args.pipeline)}


def add_deadline_options(p: argparse.ArgumentParser) -> None:
    """How long a head awaits a window's result before it looks for the silent hop (docs/failures.md)."""
    d = p.add_argument_group("failure detection (docs/failures.md)")
    d.add_argument("--deadline-k", type=float, default=DeadlineRule.k, metavar="K", help=f"a window's result is awaited K × the p95 of measured rounds of its size (default {DeadlineRule.k:g})")
    d.add_argument("--deadline-floor", type=float, default=DeadlineRule.floor_s, metavar="S", help=f"... plus S seconds (default {DeadlineRule.floor_s:g})")
    d.add_argument("--deadline-cap", type=float, default=DeadlineRule.cap_s, metavar="S", help=f"... and never more than S seconds (default {DeadlineRule.cap_s:g})")
    d.add_argument("--hole-wait-s", type=float, default=DeadlineRule.hole_wait_s, metavar="S", help=f"when no live peer serves some blocks (a peer left and none took over yet), wait up to S seconds for the swarm to heal before the generation fails, surveying every second and saying what is missing (default {DeadlineRule.hole_wait_s:g}; 0 = fail at once)")


def deadline_rule(args: argparse.Namespace) -> DeadlineRule:
    """The deadline rule the options ask for."""
    return DeadlineRule(k=args.deadline_k, floor_s=args.deadline_floor, cap_s=args.deadline_cap,
                        hole_wait_s=args.hole_wait_s)  # a bad value: the rule's ValueError, one line from the caller


def link_profile(args: argparse.Namespace) -> LinkProfile:
    """`--link-profile` and the `--wan-*` options (each overriding its field) as a link; a bad combination exits
    with one line."""
    try:
        return build_link(args.link_profile, args.wan_latency_ms, args.wan_jitter_ms, args.wan_mbit)
    except ValueError as exc:
        raise SystemExit(f"dsd-node: bad WAN option: {exc}") from None


def pin_head_process(args: argparse.Namespace) -> None:
    """With `--cpus`: pin this process to them and set `args.threads` (torch threads) to one per CPU unless given."""
    if args.cpus is not None:
        args.threads = pin_head(args.cpus, args.threads)


def read_allow_list(path: Path | None) -> set[str] | None:
    """Peer ids, one per line (# comments allowed); None when no list was given."""
    if path is None:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"dsd-node: cannot read --allow-peers file: {exc}") from None
    return {line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()}


def fail(message: str, code: int = 2) -> int:
    """Print one `dsd-node: ...` line to stderr and return the exit code."""
    import sys

    print(f"dsd-node: {message}", file=sys.stderr)
    return code


def add_audit_options(p: argparse.ArgumentParser) -> None:
    """How a head audits its route's windows on other replicas (docs/integrity.md)."""
    a = p.add_argument_group("integrity audits (docs/integrity.md)")
    a.add_argument("--audit-rate", type=float, default=None, metavar="P", help=f"share of windows re-run on a disjoint set of replicas and compared position by position, chosen at random after the peers answered (default {DEFAULT_AUDIT_RATE:g}: a peer lying on every window is caught within 44 windows with probability 0.99; 0 = off)")
    pairs = f"fp32/fp32 {AUDIT_TOLERANCES['fp32/fp32']:g}, bf16/fp32 {AUDIT_TOLERANCES['bf16/fp32']:g}"
    a.add_argument("--audit-tolerance", type=float, default=None, metavar="D", help=f"one largest relative L2 distance per position between two honest runs, for every pair of routes (default: the calibrated tolerance of the two routes' precisions, from their peers' dtypes and wire codecs: {pairs}; docs/integrity.md has the table)")


def audit_options(args: argparse.Namespace) -> AuditOptions:
    """The `AuditOptions` of `--audit-rate` / `--audit-tolerance` (ValueError when out of range); imported late:
    the audit module loads libp2p, which `--help` does without."""
    from dsd.node.route.audit import AuditOptions

    return AuditOptions(rate=DEFAULT_AUDIT_RATE if args.audit_rate is None else args.audit_rate,
                        tolerance=args.audit_tolerance)
