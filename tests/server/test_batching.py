"""Continuous batching on a block peer (issue 54), without a network: windows of different sessions that wait while
the span computes run as one step and each gets the rows it would get alone; the oldest window always goes in the
next step (no session starves behind a stream of others); a window its cache refuses gets its own error and the
others their rows; with batching off every step holds one window."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from dsd.node.server.batching import Batcher, Job
from dsd.node.server.limits import BatchOptions
from dsd.shard_store import SpanModule, SpanWindow, Store

FP32_TOL = 1e-4  # a window in a batch vs alone, float32 (the spans test's bound: row order changes the sums)


@pytest.fixture(scope="module")
def span(tiny_qwen2_store: Path) -> SpanModule:
    return Store(tiny_qwen2_store).load_span(0, 5)


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((1, n, 64)).astype(np.float32))


def prefilled(span: SpanModule, n: int, seed: int):
    cache = span.new_cache(64)
    span.step(rows(n, seed), 0, cache)
    return cache


def run_together(batcher: Batcher, jobs: list[Job], hold: float = 0.05) -> None:
    """Every job queued while the span is busy (a step held for `hold` s), then all run; each job's coroutine
    as a session's would."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async with batcher.compute:  # the span is busy: the jobs queue behind it
                for job in jobs:
                    nursery.start_soon(batcher.run, job)
                await trio.sleep(hold)

    trio.run(main)


def finishing_order(batcher: Batcher, jobs: list[Job]) -> list[int]:
    """Queue the jobs one after another (arrival order = index order) while the span is busy; the order in which
    their sessions got their rows back."""
    order: list[int] = []

    async def main() -> None:
        async def one(i: int) -> None:
            await batcher.run(jobs[i])
            order.append(i)

        async with trio.open_nursery() as nursery:
            async with batcher.compute:
                for i in range(len(jobs)):
                    nursery.start_soon(one, i)
                    await trio.sleep(0.001)

    trio.run(main)
    return order


def test_waiting_windows_of_several_sessions_run_as_one_step_and_equal_each_alone(span: SpanModule) -> None:
    sizes, trees = [1, 4, 5, 1], [None, None, [-1, 0, 0, 1, 2], None]
    caches = [prefilled(span, n, seed) for seed, n in enumerate([9, 3, 14, 20])]
    alone_caches = [prefilled(span, n, seed) for seed, n in enumerate([9, 3, 14, 20])]
    windows = [rows(t, 100 + i) for i, t in enumerate(sizes)]
    want = [span.step(x, c.length, c, parents=tree)[0].numpy() for x, c, tree in zip(windows, alone_caches, trees,
                                                                                      strict=True)]
    batcher = Batcher(BatchOptions())
    jobs = [Job(span, SpanWindow(x, c.length, c, None, tree)) for x, c, tree in zip(windows, caches, trees, strict=True)]
    run_together(batcher, jobs)
    assert [j.batch for j in jobs] == [4, 4, 4, 4] and batcher.steps == 1
    for job, w in zip(jobs, want, strict=True):
        assert job.rows is not None and job.rows.shape == w.shape
        assert np.abs(job.rows - w).max() <= FP32_TOL
    assert [c.length for c in caches] == [c.length for c in alone_caches]


def test_batching_off_runs_one_window_per_step(span: SpanModule) -> None:
    caches = [prefilled(span, 4, seed) for seed in range(3)]
    batcher = Batcher(BatchOptions(enabled=False))
    jobs = [Job(span, SpanWindow(rows(1, seed), 4, c)) for seed, c in enumerate(caches)]
    run_together(batcher, jobs)
    assert [j.batch for j in jobs] == [1, 1, 1] and batcher.steps == 3


def test_the_oldest_window_goes_first_and_a_step_keeps_to_its_row_budget(span: SpanModule) -> None:
    """A budget of 8 rows: the 20-row window queued first runs alone at once (the oldest always runs), then the
    1-row windows in steps of at most 8 rows, in the order they came."""
    big = prefilled(span, 2, 0)
    small = [prefilled(span, 2, seed) for seed in range(1, 11)]
    batcher = Batcher(BatchOptions(max_tokens=8))
    jobs = [Job(span, SpanWindow(rows(20, 0), 2, big))] + [Job(span, SpanWindow(rows(1, i), 2, c))
                                                            for i, c in enumerate(small)]
    order = finishing_order(batcher, jobs)
    assert jobs[0].batch == 1 and order[0] == 0
    assert [j.batch for j in jobs[1:]] == [8] * 8 + [2, 2]
    assert batcher.steps == 3


def test_windows_a_head_waits_on_go_before_those_sent_ahead_which_wait_at_most_two_steps(span: SpanModule) -> None:
    """One window a step (a 1-row budget): a window sent ahead on a bet, queued first, lets the blocked windows
    queued after it go first — but only for `AHEAD_PATIENCE` (2) steps, then it goes."""
    caches = [prefilled(span, 2, seed) for seed in range(4)]
    jobs = [Job(span, SpanWindow(rows(1, i), 2, c), ahead=i == 0) for i, c in enumerate(caches)]
    batcher = Batcher(BatchOptions(max_tokens=1))
    order = finishing_order(batcher, jobs)
    assert order == [1, 2, 0, 3]


def test_no_session_starves_behind_a_stream_of_others(span: SpanModule) -> None:
    """Sessions that send a new window as soon as the last returns keep the span busy; a session that queues
    among them is served within the steps already queued before it (here: the very next step)."""
    busy = [prefilled(span, 2, seed) for seed in range(6)]
    late = prefilled(span, 2, 99)
    batcher = Batcher(BatchOptions(max_tokens=4))  # 4 one-row windows a step: the busy ones alone fill it
    done_at: dict[str, int] = {}

    async def main() -> None:
        async def hammer(c) -> None:
            for _ in range(12):
                await batcher.run(Job(span, SpanWindow(rows(1, 1), c.length, c)))

        async def latecomer() -> None:
            await trio.sleep(0.05)
            queued_at = batcher.steps
            await batcher.run(Job(span, SpanWindow(rows(1, 7), late.length, late)))
            done_at["late"] = batcher.steps - queued_at

        async with trio.open_nursery() as nursery:
            for c in busy:
                nursery.start_soon(hammer, c)
            nursery.start_soon(latecomer)

    trio.run(main)
    assert done_at["late"] <= 3  # the step under way, at most the one it was queued behind, then its own


def test_a_window_its_cache_refuses_gets_its_own_error_and_the_others_their_rows(span: SpanModule) -> None:
    full = span.new_cache(4)
    span.step(rows(4, 0), 0, full)  # max_length 4: no room for another position
    ok = prefilled(span, 4, 1)
    alone = prefilled(span, 4, 1)
    x = rows(1, 5)
    want = span.step(x, 4, alone)[0].numpy()
    batcher = Batcher(BatchOptions())
    jobs = [Job(span, SpanWindow(rows(1, 4), 4, full)), Job(span, SpanWindow(x, 4, ok))]

    async def main() -> list[object]:
        results: list[object] = [None, None]

        async def one(i: int) -> None:
            try:
                results[i] = await batcher.run(jobs[i])
            except Exception as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            async with batcher.compute:
                for i in range(2):
                    nursery.start_soon(one, i)
                await trio.sleep(0.05)
        return results

    refused, rows_ok = trio.run(main)
    assert "cache full" in str(refused)
    assert isinstance(rows_ok, np.ndarray) and np.abs(rows_ok - want).max() <= FP32_TOL
    assert (full.length, ok.length) == (4, 5)


MODEL, LAYERS, N_NEW = "tiny-qwen2", 5, 24
HEAD_PROMPTS = [[1, 17, 42, 99, 5], [1, 250, 3, 3, 8, 9], [1, 7, 7, 7], [1, 120, 121, 122, 123, 124, 125],
                [1, 60, 61], [1, 200, 17, 42]]


@pytest.mark.network
def test_heads_generating_at_once_over_a_batching_swarm_each_get_the_whole_models_tokens(
        tiny_qwen2_root: Path, tiny_qwen2_hf, tmp_path: Path) -> None:
    """Six heads at once (`ar` and `dsd` with trees, prompt lookup) over a 2-peer route with batching on (the
    default): every head's greedy tokens equal transformers' for its prompt, the peers did run windows of
    different sessions in one step (their `dsd_peer_step_windows` histogram), the `dsd` heads' windows sent ahead
    reached them marked so (`dsd_peer_windows_ahead`), and the heads read the route's load from the results."""
    from support.heads import generate_on
    from support.models import hf_greedy
    from support.processes import cli_testnet

    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.drafters import NgramDrafter
    from dsd.node.head.setup import HeadSetup
    from dsd.node.peer.host import head_node

    with cli_testnet(tmp_path, "--store", str(tiny_qwen2_root / "store"), "--peers", "2", "--metrics",
                     "--wan-latency-ms", "20") as net:
        setup = HeadSetup(Store(tiny_qwen2_root / "store").load_head(), MODEL, LAYERS, NgramDrafter())
        modes = ["ar", "dsd", "sd", "ar", "dsd", "sd"]
        tokens: list[list[int] | None] = [None] * len(HEAD_PROMPTS)
        loads: list[float] = []
        sent_ahead = 0

        async def one(i: int) -> None:
            nonlocal sent_ahead
            cfg = GenerationConfig(mode=modes[i], max_new_tokens=N_NEW, gamma=3)
            async with head_node([net["bootstrap"]]) as (node, legs):
                report = await generate_on(node, legs, setup, HEAD_PROMPTS[i], cfg)
            tokens[i] = report.tokens
            loads.extend(report.result.route_loads)
            sent_ahead += report.result.pipelined_rounds + report.result.pipelined_wasted

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                for i in range(len(HEAD_PROMPTS)):
                    nursery.start_soon(one, i)

        trio.run(main)
        blocks = [p for p in net["peers"] if p["role"] == "block"]
        together = [scrape_step_windows(p["metrics_url"]) for p in blocks]
        ahead = [scrape_counter(p["metrics_url"], "dsd_peer_windows_ahead_total") for p in blocks]
    for i, prompt in enumerate(HEAD_PROMPTS):
        assert tokens[i] == hf_greedy(tiny_qwen2_hf, prompt, N_NEW), (i, modes[i])
    print(f"\nwindows run alone / with others, per peer: {together}; sent ahead: {sent_ahead} by the heads, "
          f"{ahead} seen per peer; route loads: max {max(loads):.3f}")
    assert any(shared > 0 for _, shared in together), together
    assert sent_ahead > 0 and all(0 < n <= sent_ahead for n in ahead), (sent_ahead, ahead)  # the flag crossed each hop
    assert max(loads) > 0, "no head read a load from its route's results"


def scrape_counter(url: str, name: str) -> float:
    """One counter's value from a peer's metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not among the metrics at {url}")


def scrape_step_windows(url: str) -> tuple[float, float]:
    """(windows run alone, windows run with others) from a peer's `dsd_peer_step_windows` histogram."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    alone = total = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            if s.name == "dsd_peer_step_windows_bucket" and s.labels.get("le") == "1.0":
                alone = s.value
            elif s.name == "dsd_peer_step_windows_count":
                total = s.value
    return alone, total - alone


@pytest.mark.network
def test_a_peer_killed_while_it_batches_four_heads_is_failed_over_by_each_and_every_output_stays_exact(
        tiny_qwen2_root: Path, tiny_qwen2_hf, tmp_path: Path) -> None:
    """Four heads on one route of a replicated swarm (2 spans × 2 replicas, batching on): once the first head has
    12 tokens, the route's first peer, stepping the four sessions' windows together, is SIGKILLed; every head
    fails over to the replica and gets transformers' greedy tokens."""
    import os
    import signal

    from support.models import hf_greedy
    from support.processes import cli_testnet

    from dsd.discovery.survey import wait_for_route
    from dsd.node.head.config import GenerationConfig
    from dsd.node.head.drafters import NgramDrafter
    from dsd.node.head.setup import HeadSetup
    from dsd.node.peer.generation import RouteTarget, generate_over_swarm, swarm_watch
    from dsd.node.peer.host import head_node

    n_new = 40
    prompts = HEAD_PROMPTS[:4]
    with cli_testnet(tmp_path, "--store", str(tiny_qwen2_root / "store"), "--peers", "4", "--replicas", "2",
                     "--wan-latency-ms", "20") as net:
        pids = {p["peer_id"]: p["pid"] for p in net["peers"] if p["role"] == "block"}
        setup = HeadSetup(Store(tiny_qwen2_root / "store").load_head(), MODEL, LAYERS, NgramDrafter())
        reports: list = [None] * len(prompts)
        killed: list[str] = []

        async def main() -> None:
            async with head_node([net["bootstrap"]]) as (node, _):
                view = await wait_for_route(node, MODEL, LAYERS, 30)
                hops = list(view.plan.protocol_hops())
            progress: list[list[int]] = [[] for _ in prompts]

            async def one(i: int) -> None:
                def seen(toks: list[int]) -> None:
                    progress[i].extend(toks)
                    if not killed and sum(map(len, progress)) >= 12:  # every head's session is open and stepping
                        killed.append(hops[0].peer_id)
                        os.kill(pids[hops[0].peer_id], signal.SIGKILL)

                async with head_node([net["bootstrap"]]) as (node, legs):
                    reports[i] = await generate_over_swarm(
                        node, legs, swarm_watch(node, setup), setup, prompts[i],
                        GenerationConfig(mode=["ar", "dsd", "sd", "dsd"][i], max_new_tokens=n_new, gamma=3),
                        target=RouteTarget(hops=hops), on_tokens=seen)

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)

        trio.run(main)
    assert killed, "the kill never happened"
    for i, prompt in enumerate(prompts):
        report = reports[i]
        assert report.tokens == hf_greedy(tiny_qwen2_hf, prompt, n_new), i
        assert report.transport.failovers, i  # each head replaced the dead hop itself
        assert killed[0] not in [h.peer_id for h in report.transport.hops], i
