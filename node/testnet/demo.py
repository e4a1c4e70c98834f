"""The main job end to end on one machine: calibrate t0, a WAN testnet in the DSD paper's regime, modes compared.

Measure t0 (one peer's decode step), start a local testnet whose emulated links
cost t1 = ratio·t0, complete one HumanEval prompt with each mode over the same
testnet, and stop the testnet whatever happens. Peers, t0 and the head's route hold one
weight format (`DemoSpec.weights`; the CLI's default is q4k), and the result names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import trio

from dsd.node.head.config import GenerationConfig
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import eos_ids, load_head_setup
from dsd.node.head.verify import cut_at_stop
from dsd.node.peer.generation import RouteTarget, generate_over_swarm, swarm_watch
from dsd.node.peer.host import head_node
from dsd.node.peer.shaper import LinkProfile
from dsd.shard_store import Store
from dsd.shard_store.devices import Placement, resolve_placement

from .calibrate import measure_t0
from .processes import stop_processes
from .swarm import SwarmSpec, bring_up
from .workload import HUMANEVAL_STOPS, humaneval_prompt


@dataclass
class DemoSpec:
    """What the demo runs: the stores, the swarm's shape, the link regime, the prompt and the modes."""

    target: Path
    draft: str
    state: Path
    peers: int = 4
    ratio: float = 5.0
    problem: int = 2
    max_new_tokens: int = 48
    modes: list[str] = field(default_factory=lambda: ["ar", "dsd"])
    draft_quant: str = "int8"
    branches: int = 8
    device: str = "auto"  # the peers' and the head's --device
    dtype: str = "auto"  # their --dtype
    weights: str = "auto"  # the peers' --weights and the head's (auto: the target store's own format)


def demo_placement(spec: DemoSpec, store: Store) -> Placement:
    """Where and in which format the demo computes: the spec's device and dtype, and its weight format (auto: the
    store's own, so a quantized store's head computes in bf16 beside its peers, as `generate --weights` does)."""
    weights = spec.weights if spec.weights != "auto" else (store.manifest.weights or "auto")
    return resolve_placement(spec.device, spec.dtype, weights)


def draft_format(draft: str, quant: str, dtype: torch.dtype) -> str:
    """What the head drafts with (`load_drafter` given `dtype`), named by its format: ngram, `int8 from STORE_FORMAT`
    when `--draft-quant int8` quantizes the draft store's weights, a quantized store's own format, else the float
    format of `dtype`."""
    from dsd.node.head.setup import parse_draft
    from dsd.shard_store.quant import format_of_dtype

    store, ngram = parse_draft(draft)
    if store is None:
        return "ngram"
    held = Store(store).summary()["weights"]
    name = f"int8 from {held}" if quant == "int8" else Store(store).manifest.weights or format_of_dtype(dtype)
    return f"{name}+ngram" if ngram else name


@dataclass
class DemoResult:
    """t0, the emulated latency and one generation report per mode (with its text)."""

    t0_s: float
    latency_ms: float
    peers: int
    task_id: str
    reports: dict[str, dict[str, Any]]
    weights: str = "fp32"  # the format the peers served and the head computed beside
    draft_weights: str = "ngram"  # what the head drafted with (`draft_format`)

    def identical(self) -> bool:
        base = self.reports.get("ar")
        return base is None or all(r["tokens"] == base["tokens"] for r in self.reports.values())

    def as_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "draft_weights": self.draft_weights, "identical": self.identical(),
                "t0_s": self.t0_s, "latency_ms": self.latency_ms, "peers": self.peers, "task_id": self.task_id,
                "reports": self.reports}

    def save(self, path: Path, spec: DemoSpec, *, prepare_s: float | None = None,
             command_s: float | None = None) -> None:
        """Write the result (with what was run, on which load, and how long preparing the stores and the whole
        command took, when given: a first run's time) as JSON, atomically."""
        import json
        import os

        from dsd.shard_store.files import atomic_write_bytes

        shown = {k: v.name if isinstance(v, Path) else v for k, v in vars(spec).items()}
        shown["draft"] = "+".join(Path(part).name for part in spec.draft.split("+"))  # a store by its name, no path
        timing = {"prepare_s": None if prepare_s is None else round(prepare_s, 1),
                  "command_s": None if command_s is None else round(command_s, 1)}
        data = {**self.as_dict(), "spec": shown, "timing": timing, "load_after": os.getloadavg(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
        atomic_write_bytes(path, json.dumps(data, indent=1).encode())


def run_demo(spec: DemoSpec, say: Callable[[str], None] = print) -> DemoResult:
    """Run the demo, narrating each step through `say`; the testnet is stopped on every exit."""
    store = Store(spec.target)
    layers = store.num_layers
    place = demo_placement(spec, store)
    quant = spec.draft_quant if spec.draft != "ngram" else "none"
    drafts = draft_format(spec.draft, quant, place.dtype)
    say(f"== measuring t0 (one peer's decode step over {layers // spec.peers} of {layers} layers, 1 thread, {place})")
    t0 = measure_t0(store, max(1, layers // spec.peers), device=place.device, dtype=place.dtype,
                    weights=place.weights if place.quantized else None)
    latency_ms = spec.ratio * t0 * 1000
    say(f"t0 = {t0 * 1000:.1f} ms -> emulated one-way latency t1 = {spec.ratio:g}·t0 = {latency_ms:.0f} ms per link")
    say(f"== starting a testnet: bootstrap + {spec.peers} block peers on loopback serving {place.weights} weights, "
        f"WAN {latency_ms:.0f} ms")
    link = LinkProfile.from_options(latency_ms)
    state = bring_up(SwarmSpec(state=spec.state, store=spec.target, peers=spec.peers, timeout_s=300.0, link=link,
                               device=spec.device, dtype=spec.dtype, weights=place.weights))
    say(f"testnet up in {state.up_seconds:.1f} s (logs in {spec.state / 'logs'})")
    try:
        torch.set_num_threads(1)
        params = SamplingParams()
        setup, tokenizer = load_head_setup(spec.target, spec.draft, params, seed=0, quant=quant,
                                           device=place.device, dtype=place.dtype, weights=place.weights)
        task_id, prompt_text = humaneval_prompt(spec.problem)
        prompt = list(tokenizer(prompt_text)["input_ids"])
        eos = eos_ids(tokenizer, store.manifest)
        say(f"== completing {task_id} ({len(prompt)} prompt tokens, {spec.max_new_tokens} new, greedy; route "
            f"{place.weights}, head {place.dtype_name}, draft {drafts})")
        say(prompt_text.rstrip())
        reports: dict[str, dict[str, Any]] = {}
        target = RouteTarget(weights=place.weights)

        async def main() -> None:
            async with head_node([state.bootstrap], link) as (node, legs):
                swarm = swarm_watch(node, setup, weights=place.weights)
                for mode in spec.modes:
                    cfg = GenerationConfig(mode=mode, max_new_tokens=spec.max_new_tokens, params=params, eos_ids=eos,
                                           stop_strings=HUMANEVAL_STOPS, branches=spec.branches)
                    mode_setup = replace(setup, drafter=None) if mode == "ar" else setup
                    say(f"-- {mode} ...")
                    started = time.perf_counter()
                    report = await generate_over_swarm(node, legs, swarm, mode_setup, prompt, cfg, target=target,
                                                       tokenizer=tokenizer)
                    text = tokenizer.decode(report.tokens, skip_special_tokens=True)
                    completion = cut_at_stop(text, HUMANEVAL_STOPS)[0]
                    reports[mode] = {**report.as_dict(), "text": text, "completion": completion,
                                     "wall_s": round(time.perf_counter() - started, 3)}
                    r = report.result
                    say(completion.rstrip())
                    say(f"   [{mode}] {r.new_tokens} tokens in {r.elapsed_s:.1f} s = {r.tokens_per_s:.2f} tok/s, "
                        f"{r.rounds} round trips, mean accepted {r.mean_accepted:.2f}")

        trio.run(main)
    finally:
        say("== stopping the testnet")
        stop_processes(list(reversed(state.peers)))
    return DemoResult(t0, latency_ms, spec.peers, task_id, reports, weights=place.weights, draft_weights=drafts)
