"""Audits on a real swarm of daemons, honest and lying (`dsd-node start --faulty MODE`): every lie mode is caught
within its stated bound, the liar — first, middle or last on the route, or serving every layer — is the peer banned,
the text equals the whole model's greedy text, and honest float32 and bfloat16 replicas are never banned.

The swarm (tiny Qwen2, 5 layers): three honest replicas of layers 0:3 and of 3:5 (one of each in bfloat16), one
liar per mode, and a liar serving all five layers. Each test's head bans, before it starts, the liars it is not
about (a test of one liar should not meet another on its replica route).

A second, small swarm (`nearest_liar`) puts one liar where a head's own route planning picks it: `serve` and
`dsd-node generate` as a user runs them catch it, ban it, say so in their JSON, and the swarm page shows the ban."""

from __future__ import annotations

import itertools
import json
import math
import urllib.request
from pathlib import Path

import pytest
import trio
from support.calibration import calibrated
from support.models import hf_greedy
from support.page import Dom, cell, chromium_or_skip, page_until
from support.processes import DaemonSwarm, cli, cli_serve

from dsd.discovery.swarm import SwarmWatch
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import NgramDrafter
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.generation import RouteTarget, generate_over_swarm
from dsd.node.peer.host import head_node
from dsd.node.route.audit import ENDED, AuditOptions
from dsd.protocol import Hop
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL, LAYERS = "tiny-qwen2", 5
PROMPT = [1, 17, 42, 99, 5, 17, 42, 99, 7]
N_NEW = 40
MODES = ("noise", "skip-layer", "identity", "stale", "int4", "intermittent:0.5", "noise:0.04")
LIAR_SPANS = {"noise": "0:3", "skip-layer": "3:5", "identity": "0:3", "stale": "3:5", "int4": "0:3",
              "intermittent:0.5": "0:3", "noise:0.04": "3:5"}
# The tiny random model is far touchier in bfloat16 than the real target (its honest bf16/fp32 gaps reach 0.17 where
# the real target's stay under 0.036): the false-positive test audits with the tiny model's calibrated tolerances per
# precision pair; the lies are told among float32 peers at the default (the real target's) table.
TINY_TOLERANCES = calibrated("tiny")
RATE = 0.5  # the mode tests audit half the windows (seeded): the bound below is what that rate promises


def windows_bound(rate: float, share: float, confidence: float = 0.999) -> int:
    """K such that a liar lying on a share `share` of windows, audited at `rate`, is caught within K windows with
    probability `confidence`: 1 − (1 − rate·share)^K ≥ confidence."""
    return math.ceil(math.log(1 - confidence) / math.log(1 - rate * share))


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    store = str(tiny_qwen2_root / "store")
    with DaemonSwarm(tmp_path_factory.mktemp("integrity")) as net:
        common = ["--store", store, "--bootstrap", net.bootstrap, "--threads", "1"]
        plan = {"a1": ("0:3", []), "a2": ("0:3", []), "abf": ("0:3", ["--dtype", "bfloat16"]),
                "b1": ("3:5", []), "b2": ("3:5", []), "bbf": ("3:5", ["--dtype", "bfloat16"]),
                "all": ("0:5", ["--faulty", "noise"])}
        plan.update({mode: (span, ["--faulty", mode]) for mode, span in LIAR_SPANS.items()})
        procs = {name: net.spawn(name, *common, "--blocks", blocks, *extra) for name, (blocks, extra) in plan.items()}
        peers = {name: net.ready(proc) for name, proc in procs.items()}
        net.wait_route(MODEL, LAYERS)
        yield {"bootstrap": net.bootstrap, "peers": peers}


@pytest.fixture(scope="module")
def expected(tiny_qwen2_hf) -> list[int]:
    return hf_greedy(tiny_qwen2_hf, PROMPT, N_NEW)


def hop(info: dict, start: int, end: int) -> Hop:
    return Hop(info["peer_id"], tuple(info["addrs"]), start, end)


def liars(swarm: dict) -> set[str]:
    return {swarm["peers"][name]["peer_id"] for name in ("all", *MODES)}


def besides(swarm: dict, name: str) -> set[str]:
    """Every peer a test of liar `name` bans beforehand: the other liars, and the bfloat16 replicas (honest, but the
    tiny model's greedy tokens differ in bfloat16, and the text must equal float32's)."""
    return liars(swarm) - {swarm["peers"][name]["peer_id"]} | {swarm["peers"][n]["peer_id"] for n in ("abf", "bbf")}


def generate(swarm: dict, store: Path, hops: list[Hop], audit: AuditOptions, *, exclude: set[str],
             mode: str = "dsd", n: int = N_NEW):
    """One generation from a fresh head over `hops`, audited as `audit` says, with `exclude` banned beforehand."""

    async def main():
        async with head_node([swarm["bootstrap"]]) as (node, legs):
            watch = SwarmWatch(node, MODEL, LAYERS)
            for peer in exclude:
                watch.bans.add(peer, "not part of this test", {})
            setup = HeadSetup(Store(store).load_head(), MODEL, LAYERS, NgramDrafter())
            cfg = GenerationConfig(mode=mode, max_new_tokens=n, gamma=3)
            return await generate_over_swarm(node, legs, watch, setup, PROMPT, cfg, target=RouteTarget(hops=hops),
                                             audit=audit)

    return trio.run(main)


def caught(report, liar: str) -> dict:
    """The audit record of a generation that must have banned `liar` (and nobody else)."""
    audits = report.transport.audits
    assert [b["peer_id"] for b in audits.banned] == [liar], audits.banned
    assert audits.failed >= 1 and audits.repairs, audits.as_dict()
    return audits.banned[0]["evidence"]


@pytest.mark.parametrize("mode", MODES)
def test_each_lie_mode_is_caught_within_its_bound_banned_and_the_text_is_exact(
    swarm: dict, tiny_qwen2_root: Path, expected: list[int], mode: str
) -> None:
    peers = swarm["peers"]
    liar = peers[mode]
    first = LIAR_SPANS[mode] == "0:3"
    hops = [hop(liar, 0, 3), hop(peers["b1"], 3, 5)] if first else [hop(peers["a1"], 0, 3), hop(liar, 3, 5)]
    share = float(mode.split(":")[1]) if mode.startswith("intermittent:") else 1.0
    bound = windows_bound(RATE, share) + (1 if mode == "stale" else 0)  # a stale peer's first window is honest
    report = generate(swarm, tiny_qwen2_root / "store", hops, AuditOptions(rate=RATE, seed=7),
                      exclude=besides(swarm, mode))
    evidence = caught(report, liar["peer_id"])
    first = report.transport.audits.verdicts[0]["window"]  # a liar may dodge blame once (unattributed), not the audit
    print(f"\n{mode}: caught at window {first}, banned at {evidence['window']} (bound {bound}), max distance "
          f"{evidence['max_distance']}, blame {evidence['blame'].get('blocks')}")
    assert first <= bound
    # An intermittent liar's window can be caught through what its lie left in the next peer's cache (a smaller
    # distance than the lie itself): above the tolerance is what counts.
    assert evidence["blame"]["blocks"] in ("0:3", "3:5") and evidence["max_distance"] > evidence["tolerance"]
    assert report.tokens == expected


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_liar_is_found_wherever_it_sits_on_the_route(
    swarm: dict, tiny_qwen2_root: Path, expected: list[int], where: str
) -> None:
    peers = swarm["peers"]
    routes = {
        "first": ([hop(peers["noise"], 0, 1), hop(peers["a1"], 1, 3), hop(peers["b1"], 3, 5)], "noise"),
        "middle": ([hop(peers["a1"], 0, 1), hop(peers["noise"], 1, 3), hop(peers["b1"], 3, 5)], "noise"),
        "last": ([hop(peers["a1"], 0, 3), hop(peers["b1"], 3, 4), hop(peers["skip-layer"], 4, 5)], "skip-layer"),
    }
    hops, name = routes[where]
    report = generate(swarm, tiny_qwen2_root / "store", hops, AuditOptions(rate=1.0),
                      exclude=besides(swarm, name))
    caught(report, peers[name]["peer_id"])
    assert report.tokens == expected


def test_a_liar_on_the_replica_route_is_banned_and_the_honest_generation_goes_on(
    swarm: dict, tiny_qwen2_root: Path, expected: list[int]
) -> None:
    """With every other replica of 0:3 banned, the replica route must take the liar: its audit fails, blame convicts
    it (a peer of the route decides, from layers it serves for another piece), and the generation is not redone."""
    peers = swarm["peers"]
    route = [hop(peers["a2"], 0, 1), hop(peers["a1"], 1, 3), hop(peers["b1"], 3, 5)]
    report = generate(swarm, tiny_qwen2_root / "store", route, AuditOptions(rate=1.0),
                      exclude=besides(swarm, "noise"))
    audits = report.transport.audits
    assert [b["peer_id"] for b in audits.banned] == [peers["noise"]["peer_id"]]
    assert audits.verdicts[0]["verdict"] == "lied" and not audits.repairs
    assert report.tokens == expected


def test_a_liar_serving_every_layer_is_caught_too(swarm: dict, tiny_qwen2_root: Path, expected: list[int]) -> None:
    liar = swarm["peers"]["all"]
    report = generate(swarm, tiny_qwen2_root / "store", [hop(liar, 0, 5)], AuditOptions(rate=1.0),
                      exclude=besides(swarm, "all"))
    assert caught(report, liar["peer_id"])["window"] == 1  # the prompt's own window
    assert report.tokens == expected


def test_honest_float32_and_bfloat16_replicas_pass_200_audits(swarm: dict, tiny_qwen2_root: Path,
                                                               tiny_qwen2_hf) -> None:
    """A float32 route audited on the bfloat16 replicas (every other honest peer banned for the test), window by
    window (ar: one token per window), each audit at the tolerance of the pair the peers' records name (bf16/fp32,
    never fp32/fp32's, which would ban them): no audit fails, nobody is banned."""
    peers = swarm["peers"]
    others = {peers[name]["peer_id"] for name in ("a2", "b2")} | liars(swarm)
    audits = []
    # Audits still running when a generation ends are dropped (ENDED, on a busy machine): generate until 200 finished.
    while sum(a.audited for a in audits) < 200 and len(audits) < 4:
        report = generate(swarm, tiny_qwen2_root / "store", [hop(peers["a1"], 0, 3), hop(peers["b1"], 3, 5)],
                          AuditOptions(rate=1.0, tolerances=TINY_TOLERANCES), exclude=others, mode="ar", n=100)
        audits.append(report.transport.audits)
        assert report.tokens == hf_greedy(tiny_qwen2_hf, PROMPT, 100)
    print(f"\n{[a.as_dict() for a in audits]}")
    assert sum(a.audited for a in audits) >= 200
    assert all(set(a.pairs) == {"bf16/fp32"} for a in audits), [a.pairs for a in audits]
    assert sum(a.failed for a in audits) == 0 and not any(a.banned for a in audits)
    assert all(set(a.skipped) <= {ENDED} for a in audits), [a.skipped for a in audits]  # any other skip is a fault


@pytest.fixture(scope="module")
def nearest_liar(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A small swarm of its own where the liar (`--faulty noise`) is the nearest peer for layers 0:3: the honest
    replicas of 0:3 answer 40 ms later, so a head that bans nobody routes over the liar. Bans live in the head's
    process, never in the swarm: every test here starts a head of its own and meets the liar afresh."""
    store = tiny_qwen2_root / "store"
    with DaemonSwarm(tmp_path_factory.mktemp("nearest_liar")) as net:
        # Every peer announces the same throughput (`--throughput`), so the 40 ms of a1 and a2 alone decide: the
        # liar is the nearest peer for 0:3. Measured throughputs are not used here: a peer measuring while the
        # machine is busy announces a figure several times smaller (162 against 909 tokens/s in one CI run), which
        # outweighs the 40 ms and puts an honest peer first.
        same, slow = ["--throughput", "1000"], ["--wan-latency-ms", "40"]
        liar = net.peer("liar", store, "0:3", "--faulty", "noise", *same)
        peers = [net.peer(name, store, blocks, *same, *extra)
                 for name, blocks, extra in (("a1", "0:3", slow), ("a2", "0:3", slow), ("b1", "3:5", []), ("b2", "3:5", []))]
        net.wait_route(MODEL, LAYERS)
        yield {"bootstrap": net.bootstrap, "store": store, "liar": liar["peer_id"],
               "throughputs": {p["name"]: round(p["throughput"]) for p in (liar, *peers)}}


SERVE_PROMPT = "def add(a, b):"
SERVE_TOKENS = 24


@pytest.fixture(scope="module")
def banning_service(nearest_liar: dict, tmp_path_factory: pytest.TempPathFactory):
    """`serve --audit-rate 1` on the nearest-liar swarm after the same greedy completion asked twice (the first
    catches and bans the liar, the second must avoid it); the service keeps running for the tests that look at
    its page."""
    with cli_serve(tmp_path_factory.mktemp("integrity_serve"), nearest_liar["bootstrap"], nearest_liar["store"],
                   "--audit-rate", "1") as info:
        answers = []
        for _ in range(2):
            body = json.dumps({"model": MODEL, "prompt": SERVE_PROMPT, "max_tokens": SERVE_TOKENS,
                               "temperature": 0}).encode()
            request = urllib.request.Request(info["url"] + "/v1/completions", body,
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as answer:
                answers.append(json.loads(answer.read()))
        yield {**info, "answers": answers}


def test_the_service_bans_the_liar_across_requests_and_shows_it(nearest_liar: dict, banning_service: dict,
                                                                 tiny_qwen2_hf) -> None:
    """`serve` where the liar is the nearest peer for layers 0:3: the first request is repaired and exact, the liar
    banned, the next request avoids it, and the swarm page's JSON lists the ban."""
    liar = nearest_liar["liar"]
    tokenizer = Store(nearest_liar["store"]).load_tokenizer()
    want = tokenizer.decode(hf_greedy(tiny_qwen2_hf, tokenizer(SERVE_PROMPT)["input_ids"], SERVE_TOKENS),
                            skip_special_tokens=True)
    with urllib.request.urlopen(banning_service["url"] + "/api/swarm", timeout=30) as page:
        swarm_page = json.loads(page.read())
    answers = banning_service["answers"]
    assert [a["choices"][0]["text"] for a in answers] == [want, want]
    first, second = (a["dsd"] for a in answers)
    assert [b["peer_id"] for b in first["banned"]] == [liar] and first["audits"]["repairs"]
    assert liar not in second["route"] and not second["banned"] and second["audits"]["failed"] == 0
    assert [b["peer_id"] for b in swarm_page["bans"]] == [liar]
    assert any(p["peer_id"] == liar and p["banned"] for p in swarm_page["peers"])


def test_the_swarm_page_shows_the_ban_in_chromium(nearest_liar: dict, banning_service: dict,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """The swarm page, rendered by a headless Chromium after the service banned the liar: a row of the banned
    peers' table for the liar (with the layers it was blamed for), and the `banned` pill on its row of the peers
    table. Without chromium: skipped, failed in CI."""
    chromium = chromium_or_skip()
    liar = nearest_liar["liar"]

    def rows(dom: Dom, cls: str) -> list[dict]:
        return [r for r in dom.with_class(cls) if r["attrs"].get("data-peer") == liar]

    def shows_ban(dom: Dom) -> bool:
        return bool(rows(dom, "ban")) and any(cell(dom, r, "banned") is not None for r in rows(dom, "peer"))

    dom = page_until(chromium, tmp_path_factory.mktemp("chromium_bans"), banning_service["url"] + "/", shows_ban)
    assert shows_ban(dom), ([dom.text(r) for r in dom.with_class("ban")], [dom.text(r) for r in dom.with_class("peer")])
    assert [r["attrs"]["data-peer"] for r in dom.with_class("ban")] == [liar]
    row = rows(dom, "ban")[0]
    after = dom.elements[next(i for i, e in enumerate(dom.elements) if e is row) + 1:]
    cells = [dom.text(e) for e in itertools.takewhile(lambda e: e["tag"] != "tr", after) if e["tag"] == "td"]
    assert cells[0] == liar[-12:] and cells[2] == "0:3", cells  # its short id, (until when), the layers blamed
    pills = [r["attrs"]["data-peer"] for r in dom.with_class("peer") if cell(dom, r, "banned") is not None]
    assert pills == [liar]


def generate_cli(swarm: dict, *args: str):
    """`dsd-node generate --json` of `PROMPT` over the nearest-liar swarm, as a user's shell runs it: a head
    process of its own, so it has banned nobody before."""
    return cli("generate", "--bootstrap", swarm["bootstrap"], "--store", str(swarm["store"]),
               "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "24", "--threads", "1", *args)


def test_generate_cli_bans_the_nearest_liar_and_its_json_says_so(nearest_liar: dict, tiny_qwen2_hf) -> None:
    """`dsd-node generate --audit-rate 1 --json`: exit 0, the whole model's greedy tokens, the liar (and only it)
    in `banned` with its evidence, and `audits` saying a window failed and the generation was repaired."""
    out = generate_cli(nearest_liar, "--audit-rate", "1", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["tokens"] == hf_greedy(tiny_qwen2_hf, PROMPT, 24)
    assert [b["peer_id"] for b in report["banned"]] == [nearest_liar["liar"]], report["banned"]
    evidence = report["banned"][0]["evidence"]
    assert {"window", "positions", "distances"} <= evidence.keys(), evidence
    assert evidence["positions"] and len(evidence["positions"]) == len(evidence["distances"])
    assert evidence["blame"]["blocks"] == "0:3"
    audits = report["audits"]
    assert audits["rate"] == 1.0 and audits["failed"] >= 1 and audits["repairs"], audits
    assert nearest_liar["liar"] not in report["route"]  # the repaired generation's route


def test_generate_cli_without_audits_bans_nobody_and_refuses_a_rate_above_one(nearest_liar: dict) -> None:
    """`--audit-rate 0`: nothing audited, nobody banned (whether the liar spoiled the text is not checked here);
    `--audit-rate 2`: refused, the message naming the option."""
    off = generate_cli(nearest_liar, "--audit-rate", "0", "--json")
    assert off.returncode == 0, off.stderr[-3000:]
    report = json.loads(off.stdout)
    # the fixture's premise: the liar was on the route, there to be caught (announced throughputs in the message)
    assert nearest_liar["liar"] in report["route"], (report["route"], nearest_liar["throughputs"])
    assert report["audits"]["audited"] == 0 and report["audits"]["failed"] == 0, report["audits"]
    assert report["banned"] == []
    bad = generate_cli(nearest_liar, "--audit-rate", "2", "--json")
    assert bad.returncode != 0
    assert "--audit-rate" in bad.stderr, bad.stderr[-3000:]
    print(f"\n--audit-rate 0: route {report['route']}, tokens {report['tokens']}; --audit-rate 2: {bad.stderr.strip()}")
