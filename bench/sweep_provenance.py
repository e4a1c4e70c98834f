"""A sweep setting's bookkeeping: the options it is bound to, the stretches it ran in (when, on which commit and
machine, with which step time and links), how long each ran, and the runs set apart with their reason.

Pure functions over a results file's records, except for reading the machine, the clock and the commit.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from time import monotonic
from typing import Any

from harness import machine_info

MACHINE_KEYS = ("host_id", "cpu_model", "cpu_count")  # what a stretch records of its machine
NOT_RECORDED = "not recorded"


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(msg, file=sys.stderr, flush=True)


def now_stamp() -> str:
    """The local time as provenance records it (second precision, like `started`)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def machine_record() -> dict[str, Any]:
    """The machine a stretch runs on (host id, CPU model, cores): the cells of one grid may run on several hosts."""
    info = machine_info()
    return {k: info.get(k) for k in MACHINE_KEYS}


# --- a setting's identity and options -------------------------------------------------------------


def setting_key(models: str, peers: int, ratio: float | None, profile: str | None = None, wire: str = "") -> str:
    """The key of the (models, N, t1/t0) setting in a results file; a link profile that fixes the latency
    (`ratio` None) names the setting instead of t1/t0, a codec other than the exact one follows: real-N4-home,
    real-N4-home-int8+zstd."""
    key = f"{models}-N{peers}-{profile}" if ratio is None else f"{models}-N{peers}-r{ratio:g}"
    return f"{key}-{wire}" if wire else key


def wire_label(codec: str, zstd: bool) -> str:
    """A wire format as keys and tables name it: `int8+zstd`, `bf16`, `auto` (the exact default)."""
    return codec + ("+zstd" if zstd else "")


# Options added after results were first written, with the value every older setting ran with.
LATER_OPTIONS: dict[str, Any] = {"pin_head": False, "link_profile": "paper", "peer_profiles": [], "codec": "auto",
                                 "zstd": False, "weights": "auto"}


def setting_options(opts: Any) -> dict[str, Any]:
    """What a setting's runs depend on besides N and t1/t0; recorded with the setting, compared on resume."""
    return {"problems": opts.problems, "modes": opts.modes, "reps": opts.reps,
            "max_new_tokens": opts.max_new_tokens, "tau_max": opts.tau_max, "draft_quant": opts.draft_quant,
            "branches": opts.branches, "pipeline": opts.pipeline,
            "tree_nodes": "auto" if opts.tree_nodes is None else opts.tree_nodes,
            **{k: getattr(opts, k) for k in LATER_OPTIONS}}


def option_mismatch(setting: dict[str, Any], opts: Any, *, more_modes: bool = False) -> list[str]:
    """How the options a setting ran with differ from these (an option older settings lack counts as its
    `LATER_OPTIONS` value); `more_modes`: it may also hold other modes."""
    ours, theirs = setting_options(opts), {**LATER_OPTIONS, **setting.get("options", {})}
    diff = [f"{k} {theirs.get(k, 'unset')!r} (here {v!r})" for k, v in ours.items()
            if k != "modes" and theirs.get(k, "unset") != v]
    modes = theirs.get("modes", [])
    if not (set(opts.modes) <= set(modes) if more_modes else list(opts.modes) == list(modes)):
        diff.append(f"modes {modes!r} (here {list(opts.modes)!r})")
    return diff


def merge_settings(results: dict[str, Any], opts: Any) -> None:
    """Adopt from `opts.merge` the settings of this sweep's grid that the results lack, if run with its options."""
    have = {s["key"] for s in results["settings_runs"]}
    wanted = {opts.key(n, r) for n in opts.peers for r in opts.grid_ratios}
    for path in opts.merge:
        try:
            other = json.loads(path.read_text())["settings_runs"]
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"--merge {path}: not a sweep results file ({exc})") from None
        for s in other:
            if s["key"] not in wanted or s["key"] in have:
                continue
            if diff := option_mismatch(s, opts, more_modes=True):
                raise SystemExit(f"--merge {path}: setting {s['key']} ran with other options: {'; '.join(diff)}")
            results["settings_runs"].append({**s, "merged_from": path.name})
            have.add(s["key"])
            log(f"merged {s['key']} from {path.name} ({len(s['runs'])} runs)")
    results["settings_runs"].sort(key=lambda s: (s["models"], s["peers"], s["ratio"]))


# --- stretches: where and when a setting ran -------------------------------------------------------


def stretches(setting: dict[str, Any]) -> list[dict[str, Any]]:
    """A setting's stretches, its start then each resume: when, commit, machine, the step time t0 measured then
    and the links that held t1/t0 (None where the file did not record it), seconds run and last save."""
    prov, cal = setting.get("provenance", {}), setting.get("calibration", {})
    keys = ("started", "commit", "machine", "stretch_s", "saved")
    first = {**{k: prov.get(k) for k in keys}, "t0_s": cal.get("t0_s"), "latency_ms": cal.get("latency_ms")}
    return [first, *({k: r.get(k) for k in (*keys, "t0_s", "latency_ms")} for r in prov.get("resumed", []))]


def machine_label(machine: dict[str, Any]) -> str:
    """A machine as the tables show it: CPU model, cores and a short host id."""
    host = (machine.get("host_id") or "?")[:8]
    return f"{machine.get('cpu_model') or 'unknown CPU'} ×{machine.get('cpu_count') or '?'} ({host})"


def cell_machine(setting: dict[str, Any]) -> str:
    """The machine a setting ran on: one label, 'several: …' when its stretches ran on different hosts, and
    'not recorded' for stretches from before machines were recorded per stretch."""
    labels = [machine_label(s["machine"]) if s.get("machine") else None for s in stretches(setting)]
    known = list(dict.fromkeys(x for x in labels if x))
    if not known:
        return NOT_RECORDED
    text = known[0] if len(known) == 1 else "several: " + "; ".join(known)
    missing = labels.count(None)
    return text + (f" ({missing} of {len(labels)} stretches {NOT_RECORDED})" if missing else "") + cell_setup(setting)


def cell_setup(setting: dict[str, Any]) -> str:
    """How the one box played separate machines in a setting, as the tables show it after the machine: the
    head's CPU when pinned, a link profile other than `paper`, per-peer profiles, a codec other than exact."""
    o = {**LATER_OPTIONS, **setting.get("options", {})}
    place = setting.get("provenance", {}).get("placement", {})
    parts = [f"head on CPU {place.get('head_cpus', '?')}, testnet on {place.get('peer_cpus', '?')}"] if o["pin_head"] else []
    if o["link_profile"] != "paper" or o["peer_profiles"]:
        parts.append("links " + o["link_profile"] + "".join(f", peer {p}" for p in o["peer_profiles"]))
    if o["codec"] != "auto" or o["zstd"]:
        parts.append("codec " + wire_label(o["codec"], o["zstd"]))
    return "".join(f"; {x}" for x in parts)


class StretchClock:
    """Adds the running stretch's seconds to its record and to the setting's `wall_s` at every save, so a run
    killed mid-setting keeps the time of every stretch up to its last save (wall_s used to be added only when a
    setting finished, so an interrupted stretch's time was lost)."""

    def __init__(self, setting: dict[str, Any], record: dict[str, Any], clock: Callable[[], float] | None = None) -> None:
        self.setting, self.record, self.clock = setting, record, clock or monotonic
        self.wall0, self.own0 = setting.get("wall_s", 0.0), record.get("stretch_s", 0.0)
        self.start = self.clock()

    def tick(self) -> None:
        """Record the time run so far in this stretch (called before every save)."""
        spent = self.clock() - self.start
        self.setting["wall_s"] = round(self.wall0 + spent, 1)
        self.record["stretch_s"] = round(self.own0 + spent, 1)
        self.record["saved"] = now_stamp()


def _day_minute(stamp: str | None) -> str:
    """A provenance time to the minute, for the stretches table."""
    return stamp.replace("T", " ")[:16] if stamp else NOT_RECORDED


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds to a tenth, '-' when not measured."""
    return f"{seconds * 1000:.1f}" if seconds is not None else "-"


def stretches_table(results: dict[str, Any]) -> str:
    """Per setting, each stretch: start, last save (or the setting's end), commit, t0 and links then, machine,
    seconds run: what a results file knows of where and when each cell ran."""
    lines = ["| setting | stretch | started | until | commit | t0 ms | links ms | machine | ran s |", "|---" * 9 + "|"]
    for s in results["settings_runs"]:
        marks = stretches(s)
        for i, m in enumerate(marks):
            until = m["saved"] or (s["provenance"].get("finished") if i == len(marks) - 1 else None)
            lines.append(
                f"| {s['key']} | {'start' if i == 0 else f'resume {i}'} | {_day_minute(m['started'])} | "
                f"{_day_minute(until)} | {(m['commit'] or '?')[:7]} | {_ms(m['t0_s'])} | "
                f"{'-' if m['latency_ms'] is None else format(m['latency_ms'], '.0f')} | "
                f"{machine_label(m['machine']) if m['machine'] else NOT_RECORDED} | "
                f"{NOT_RECORDED if m['stretch_s'] is None else format(m['stretch_s'], '.0f')} |")
    return "\n".join(lines) + "\n"


# --- runs set apart ---------------------------------------------------------------------------------


def set_apart_groups(setting: dict[str, Any]) -> list[dict[str, Any]]:
    """The setting's runs set apart as {reason, when, commit, runs} groups; hand-made entries of older files (each
    a run carrying its reason) are grouped by reason, their time and commit unknown."""
    groups: list[dict[str, Any]] = []
    by_reason: dict[str, dict[str, Any]] = {}
    for item in setting.get("discarded", []):
        if "runs" in item:
            groups.append(item)
            continue
        reason = item.get("reason", "")
        if reason not in by_reason:
            by_reason[reason] = {"reason": reason, "when": None, "commit": None, "runs": []}
            groups.append(by_reason[reason])
        by_reason[reason]["runs"].append(item)
    return groups


def task_id(text: str) -> str:
    """A HumanEval task as `--task` takes it: `HumanEval/32` or just `32`."""
    return f"HumanEval/{int(text)}" if text.strip().isdigit() else text.strip()


def set_apart(setting: dict[str, Any], reason: str, *, reps: Iterable[int] = (), tasks: Iterable[str] = (),
              commit: str, when: str) -> dict[str, Any]:
    """Move a setting's runs of the chosen repetitions and/or tasks (none chosen: every run) into its `discarded`
    list with the reason, time and commit: they leave the medians but stay in the file, and their prompts run
    again in every mode on resume (every mode of a prompt goes, so the pairs stay adjacent in time)."""
    if not reason.strip():
        raise ValueError("setting runs apart needs a reason")
    reps, tasks = sorted(set(reps)), sorted({task_id(t) for t in tasks})
    chosen = [r for r in setting["runs"] if (not reps or r["rep"] in reps) and (not tasks or r["task_id"] in tasks)]
    if not chosen:
        raise ValueError(f"no run of {setting['key']} is of repetition(s) {reps or 'any'} and task(s) {tasks or 'any'}")
    gone = {id(r) for r in chosen}
    setting["runs"] = [r for r in setting["runs"] if id(r) not in gone]
    entry = {"reason": reason, "when": when, "commit": commit,
             "selection": {"reps": reps or "all", "tasks": tasks or "all"}, "runs": chosen}
    setting.setdefault("discarded", []).append(entry)
    return entry
