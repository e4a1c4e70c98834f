"""Side by side with Petals: the same model, prompts and links, modes interleaved per prompt in one run.

The real Petals 2.2.0.post1 (its own venv, `bench/petals/setup.py`) serves our target expressed as a Llama
checkpoint (`bench/petals/llama_checkpoint.py`; logits equal to ours within 3e-5) on N servers, each behind a
byte-stream delay proxy adding the one-way latency t1 on its links, all in a network namespace with only loopback
(`bench/petals/runner.py`). Our testnet serves the same target on N peers whose shapers add the same t1 per link.
For each prompt of the fixed 10 HumanEval problems, in each repetition: Petals, then our `ar`, `sd` and `dsd`, all
greedy with HumanEval's stop strings, every output checked token for token against the target's own greedy output
(transformers, the whole model in this process). Settings: t1 = ratio × t0 (t0 measured as in the grid: one peer's
decode step over its span), and t1 = 0 (what each system costs per token besides the links). After a setting's
runs, per-token probes: Petals' one-token step as released and with server-to-server push working
(`bench/petals/push_fix.py`), to explain a difference from the link crossings it pays per token.

Resumable (runs already in the results file are skipped; the file is rewritten after every prompt):

    python3 bench/petals/setup.py                                  # once: Petals' venv
    python bench/petals_compare.py                                 # real pair, N = 4, t1/t0 = 5 and 0 (hours)
    python bench/petals_compare.py --models tiny --problems 0,1 --reps 1 --max-new-tokens 8   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsd_sweep import link_latency_ms, run_prompt
from harness import (
    MODEL_KINDS,
    RESULTS_DIR,
    comma_list,
    command_line,
    git_commit,
    plan_once,
    run_metadata,
    testnet,
    today,
    write_json,
)
from sweep_model import decode_tokens_per_s, paired_ratios, ratio_summary
from sweep_options import PROBLEMS, SweepOptions
from sweep_provenance import StretchClock, log, machine_record
from sweep_report import fmt_interval
from sweep_setup import Workload, load_models

sys.path.insert(0, str(Path(__file__).resolve().parent / "petals"))
from llama_checkpoint import convert as llama_convert  # noqa: E402
from setup import default_venv  # noqa: E402

from dsd.node.head.verify import find_stop  # noqa: E402
from dsd.node.testnet.workload import HUMANEVAL_STOPS  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "petals" / "runner.py"
OURS = ("ar", "sd", "dsd")
MODES = ("petals", *OURS)
PROBE_STEPS = 12


@dataclass
class CompareOptions:
    """One comparison: models, N, the t1/t0 ratio (and the zero-latency setting), prompts, reps, where results go."""

    models: str = "real"
    peers: int = 4
    ratio: float = 5.0
    zero: bool = True
    problems: list[int] = field(default_factory=lambda: list(PROBLEMS))
    reps: int = 3
    max_new_tokens: int = 32
    draft_quant: str = "int8"
    petals_python: Path | None = None
    results: Path | None = None
    state: Path = Path(".dsd/petals-compare")
    report_only: bool = False

    @property
    def path(self) -> Path:
        return self.results or RESULTS_DIR / f"petals_compare-{self.models}-{today()}.json"


class PetalsRunner:
    """bench/petals/runner.py in the Petals venv: a swarm kept up for the setting, one JSON line per request."""

    def __init__(self, python: Path, model: Path, servers: int, delay_ms: float, push_fix: bool = False) -> None:
        argv = [str(python), str(RUNNER), "--model", str(model), "--servers", str(servers), "--delay-ms", f"{delay_ms:g}"]
        self.proc = subprocess.Popen([*argv, *(["--push-fix"] if push_fix else [])], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.info = self._read()
        if not self.info.get("ready"):
            self.close()
            raise RuntimeError(f"the Petals swarm did not come up: {self.info.get('error')}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Petals runner exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, **req: Any) -> dict[str, Any]:
        """Send one request and wait for its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """Quit the runner (it stops its servers and proxies); after a grace period kill its whole process group:
        the runner in the namespace is a grandchild (under `unshare`), and a hivemind client that hangs on exit
        would outlive a kill of the child alone."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group (start_new_session): only the runner's processes
        self.proc.wait()

    def __enter__(self) -> PetalsRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cut(tokens: list[int], eos: frozenset[int], stops: Sequence[str], tokenizer: Any) -> list[int]:
    """The tokens up to the one that ends generation (an EOS or the token completing a stop string, kept): the
    engine's own rule (`find_stop`), applied to every system's output alike."""
    stop = find_stop(tokens, eos, stop_strings=stops, tokenizer=tokenizer if stops else None)
    return tokens if stop is None else tokens[: stop.length]


def reference(model: Any, prompt: list[int], opts: CompareOptions, eos: frozenset[int], stops: Sequence[str],
              tokenizer: Any) -> list[int]:
    """The target's own greedy output (transformers, the whole model), cut by the same rule."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=opts.max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return cut(out[0, len(prompt):].tolist(), eos, stops, tokenizer)


def petals_run(runner: PetalsRunner, problem: dict[str, Any], rep: int, prompt: list[int], opts: CompareOptions,
               eos: frozenset[int], stops: Sequence[str]) -> dict[str, Any]:
    """One Petals generation, shaped like our runs (task_id, rep, mode, tokens, tokens_per_s, prefill_s)."""
    out = runner.ask(op="generate", ids=prompt, max_new_tokens=opts.max_new_tokens, stops=list(stops),
                     eos=sorted(eos))
    run: dict[str, Any] = {"task_id": problem["task_id"], "rep": rep, "mode": "petals", "prompt_tokens": len(prompt)}
    if "error" in out:
        return {**run, "error": out["error"]}
    n = len(out["tokens"])
    return {**run, "tokens": out["tokens"], "new_tokens": n, "elapsed_s": out["elapsed_s"],
            "prefill_s": out["prefill_s"], "tokens_per_s": n / out["elapsed_s"] if out["elapsed_s"] > 0 else 0.0}


def summarize(setting: dict[str, Any]) -> dict[str, Any]:
    """Per mode: median tok/s (end to end and after the prompt's trip) with bootstrap intervals over prompts, and
    exactness against the reference; paired ratios of each of ours to Petals, and dsd/ar."""
    runs = [r for r in setting["runs"] if "error" not in r]
    refs = setting["reference"]
    out: dict[str, Any] = {"modes": {}, "ratios": {}, "failed_runs": len(setting["runs"]) - len(runs)}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        row: dict[str, Any] = {"runs": len(mine)}
        for name, value in (("tokens_per_s", lambda r: r["tokens_per_s"]), ("decode_tokens_per_s", decode_tokens_per_s)):
            groups: dict[str, list[float]] = {}
            for r in mine:
                groups.setdefault(r["task_id"], []).append(value(r))
            row[name] = ratio_summary(list(groups.values()))  # median, 95 % CI with its Monte-Carlo error
        same = [r["cut_tokens"] == refs[r["task_id"]] for r in mine]
        row["identical_to_reference"] = f"{sum(same)}/{len(same)}"
        out["modes"][mode] = row
    for num, den in (("ar", "petals"), ("sd", "petals"), ("dsd", "petals"), ("dsd", "ar")):
        groups = paired_ratios(setting, num, den)
        if groups:
            out["ratios"][f"{num}/{den}"] = ratio_summary(groups)
            out["ratios"][f"{num}/{den} decode"] = ratio_summary(paired_ratios(setting, num, den, decode_tokens_per_s))
    return out


def markdown(results: dict[str, Any]) -> str:
    """Per setting: each mode's median tok/s [95 % CI], decode tok/s, exactness; the paired ratios."""
    lines = []
    for st in results["settings"]:
        summ = st.get("summary")
        if not summ:
            continue
        lines += [f"### {st['key']}: t1 = {st['latency_ms']:.0f} ms one-way, t0 = {st['t0_s'] * 1000:.1f} ms "
                  f"(N = {st['peers']}, up to {st['max_new_tokens']} new tokens)", "",
                  "| mode | tok/s median [95 % CI] | decode tok/s [95 % CI] | = target's greedy |", "|---|---|---|---|"]
        for mode, row in summ["modes"].items():
            tps, dec = row["tokens_per_s"], row["decode_tokens_per_s"]
            lines.append(f"| {mode} | {tps['median']:.2f} {fmt_interval(*tps['ci95'], tps.get('ci95_mc'))} | "
                         f"{dec['median']:.2f} {fmt_interval(*dec['ci95'], dec.get('ci95_mc'))} | "
                         f"{row['identical_to_reference']} |")
        lines += ["", "| paired ratio | median [95 % CI] | pairs |", "|---|---|---|"]
        lines += [f"| {k} | {r['median']:.2f}× {fmt_interval(*r['ci95'], r.get('ci95_mc'))} | {r['pairs']} |"
                  for k, r in summ["ratios"].items()]
        if "probe" in st:
            pr, x = st["probe"], st["probe"]["link_crossings_per_token"]
            lines += ["", f"Per token (median one-token step over {PROBE_STEPS} steps; our `ar`: median decoding round "
                      f"of its {pr['ar_round_s']['n']} runs): Petals as released {pr['petals']['median_step_s']:.3f} s "
                      f"({x['petals_released']} link crossings), with server-to-server push "
                      f"{pr['petals_push_fix']['median_step_s']:.3f} s ({x['petals_push']}), our `ar` "
                      f"{pr['ar_round_s']['median'] or 0:.3f} s ({x['ours']}); t1 = {x['t1_s'] * 1000:.0f} ms."]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Median tok/s per mode with 95 % intervals, one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [st for st in results["settings"] if st.get("summary")]
    if not settings:
        return
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), squeeze=False)
    for ax, st in zip(axes[0], settings, strict=True):
        modes = list(st["summary"]["modes"])
        rows = [st["summary"]["modes"][m]["tokens_per_s"] for m in modes]
        med = [r["median"] for r in rows]
        err = [[m - r["ci95"][0] for m, r in zip(med, rows, strict=True)],
               [r["ci95"][1] - m for m, r in zip(med, rows, strict=True)]]
        ax.bar(modes, med, yerr=err, capsize=4, color=["#999999", "#4c72b0", "#55a868", "#c44e52"][: len(modes)])
        ax.set_title(f"{st['key']} (t1 {st['latency_ms']:.0f} ms)", fontsize=9)
        ax.set_ylabel("tok/s (median, 95 % CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: dict[str, Any], path: Path) -> None:
    """The JSON, its Markdown tables and the plot, side by side."""
    write_json(path, results)
    path.with_suffix(".md").write_text(markdown(results))
    plot(results, path.with_suffix(".png"))


def probe(python: Path, llama: Path, setting: dict[str, Any], peers: int) -> None:
    """Petals' one-token step as released and with push working, and our ar's seconds per round, at the setting's
    latency: how many link crossings each pays per token."""
    out: dict[str, Any] = {}
    for name, push_fix in (("petals", False), ("petals_push_fix", True)):
        with PetalsRunner(python, llama, peers, setting["latency_ms"], push_fix=push_fix) as runner:
            steps = runner.ask(op="steps", n=PROBE_STEPS).get("step_s", [])
        out[name] = {"median_step_s": sorted(steps)[len(steps) // 2] if steps else None, "steps": steps}
    ar = [r for r in setting["runs"] if r["mode"] == "ar" and "error" not in r and r["rounds"] > 1]
    per_round = sorted((r["elapsed_s"] - r["prefill_s"]) / (r["rounds"] - 1) for r in ar)
    out["ar_round_s"] = {"median": per_round[len(per_round) // 2] if per_round else None, "n": len(per_round)}
    t1 = setting["latency_ms"] / 1000
    out["link_crossings_per_token"] = {"petals_released": 2 * peers, "petals_push": peers + 1, "ours": peers + 1,
                                       "t1_s": t1}
    setting["probe"] = out


def run_setting(opts: CompareOptions, setting: dict[str, Any], target: Path, setup: Any, workload: Workload,
                eos: frozenset[int], stops: Sequence[str], llama: Path, python: Path, save: Any) -> None:
    """Both swarms up at the setting's latency; Petals, ar, sd, dsd per prompt; then the probes."""
    import trio

    from dsd.node.peer.generation import swarm_watch
    from dsd.node.peer.host import head_node
    from dsd.node.peer.shaper import LinkProfile

    sweep = SweepOptions(models=opts.models, max_new_tokens=opts.max_new_tokens, draft_quant=opts.draft_quant)
    done = {(r["rep"], r["task_id"]) for r in setting["runs"] if r["mode"] == "dsd" and "error" not in r}
    todo = [(rep, p) for rep in range(1, opts.reps + 1) for p in workload.problems if (rep, p["task_id"]) not in done]
    latency = setting["latency_ms"]
    if todo:
        setting["runs"] = [r for r in setting["runs"] if (r["rep"], r["task_id"]) in done]
        with (testnet(target, opts.peers, latency, opts.state / setting["key"]) as state,
              PetalsRunner(python, llama, opts.peers, latency) as runner):
            setting["petals"] = runner.info
            log(f"[{setting['key']}] both swarms up (ours {state.up_seconds:.0f} s, Petals {runner.info['up_s']} s); "
                f"{len(todo)} prompt runs to go")

            async def main() -> None:
                async with head_node([state.bootstrap], LinkProfile.from_options(latency)) as (node, legs):
                    hops = await plan_once(node, setup.model_id, setup.num_layers)
                    setting["route"] = [[h.start, h.end] for h in hops]
                    swarm = swarm_watch(node, setup)
                    for rep, problem in todo:
                        prompt = workload.ids(problem)
                        runs = [await trio.to_thread.run_sync(petals_run, runner, problem, rep, prompt, opts, eos, stops)]
                        for mode in OURS:
                            runs += await run_prompt(swarm, legs, hops, setup, workload, problem, rep,
                                                     replace(sweep, modes=[mode]), eos)
                        for r in runs:
                            if "tokens" in r:
                                r["cut_tokens"] = cut(r["tokens"], eos, stops, workload.tokenizer)
                        log(f"  {problem['task_id']:14s} rep {rep} " + "  ".join(
                            f"{r['mode']} {r.get('tokens_per_s', 0):.2f} tok/s" for r in runs))
                        setting["runs"].extend(runs)
                        setting["summary"] = summarize(setting)
                        setting["provenance"]["load_after"] = os.getloadavg()
                        save()

            trio.run(main)
    if "probe" not in setting:
        probe(python, llama, setting, opts.peers)
        save()


def run(opts: CompareOptions, command: str) -> dict[str, Any]:
    """Run what the results file lacks; returns the results."""
    import torch

    from dsd.node.testnet.calibrate import measure_t0
    from dsd.shard_store import Store

    torch.set_num_threads(1)
    python = opts.petals_python or default_venv() / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no Petals venv at {python.parent.parent}: run `python3 bench/petals/setup.py` first")
    path = opts.path
    results = json.loads(path.read_text()) if path.exists() else {**run_metadata("petals_compare"), "settings": []}
    opts.state.mkdir(parents=True, exist_ok=True)
    target, setup, tokenizer, eos = load_models(opts.models, opts.state, opts.draft_quant)
    workload = Workload(opts.models, opts.problems, tokenizer)
    stops = HUMANEVAL_STOPS if opts.models == "real" else ()
    llama, whole, _, _ = llama_convert(str(target), None)  # the Llama folder Petals serves; our whole target
    refs: dict[str, list[int]] = {t: r for st in results["settings"] for t, r in st["reference"].items()}
    for p in workload.problems:
        if p["task_id"] not in refs:
            refs[p["task_id"]] = reference(whole, workload.ids(p), opts, eos, stops, tokenizer)
    del whole  # the swarms need the memory
    store = Store(target)
    by_key = {s["key"]: s for s in results["settings"]}
    layers = math.ceil(store.num_layers / opts.peers)
    settings = [(f"N{opts.peers}-r{opts.ratio:g}", opts.ratio)] + ([(f"N{opts.peers}-zero", 0.0)] if opts.zero else [])
    for key, ratio in settings:
        setting = by_key.get(key)
        if setting is None:
            t0 = measure_t0(store, layers)
            setting = {"key": key, "peers": opts.peers, "ratio": ratio, "t0_s": t0, "layers_per_peer": layers,
                       "latency_ms": link_latency_ms(ratio, t0), "max_new_tokens": opts.max_new_tokens,
                       "provenance": {"commit": git_commit(), "command": command, "load_before": os.getloadavg(),
                                      "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
                       "reference": {}, "runs": []}
            results["settings"].append(setting)
            log(f"[{key}] t0 {t0 * 1000:.1f} ms over {layers} layers: t1 {setting['latency_ms']:.0f} ms")
        setting["reference"].update({p["task_id"]: refs[p["task_id"]] for p in workload.problems})
        stretch = {"commit": git_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_before": os.getloadavg(),
                   "machine": machine_record()}
        setting["provenance"].setdefault("stretches", []).append(stretch)  # one per (re)start: where each part ran
        write_json(path, results)
        clock = StretchClock(setting, stretch)  # the stretch's time saved with every prompt (a killed one keeps it)

        def save(clock: StretchClock = clock) -> None:
            """Write everything, this stretch's time included."""
            clock.tick()
            write_outputs(results, path)

        run_setting(opts, setting, target, setup, workload, eos, stops, llama, python, save)
        save()
        setting["provenance"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_outputs(results, path)
    log(f"wrote {path}")
    return results


def parse_args(argv: Sequence[str] | None = None) -> CompareOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", choices=MODEL_KINDS, default="real")
    p.add_argument("--peers", type=int, default=4, help="N: spans (our peers, Petals' servers)")
    p.add_argument("--ratio", type=float, default=5.0, help="t1/t0 of the latency setting")
    p.add_argument("--no-zero", action="store_true", help="skip the zero-latency setting")
    p.add_argument("--problems", default=",".join(map(str, PROBLEMS)), help="HumanEval problem indices (default: the fixed 10)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--draft-quant", choices=("none", "int8"), default="int8")
    p.add_argument("--petals-python", type=Path, default=None, help="the Petals venv's python (default: setup.py's)")
    p.add_argument("--results", type=Path, default=None, help="results JSON to write and resume from")
    p.add_argument("--state", type=Path, default=Path(".dsd/petals-compare"))
    p.add_argument("--report-only", action="store_true", help="rewrite the summaries, tables and plot of --results; run nothing")
    a = p.parse_args(argv)
    if a.report_only and a.results is None:
        p.error("--report-only takes --results")
    return CompareOptions(models=a.models, peers=a.peers, ratio=a.ratio, zero=not a.no_zero,
                          problems=comma_list(p, "--problems", a.problems, int), reps=a.reps,
                          max_new_tokens=a.max_new_tokens, draft_quant=a.draft_quant, petals_python=a.petals_python,
                          results=a.results, state=a.state, report_only=a.report_only)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.report_only:
        results = json.loads(opts.path.read_text())
        for st in results["settings"]:
            st["summary"] = summarize(st) if st["runs"] else {}
        write_outputs(results, opts.path)
        return 0
    run(opts, command_line("petals_compare.py", sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
