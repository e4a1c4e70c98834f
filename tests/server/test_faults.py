"""Faulty block peers (tests and demos only): every mode lies by a per-row relative L2 of at least 0.1 on a 2-layer
span of the tiny Qwen2, for a chain window after a prompt and for a token-tree window, while the KV cache keeps the
honest bookkeeping; `intermittent` lies on about its share of windows; `--faulty` is hidden, checked and recorded."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from support.processes import cli, cli_testnet

from dsd.node.cli.main import build_parser, main
from dsd.node.server.faults import MODES, Fault, FaultySession, parse_fault
from dsd.shard_store import HeadModule, SpanCache, SpanModule, Store

SPAN = (1, 3)  # the 2-layer span under test, a sub-span of a peer serving all five layers
PROMPT = [5, 17, 42, 99, 7, 123, 64, 250]
CHAIN = [31, 8, 77, 140]
TREE, PARENTS = [31, 8, 77, 140, 9], (-1, 0, 0, 1, 2)
KEEP = (0, 1, 3)  # an accepted root-to-leaf path of the tree
AFTER_TREE = [12, 200]
ALL_MODES = ("noise", "skip-layer", "identity", "stale", "int4", "intermittent:1")


Window = tuple[list[int], int, tuple[int, ...] | None, int | None, tuple[int, ...] | None]
SESSIONS: list[list[Window]] = [  # (ids, start, parents, commit, keep) of each window of two sessions
    [(PROMPT, 0, None, 0, None), (CHAIN, 8, None, 8, None)],
    [(PROMPT, 0, None, 0, None), (TREE, 8, PARENTS, 8, None), (AFTER_TREE, 11, None, 8, KEEP)],
]


@pytest.fixture(scope="module")
def store(tiny_qwen2_store: Path) -> Store:
    """The tiny Qwen2 store (5 layers, hidden 64)."""
    return Store(tiny_qwen2_store)


@pytest.fixture(scope="module")
def honest_full(store: Store) -> SpanModule:
    """All five layers, honest (read-only: the faults that change weights load their own)."""
    return store.load_span(0, 5)


@functools.cache
def store_head(store: Store) -> HeadModule:
    """The store's head, loaded once."""
    return store.load_head()


def embed_rows(store: Store, honest_full: SpanModule, ids: list[int], start: int, cache: SpanCache,
               parents: tuple[int, ...] | None = None, commit: int | None = None,
               keep: tuple[int, ...] | None = None) -> np.ndarray:
    """The rows layer 1 receives for a window: the embeddings through honest layer 0 (its own cache)."""
    head = store_head(store)
    with torch.inference_mode():
        emb = head.embed(torch.tensor([ids]))
    out = honest_full.sub(0, 1).step(emb, start, cache, commit=commit, parents=parents, keep=keep)
    return out[0].float().numpy()


def runner(span: SpanModule, cache: SpanCache) -> Callable[..., Callable[[], np.ndarray]]:
    """honest(hidden, start, parents, commit, keep): the closure a block server's `_window` hands the fault."""
    def make(hidden: np.ndarray, start: int, parents: tuple[int, ...] | None = None, commit: int | None = None,
             keep: tuple[int, ...] | None = None) -> Callable[[], np.ndarray]:
        def honest() -> np.ndarray:
            out = span.step(torch.from_numpy(hidden).unsqueeze(0), start, cache, commit=commit, parents=parents, keep=keep)
            return out[0].to(torch.float32).numpy()
        return honest
    return make


def relative_l2(lie: np.ndarray, honest: np.ndarray) -> np.ndarray:
    """||lie - honest|| / ||honest|| per row."""
    return np.linalg.norm(lie - honest, axis=-1) / np.linalg.norm(honest, axis=-1)


def session_windows(store: Store, honest_full: SpanModule, fault: Fault | None) -> tuple[list[np.ndarray], list[int]]:
    """Prompt, chain window, prompt again in a new session then a tree window and a chain after keeping a path of
    it: the rows the span sends for each, and its cache length after each (honest when `fault` is None)."""
    full = honest_full if fault is None or fault.mode != "int4" else store.load_span(0, 5)
    if fault is not None:
        fault.prepare(full)
    span = full.sub(*SPAN)
    rows, lengths = [], []
    for session in SESSIONS:
        cache, first = span.new_cache(64), honest_full.sub(0, 1).new_cache(64)
        lies = fault.session(seed=0) if fault is not None else None
        run = runner(span, cache)
        for ids, start, parents, commit, keep in session:
            hidden = embed_rows(store, honest_full, ids, start, first, parents, commit, keep)
            honest = run(hidden, start, parents, commit, keep)
            out = honest() if lies is None else lies.step(span, hidden, honest)
            assert out.shape == hidden.shape and out.dtype == np.float32 and np.isfinite(out).all()
            rows.append(out)
            lengths.append(cache.length)
    return rows, lengths


@pytest.fixture(scope="module")
def honest_windows(store: Store, honest_full: SpanModule) -> tuple[list[np.ndarray], list[int]]:
    """The honest rows and cache lengths of `session_windows`."""
    return session_windows(store, honest_full, None)


@pytest.mark.parametrize("text", ALL_MODES)
def test_every_mode_lies_on_chain_and_tree_windows(text: str, store: Store, honest_full: SpanModule,
                                                   honest_windows: tuple[list[np.ndarray], list[int]]) -> None:
    """Each mode's rows differ from the honest ones by >= 0.1 relative L2 per row; the cache lengths are the honest ones."""
    honest, honest_lengths = honest_windows
    lies, lengths = session_windows(store, honest_full, parse_fault(text))
    assert lengths == honest_lengths  # the cache took every honest step: same commits, kept paths, lengths
    chain, tree, after = (relative_l2(lies[i], honest[i]) for i in (1, 3, 4))
    print(f"{text}: relative L2 chain {np.round(chain, 3)} tree {np.round(tree, 3)} after keep {np.round(after, 3)}")
    for window in (chain, tree, after):
        assert window.min() >= 0.1
    if text == "stale":  # a session's first window is honest; later ones are the previous window's rows
        assert np.array_equal(lies[0], honest[0]) and np.array_equal(lies[2], honest[2])
        assert np.array_equal(lies[1], honest[0][:4]) and np.array_equal(lies[4], honest[3][:2])
    if text == "noise":
        assert 0.3 < float(np.mean(np.concatenate([chain, tree]))) < 0.7


def test_noise_with_a_scale_lies_by_that_relative_distance(store: Store, honest_full: SpanModule,
                                                            honest_windows: tuple[list[np.ndarray], list[int]]) -> None:
    """`noise:0.04` (a lie small enough to hide under a bfloat16 tolerance): every row about 0.04 from the honest."""
    honest, _ = honest_windows
    lies, _ = session_windows(store, honest_full, parse_fault("noise:0.04"))
    gaps = np.concatenate([relative_l2(lies[i], honest[i]) for i in (1, 3, 4)])
    assert str(parse_fault("noise:0.04")) == "noise:0.04" and str(parse_fault("noise")) == "noise"
    assert 0.025 < gaps.min() and gaps.max() < 0.06 and 0.03 < float(np.mean(gaps)) < 0.05, np.round(gaps, 4)


def test_skip_layer_is_the_span_without_its_last_layer(store: Store, honest_full: SpanModule) -> None:
    """Across a kept path of a tree the lie stays exactly what the first layer alone computes on its own cache."""
    lies, _ = session_windows(store, honest_full, parse_fault("skip-layer"))
    first = honest_full.sub(SPAN[0], SPAN[0] + 1)
    cache, feed = first.new_cache(64), honest_full.sub(0, 1).new_cache(64)
    for i, (ids, start, parents, commit, keep) in enumerate(SESSIONS[1], start=len(SESSIONS[0])):
        hidden = embed_rows(store, honest_full, ids, start, feed, parents, commit, keep)
        expected = runner(first, cache)(hidden, start, parents, commit, keep)()
        np.testing.assert_allclose(lies[i], expected, rtol=1e-5, atol=1e-5)
    one_layer = honest_full.sub(2, 3)  # a 1-layer span lies with its input
    hidden = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    out = Fault("skip-layer").session().step(one_layer, hidden, runner(one_layer, one_layer.new_cache())(hidden, 0))
    np.testing.assert_array_equal(out, hidden)


def test_int4_quantizes_every_linear_for_sub_spans_too(store: Store, honest_full: SpanModule) -> None:
    """A sub-span of an int4 span computes with 4-bit weights: at most 15 levels per group of 32 columns of a row."""
    full = store.load_span(0, 5)
    parse_fault("int4").prepare(full)
    sub, honest = full.sub(*SPAN), honest_full.sub(*SPAN)
    linears = [(a, b) for a, b in zip(sub.modules(), honest.modules(), strict=True) if isinstance(a, torch.nn.Linear)]
    assert len(linears) == 2 * 7
    for quant, real in linears:
        w = quant.weight.detach()
        assert w.dtype == real.weight.dtype and w.shape == real.weight.shape and not torch.equal(w, real.weight)
        groups = w.view(w.shape[0], -1, 32)
        steps = groups / (groups.abs().amax(-1, keepdim=True) / 7)
        assert torch.allclose(steps, steps.round(), atol=1e-3)


def test_intermittent_lies_on_about_its_share(store: Store, honest_full: SpanModule) -> None:
    """`intermittent:0.5` adds noise to about half of 200 decode windows (seeded) and is honest on the others."""
    span = honest_full.sub(*SPAN)
    lies = parse_fault("intermittent:0.5").session(seed=0)
    cache = span.new_cache(256)
    rng = np.random.default_rng(1)
    lied = 0
    for i in range(200):
        hidden = rng.standard_normal((1, 64)).astype(np.float32)
        honest = runner(span, cache)(hidden, i)
        before = lies.lies
        out = lies.step(span, hidden, honest)
        if lies.lies > before:
            lied += 1
            assert relative_l2(out, lies.previous).min() >= 0.1
        else:
            np.testing.assert_array_equal(out, lies.previous)
    print(f"intermittent:0.5 lied on {lied} of 200 windows")
    assert 70 <= lied <= 130


@pytest.mark.parametrize("text", ["", "nois", "noise:0", "noise:x", "noise:11", "intermittent", "intermittent:0", "intermittent:1.5",
                                  "intermittent:x", "int8", "intermittent:F"])
def test_parse_fault_names_the_allowed_modes(text: str) -> None:
    """A bad `--faulty` value is a ValueError that lists every allowed mode."""
    with pytest.raises(ValueError) as info:
        parse_fault(text)
    assert all(mode in str(info.value) for mode in MODES)


def test_parse_fault_accepts_every_mode() -> None:
    """Every mode parses, and prints back as it was written."""
    assert parse_fault("intermittent:0.25") == Fault("intermittent", 0.25)
    assert str(parse_fault("intermittent:0.25")) == "intermittent:0.25"
    for mode in ("noise", "skip-layer", "identity", "stale", "int4"):
        assert parse_fault(mode) == Fault(mode) and str(Fault(mode)) == mode
    assert isinstance(Fault("noise").session(), FaultySession)


def test_faulty_is_hidden_from_start_help_but_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """`start --faulty` is not in `start --help`, parses, names the modes on a bad one and refuses non-block roles."""
    with pytest.raises(SystemExit):
        main(["start", "--help"])
    out = capsys.readouterr().out
    assert "--federated" in out and "--faulty" not in out and "faulty" not in out.lower()
    assert build_parser().parse_args(["start", "--store", "s", "--faulty", "noise"]).faulty == "noise"
    assert main(["start", "--store", "s", "--faulty", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and all(mode in err for mode in MODES)
    for role in (["--bootstrap-only"], ["--store", "s", "--federated"]):
        assert main(["start", *role, "--faulty", "noise"]) == 2
        assert "--faulty" in capsys.readouterr().err


def ring_rows(bootstrap: str, peers: list[dict], windows: list[np.ndarray]) -> list[np.ndarray]:
    """The rows a session through the testnet's block peers (in order) returns for consecutive chain windows."""
    import trio

    from dsd.node.peer.host import head_node
    from dsd.node.route.session import open_route_session
    from dsd.protocol import Hop

    hops = [Hop(p["peer_id"], (p["multiaddr"],), p["start"], p["end"]) for p in peers]
    rows: list[np.ndarray] = []

    async def run() -> None:
        async with head_node([bootstrap]) as (node, legs), \
                open_route_session(node, legs, hops, model="tiny-qwen2", max_len=32) as session:
            at = 0
            for hidden in windows:
                rows.append(await session.forward(hidden, start=at, commit=at))
                at += hidden.shape[0]

    trio.run(run)
    return rows


@pytest.mark.network
def test_testnet_up_records_the_faulty_peer(tiny_qwen2_store: Path, tmp_path: Path, store: Store) -> None:
    """`testnet up --faulty 1:noise` records and starts peer 1 only as faulty, and a window through the ring lies."""
    from dsd.node.testnet.processes import TestnetState

    bad = cli("testnet", "up", "--store", str(tiny_qwen2_store), "--peers", "2", "--state", str(tmp_path / "bad"),
              "--faulty", "2:noise", timeout=60)
    assert bad.returncode == 2 and "2:noise" in bad.stderr and "0..1" in bad.stderr, bad.stderr
    bad = cli("testnet", "up", "--store", str(tiny_qwen2_store), "--peers", "2", "--state", str(tmp_path / "bad"),
              "--faulty", "1:lies", timeout=60)
    assert bad.returncode == 2 and all(mode in bad.stderr for mode in MODES), bad.stderr
    state = tmp_path / "tn"
    with cli_testnet(state, "--store", str(tiny_qwen2_store), "--peers", "2", "--faulty", "1:noise") as up:
        faults = {p["name"]: p["fault"] for p in up["peers"]}
        assert faults == {"bootstrap": None, "peer0": None, "peer1": "noise"}
        assert [p.fault for p in TestnetState.load(state).peers] == [None, None, "noise"]
        assert json.loads((state / "testnet.json").read_text())["peers"][2]["fault"] == "noise"
        status = cli("testnet", "status", "--state", str(state), timeout=60)
        assert status.returncode == 0
        lines = {line.split()[0]: line for line in status.stdout.splitlines()[1:]}
        assert "faulty noise" in lines["peer1"] and "faulty" not in lines["peer0"]
        peer_logs = {p["name"]: Path(p["log"]).read_text() for p in up["peers"][1:]}
        assert "LIES ON PURPOSE (--faulty noise)" in peer_logs["peer1"]
        assert "LIES ON PURPOSE" not in peer_logs["peer0"]
        with torch.inference_mode():
            windows = [store_head(store).embed(torch.tensor([ids]))[0].numpy() for ids in (PROMPT, CHAIN)]
            honest_span = store.load_span(0, 5)
            cache = honest_span.new_cache()
            honest = [honest_span(torch.from_numpy(w)[None], at, cache)[0].numpy() for w, at in zip(windows, (0, 8), strict=True)]
        for lie, real in zip(ring_rows(up["bootstrap"], up["peers"][1:], windows), honest, strict=True):
            assert lie.shape == real.shape and lie.dtype == np.float32
            print(f"noise through the ring: relative L2 {np.round(relative_l2(lie, real), 3)}")
            assert relative_l2(lie, real).min() >= 0.1
