"""Shared pieces of the benchmarks: run metadata, a tiny random target store, a testnet that always
stops, one generation over a fixed route, and result files.

The benchmarks are scripts (`python bench/<name>.py`), so this module is imported by its bare name.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
TINY_MODEL_ID = "tiny-qwen2-bench"
MODEL_KINDS = ("tiny", "real")  # a tiny random target drafting for itself, or the default pair
T = TypeVar("T")


def git_commit() -> str:
    """The checkout's commit (with `+dirty` when tracked files differ), or "unknown".

    The result files under bench/results/ do not count: a benchmark that resumes or runs its next
    setting has already rewritten them itself, and they are not code."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                f":(exclude){RESULTS_DIR.relative_to(REPO)}"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
"""The CPU flags torch's CPU kernels choose their paths by (int8/int4 packed, bf16): recorded with every result."""


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip() and fields:
                break
            fields.setdefault(key.strip(), value.strip())
    return fields


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: a host id (hash of the machine id), CPU count, model, vendor, family and
    the flags the kernels care about, memory, Python and torch versions."""
    import torch

    cpu = cpu_fields()
    flags = set(cpu.get("flags", "").split())
    mem_gb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_gb = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    host_id = ""
    with contextlib.suppress(OSError):  # a stable, anonymous name for the machine: results from two hosts differ
        host_id = hashlib.sha256(Path("/etc/machine-id").read_bytes().strip()).hexdigest()[:12]
    return {
        "host_id": host_id,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu.get("model name", ""),
        "cpu_vendor": cpu.get("vendor_id", ""),
        "cpu_family": cpu.get("cpu family", ""),
        "cpu_model_number": cpu.get("model", ""),
        "cpu_flags": [f for f in CPU_FLAGS if f in flags],
        "mem_gb": mem_gb,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads_head": torch.get_num_threads(),
    }


def run_metadata(name: str, args: argparse.Namespace | Any = None) -> dict[str, Any]:
    """The header every result file carries: name, date, commit, machine and the settings used (`args`' fields)."""
    settings = {k: (shown_path(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} if args else {}
    return {
        "name": name,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine_info(),
        "settings": settings,
    }


def shown_path(path: Path) -> str:
    """A path as results record it: relative to the repository when inside it, else by its last part only."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return f"<{path.name}>"


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command as results record it, absolute paths shown as `shown_path` shows them."""
    return " ".join([f"python bench/{script}", *(shown_path(Path(a)) if a.startswith("/") else a for a in argv)])


def comma_list(p: argparse.ArgumentParser, option: str, text: str, kind: Callable[[str], T]) -> list[T]:
    """The items of a comma-separated option, each converted by `kind`; a bad item is a usage error."""
    try:
        return [kind(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        p.error(f"{option} takes comma-separated values, got {text!r}")


def model_kinds(p: argparse.ArgumentParser, text: str) -> list[str]:
    """The --models option: one or more of MODEL_KINDS."""
    kinds = comma_list(p, "--models", text, str)
    if not kinds or any(m not in MODEL_KINDS for m in kinds):
        p.error(f"--models takes {' and/or '.join(MODEL_KINDS)}, got {text!r}")
    return kinds


def today() -> str:
    return dt.date.today().isoformat()


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a crash mid-write never leaves half a results file)."""
    from dsd.shard_store.files import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(data, indent=1).encode())


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def generate_cli(args: Sequence[str], prefix: Sequence[str] = (), timeout_s: float = 1800) -> tuple[
        dict[str, Any] | None, subprocess.CompletedProcess]:
    """`dsd-node generate ARGS --json` as a process of its own, after `prefix` (`ip netns exec NS` runs it on a
    machine of a NAT testbed): its JSON report (None when it printed none) and the finished process."""
    out = subprocess.run([*prefix, sys.executable, "-m", "dsd.node.cli", "generate", *args, "--json"],
                         capture_output=True, text=True, timeout=timeout_s)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1]), out
    except (IndexError, json.JSONDecodeError):
        return None, out


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """Median, min and max of repeated measurements, and how many there were."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values)}


def whole_model_greedy(hf: Path, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` from the model whole (transformers, float32): what a route must give."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def build_tiny_store(folder: Path, *, tokenizer_store: Path | None = None, layers: int = 8, hidden: int = 64,
                     seed: int = 0) -> Path:
    """A tiny random Qwen2 converted to a store at folder/store (reused if present).

    With `tokenizer_store` it takes that store's tokenizer and vocabulary size (real prompts, real
    token counts); without, a 512-id vocabulary and no tokenizer (prompts as UTF-8 bytes).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from dsd.shard_store import Store, convert
    from dsd.shard_store.default_models import store_complete

    store = folder / "store"
    if store_complete(store):
        return store
    tokenizer, vocab = None, 512
    if tokenizer_store is not None:
        src = Store(tokenizer_store)
        tokenizer, vocab = src.load_tokenizer(), int(src.manifest.config["vocab_size"])
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, initializer_range=0.2,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder / "hf")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder / "hf")
    convert(folder / "hf", store, model_id=TINY_MODEL_ID, overwrite=True)
    return store


def real_tokenizer_store() -> Path | None:
    """The default target's store in any format prepared here (each holds the same tokenizer), else None."""
    from dsd.shard_store.default_models import TARGET, prepared_kinds, store_path

    kinds = prepared_kinds(roles=("target",))
    return store_path(TARGET, None, kinds[0]) if kinds else None


def byte_ids(text: str) -> list[int]:
    """Token ids for a tokenizer-less tiny model: the UTF-8 bytes."""
    return list(text.encode("utf-8"))


@contextlib.contextmanager
def swarm(spec: Any) -> Iterator[Any]:
    """A local swarm brought up from `spec` (a testnet SwarmSpec), always stopped on the way out."""
    from dsd.node.testnet.processes import stop_processes
    from dsd.node.testnet.swarm import bring_up

    state = bring_up(spec)
    try:
        yield state
    finally:
        stop_processes(list(reversed(state.peers)))


def testnet(store: Path, peers: int, latency_ms: float | None, state_dir: Path, *, timeout_s: float = 600.0,
            replicas: int = 1, faults: Sequence[str] = (), threads: int = 1, link_profile: str | None = None,
            peer_profiles: Sequence[str] = (), peer_cpus: str | Iterable[int] | None = None, codec: str = "auto",
            zstd: bool = False, batching: str = "on", weights: str = "auto",
            metrics: bool = False) -> contextlib.AbstractContextManager[Any]:
    """A local testnet (bootstrap + `peers` block peers in `peers / replicas` spans, `threads` each; `faults` as
    `testnet up --faulty`) that is always stopped. WAN: the named `link_profile` (None: latency only) with
    `latency_ms` as its latency (None: the profile's), `peer_profiles` as `testnet up --peer-profile`;
    `peer_cpus` (`"1"`, `"1-3"` or a set) pins the bootstrap and the peers (pin the head with
    `dsd.node.peer.cpus.pin_head`); `codec`, `zstd`: the peers' hidden-state wire format (`dsd-node start`'s); `batching`: their `--batching`; `weights`: their `--weights`; `metrics`: each serves its Prometheus
metrics (`state.peers[i].metrics_url`)."""
    from dsd.node.peer.cpus import parse_cpus
    from dsd.node.testnet.link_profiles import build_link
    from dsd.node.testnet.swarm import SwarmSpec

    cpus = parse_cpus(peer_cpus) if isinstance(peer_cpus, str) else None if peer_cpus is None else frozenset(peer_cpus)
    return swarm(SwarmSpec(state=state_dir, store=store, peers=peers, record_ttl_s=60.0, timeout_s=timeout_s,
                           link=build_link(link_profile, latency_ms), link_name=link_profile,
                           peer_profiles=list(peer_profiles), peer_cpus=cpus, replicas=replicas,
                           faults=list(faults), threads=threads, codec=codec, zstd=zstd, batching=batching,
                           weights=weights, metrics=metrics))


async def plan_once(node: Any, model_id: str, num_layers: int, timeout_s: float = 120.0) -> list[Any]:
    """Plan a route once (waiting until the head sees a complete one) and return its hops; every run reuses them."""
    from dsd.discovery.survey import wait_for_route

    view = await wait_for_route(node, model_id, num_layers, timeout_s)
    assert view.plan is not None
    return list(view.plan.protocol_hops())


async def run_generation(swarm: Any, legs: Any, setup: Any, prompt: Sequence[int], cfg: Any, hops: list[Any],
                         tokenizer: Any = None, wire: Any = None) -> Any:
    """One generation over `hops` (`generate_over_swarm`) from the head node of `swarm`, its one view of the swarm
    (`swarm_watch`, made once per head node, as a head process keeps it): a `GenerationReport` with the engine's
    exact counters; `wire`: the head's hidden-state codec (None: its compute dtype's). A `GenerationFailed` comes
    out as itself."""
    from dsd.node.peer.generation import RouteTarget, generate_over_swarm

    return await generate_over_swarm(swarm.node, legs, swarm, setup, prompt, cfg, target=RouteTarget(hops=hops, wire=wire),
                                     tokenizer=tokenizer if cfg.stop_strings else None)
