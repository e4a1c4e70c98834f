"""What a DSD sweep runs (`SweepOptions`) and its command line (`parse_args`): the models, the (N, t1/t0)
settings, the fixed prompts, the modes, and how the one box plays separate machines (the head on its own CPU,
named link profiles, the wire codec)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness import MODEL_KINDS, RESULTS_DIR, comma_list, today
from sweep_model import MODES, SHARED
from sweep_provenance import setting_key, wire_label

from dsd.node.cli.options import HIDDEN_CODECS, WEIGHT_FORMATS
from dsd.node.testnet.link_profiles import PAPER, PROFILES, named, parse_peer_profiles

# Fixed before any run: 10 problems spread evenly over HumanEval's 164 (i·164/10, rounded down).
PROBLEMS = (0, 16, 32, 49, 65, 82, 98, 114, 131, 147)
# Held out for calibrating the draft's acceptance (never benchmarked).
CALIBRATION_PROBLEMS = (1, 3, 5)
DEFAULT_MODES = ("ar", "sd", "dsd")


@dataclass
class SweepOptions:
    """One sweep: the models, the (N, t1/t0) settings, the prompts, modes and repetitions, the placement of the
    head, the links and codec, and where results go."""

    models: str = "real"  # real: the default pair; tiny: a random target drafting for itself
    peers: list[int] = field(default_factory=lambda: [3, 4, 8])
    ratios: list[float] = field(default_factory=lambda: [3.0, 5.0, 10.0])
    problems: list[int] = field(default_factory=lambda: list(PROBLEMS))
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    reps: int = 3
    max_new_tokens: int = 128
    tau_max: float = 0.0
    draft_quant: str = "none"
    branches: int = 8
    pipeline: int = 2
    tree_nodes: int | None = None  # None: the controller decides; 0: chains only
    pin_head: bool = False  # the head on the first CPU, the testnet on the others ("-shared" modes: everything anywhere)
    link_profile: str = PAPER.name  # a named link profile; one with its own latency fixes t1 (no --ratios)
    peer_profiles: list[str] = field(default_factory=list)  # "INDEX:NAME": that peer sends on another profile
    codec: str = "auto"  # the hidden-state codec of every peer and of the head (auto: the compute dtype's, exact)
    zstd: bool = False
    weights: str = "auto"  # the block peers' weight format (`start --weights`): auto = their dtype's
    exec_timeout: float = 5.0
    name: str = "dsd_sweep"
    results: Path | None = None
    merge: list[Path] = field(default_factory=list)
    state: Path = Path(".dsd/bench")

    @property
    def stem(self) -> Path:
        """The results files' path without suffix: `results`, else bench/results/<name>-<date>."""
        return self.results.with_suffix("") if self.results else RESULTS_DIR / f"{self.name}-{today()}"

    @property
    def fixed_latency_ms(self) -> float | None:
        """The one-way latency the link profile fixes (`home`, `continental`), or None: t1 = t1/t0 × t0 (`paper`)."""
        return named(self.link_profile).latency_ms

    @property
    def wire_label(self) -> str:
        """The codec as setting keys and tables name it: "" for the exact default, else e.g. int8+zstd."""
        return "" if self.codec == "auto" and not self.zstd else wire_label(self.codec, self.zstd)

    def key(self, peers: int, ratio: float | None) -> str:
        """The key of this sweep's setting of N = `peers` at t1/t0 `ratio` (None: the profile's latency)."""
        wire = "-".join(x for x in (self.wire_label, "" if self.weights == "auto" else self.weights) if x)
        return setting_key(self.models, peers, ratio, self.link_profile, wire)

    @property
    def grid_ratios(self) -> list[float | None]:
        """The t1/t0 values the grid runs: `ratios`, or one unknown (None) when the profile fixes the latency."""
        return [None] if self.fixed_latency_ms is not None else list(self.ratios)


def parse_args(argv: Sequence[str] | None = None, doc: str | None = None) -> tuple[SweepOptions, argparse.Namespace]:
    """The command line as sweep options, and the parsed arguments (what to do: run, rebuild the report, set apart)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", choices=MODEL_KINDS, default="real",
                   help="real: Qwen2.5-Coder 1.5B target, 0.5B draft; tiny: random 8-layer target drafting for itself")
    p.add_argument("--peers", default="3,4,8", help="comma-separated N values (default 3,4,8)")
    p.add_argument("--ratios", default=None, help="comma-separated t1/t0 values (default 3,5,10; not with a link "
                   "profile that fixes the latency)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated modes (default ar,sd,dsd); "
                   "sd-chain / dsd-chain run sd / dsd with chains only, to compare against --tree-nodes; "
                   f"ar{SHARED} / sd{SHARED} / dsd{SHARED} run with the head sharing every CPU with the peers "
                   "(with --pin-head: the paired effect of pinning)")
    p.add_argument("--problems", default=",".join(map(str, PROBLEMS)), help="HumanEval problem indices (default: the fixed 10)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every (prompt, mode) (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tau-max", type=float, default=0.0, help="dsd-adaptive relaxation bound (0 = lossless)")
    p.add_argument("--draft-quant", choices=("none", "int8"), default="none", help="the draft's quantization")
    p.add_argument("--branches", type=int, default=8, help="dsd: outcome branches per trip (0 = only full acceptance)")
    p.add_argument("--pipeline", type=int, default=2, help="dsd: windows in flight at once (dsd-serial: 1)")
    p.add_argument("--tree-nodes", default="auto", metavar="N|auto",
                   help="drafted nodes of a token-tree window (default auto: the controller decides; 0 = chains only)")
    p.add_argument("--pin-head", action="store_true",
                   help="the head (drafting, its ends of the model) on the first CPU alone, the testnet on the others: "
                   "the head as its own machine (docs/benchmarks.md says what this emulates)")
    p.add_argument("--link-profile", choices=sorted(PROFILES), default=PAPER.name,
                   help="every link's profile (docs/link_profiles.md); paper (default): latency t1 = t1/t0 × t0 only; "
                   "home / continental: their own latency, jitter and bandwidth (t1/t0 is then measured, not set)")
    p.add_argument("--peer-profile", action="append", default=[], metavar="INDEX:NAME",
                   help="block peer INDEX sends on profile NAME instead (repeatable: a heterogeneous swarm)")
    p.add_argument("--codec", choices=HIDDEN_CODECS, default="auto",
                   help="hidden-state codec of the peers and the head (default auto: the compute dtype's, exact)")
    p.add_argument("--zstd", action="store_true", help="zstd-compress hidden states on the wire")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                   help="the block peers' weight format (start --weights; int8/int4 compute in bf16; default auto)")
    p.add_argument("--exec-timeout", type=float, default=5.0, help="seconds per HumanEval test program")
    p.add_argument("--name", default=None, help="results file stem (default dsd_sweep[-tiny])")
    p.add_argument("--results", type=Path, default=None, help="results JSON to write and resume from")
    p.add_argument("--merge", type=Path, action="append", default=[], metavar="FILE",
                   help="adopt the settings of the grid that FILE holds and the results lack (same options; repeatable)")
    p.add_argument("--state", type=Path, default=Path(".dsd/bench"), help="testnet state and work directory")
    p.add_argument("--report-only", action="store_true",
                   help="recompute summaries, table and plot of --results from its raw runs; run nothing")
    p.add_argument("--set-apart", metavar="KEY", help="move runs of setting KEY (e.g. real-N4-r3) of --results out of its "
                   "medians, with --reason, chosen by --rep and/or --task (every mode of a chosen prompt), or --all-runs")
    p.add_argument("--rep", default="", help="--set-apart: which repetition(s), comma-separated (not --reps: how many)")
    p.add_argument("--task", default="", help="--set-apart: which task(s), comma-separated (HumanEval/32 or 32)")
    p.add_argument("--all-runs", action="store_true", help="--set-apart: every run of the setting")
    p.add_argument("--reason", default="", help="--set-apart: why, stored beside the runs and shown in the report")
    args = p.parse_args(argv)
    args.rep, args.task = comma_list(p, "--rep", args.rep, int), comma_list(p, "--task", args.task, str)
    if args.set_apart is not None:
        if args.results is None or args.report_only or not args.reason.strip():
            p.error("--set-apart takes --results and --reason (and not --report-only)")
        if bool(args.rep or args.task) == args.all_runs:
            p.error("--set-apart chooses runs by --rep and/or --task, or takes --all-runs")
    elif args.rep or args.task or args.all_runs or args.reason:
        p.error("--rep, --task, --all-runs and --reason go with --set-apart")
    if named(args.link_profile).latency_ms is not None and args.ratios is not None:
        p.error(f"--ratios: link profile {args.link_profile} fixes the latency, so t1/t0 is measured, not set")
    peers = comma_list(p, "--peers", args.peers, int)
    ratios = comma_list(p, "--ratios", args.ratios or "3,5,10", float)
    problems = comma_list(p, "--problems", args.problems, int)
    modes = comma_list(p, "--modes", args.modes, str)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if any(m.endswith(SHARED) for m in modes) and not args.pin_head:
        p.error(f"--modes: the {SHARED} modes compare against a pinned head: add --pin-head")
    if any(n < 1 for n in peers) or any(r <= 0 for r in ratios) or args.reps < 1 or args.max_new_tokens < 1:
        p.error("--peers, --reps and --max-new-tokens must be >= 1 and --ratios > 0")
    for n in peers:
        try:
            parse_peer_profiles(args.peer_profile, n)
        except ValueError as exc:
            p.error(f"{exc} (N = {n})")
    try:
        tree_nodes = None if args.tree_nodes == "auto" else int(args.tree_nodes)
    except ValueError:
        p.error(f"--tree-nodes takes a node count or auto, got {args.tree_nodes!r}")
    if tree_nodes is not None and tree_nodes < 0:
        p.error("--tree-nodes must be >= 0 (0 = chains)")
    name = args.name or "dsd_sweep" + ("-tiny" if args.models == "tiny" else "")
    opts = SweepOptions(models=args.models, peers=peers, ratios=ratios, problems=problems, modes=modes,
                        reps=args.reps, max_new_tokens=args.max_new_tokens, tau_max=args.tau_max,
                        draft_quant=args.draft_quant, branches=args.branches, pipeline=args.pipeline, tree_nodes=tree_nodes,
                        pin_head=args.pin_head, link_profile=args.link_profile, peer_profiles=args.peer_profile,
                        codec=args.codec, zstd=args.zstd, weights=args.weights, exec_timeout=args.exec_timeout, name=name,
                        results=args.results, merge=args.merge, state=args.state)
    return opts, args
