"""Content-addressed shard transfer (`/dsd/shard/1`): a volunteer fetches only its span from the swarm.

The piece board's bookkeeping is tested on its own first (pure). Then real daemons on loopback
serving an 8-layer tiny Llama: a newcomer started with `--model --manifest-sha256 --blocks 4:8`
fetches exactly layers 4-7, joins the route and generation through it equals HF greedy (the
head fetching its own files the same way); a seeder sending corrupted bytes is blacklisted and
the fetch completes from another; a seeder killed mid-file is replaced without fetching any
byte twice; hostile requests get clear Errors while the peer keeps serving and reads nothing
outside its store.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from support.frames import raw_exchange, raw_frame
from support.models import hf_greedy, save_tiny_model
from support.processes import DaemonSwarm, cli
from transformers import AutoModelForCausalLM

from dsd.discovery.announce import Announcer, fetch_records
from dsd.discovery.host import P2PNode
from dsd.discovery.identity import peer_id_of
from dsd.discovery.records import PeerRecord, RecordError, sign_record, verify_record
from dsd.node.fetch.fetch import Fetcher
from dsd.node.fetch.local import manifest_sha256
from dsd.node.fetch.plan import PieceBoard, files_for
from dsd.node.fetch.request import FetchRequest
from dsd.node.fetch.shard_server import ShardServer
from dsd.node.peer.host import head_node
from dsd.node.testnet.processes import PeerProcess, pid_alive, stop_processes
from dsd.protocol import (
    Error,
    FileChunk,
    FileEnd,
    GetFile,
    GetManifest,
    ManifestData,
    Ping,
    encode,
)
from dsd.protocol.ids import SHARD_PROTOCOL
from dsd.shard_store import Store, convert
from dsd.shard_store.manifest import layer_file

LAYERS = 8
MODEL = "tiny-llama8"
SPAN_FILES = [layer_file(i) for i in range(4, 8)]


# --- the piece board (pure) --------------------------------------------------------------------

def _board(piece: int = 10) -> PieceBoard:
    return PieceBoard([("a", "1" * 64, 25), ("b", "2" * 64, 10), ("c", "3" * 64, 0)], piece)


def test_board_keeps_a_peer_on_its_file_and_spreads_peers_over_files() -> None:
    board = _board()
    assert board.complete("c")  # an empty file is complete before any byte arrives
    first = board.take("p")
    assert (first.relpath, first.offset, first.length) == ("a", 0, 10)
    other = board.take("q")
    assert other.relpath == "b"  # an untouched file, not p's
    board.received("p", 0, 10)
    board.release("p", 10)
    assert board.take("p").offset == 10  # p stays on "a"
    board.received("q", 0, 10)
    board.release("q", 10)
    assert board.complete("b") and not board.complete("a")
    helper = board.take("q")  # nothing untouched left: help with "a", from its far end
    assert (helper.relpath, helper.offset, helper.length) == ("a", 20, 5)


def test_board_prefers_files_the_peer_announces() -> None:
    board = _board()
    assert board.take("p", lambda peer, relpath: relpath == "b").relpath == "b"


def test_board_gives_back_only_what_a_dropped_peer_did_not_send() -> None:
    board = _board(piece=25)
    piece = board.take("p")
    board.received("p", 0, 7)
    board.release("p", 7)
    resumed = board.take("q")
    assert (resumed.relpath, resumed.offset, resumed.length) == ("a", 7, 18)
    board.received("q", 7, 18)
    board.release("q", 25)
    assert piece.relpath == "a" and board.complete("a")
    assert board.files["a"].bytes_by_peer() == {"p": 7, "q": 18}


def test_board_discards_a_blacklisted_peers_bytes_and_makes_retries_single_source() -> None:
    board = _board()
    board.take("p")
    board.received("p", 0, 10)
    board.release("p", 10)
    board.take("q")  # "b"
    board.release("q", 0)
    assert board.discard_from("p") == ["a"]
    assert board.files["a"].received == 0 and [x.offset for x in board.files["a"].pending] == [0, 10, 20]
    board.restart("a", single_source=True)
    assert board.take("p").relpath == "a"
    board.received("p", 0, 10)
    board.release("p", 10)
    assert board.take("q").relpath == "b"  # "a" is p's alone now
    assert board.waiting_on_others("r")
    assert board.dropped("p") == ["a"] and board.files["a"].received == 0


def test_files_for_names_the_span_and_the_head(tiny_llama_store: Path) -> None:
    manifest = Store(tiny_llama_store).manifest
    assert files_for(manifest, (1, 3), False) == [layer_file(1), layer_file(2)]
    head = files_for(manifest, None, True)
    assert {"embed.safetensors", "head.safetensors"} <= set(head) and set(manifest.tokenizer_files) <= set(head)
    with pytest.raises(ValueError):
        files_for(manifest, (3, 9), False)


def test_records_carry_the_manifest_hash_optionally() -> None:
    key = create_new_key_pair()
    now = time.time()
    rec = PeerRecord(peer_id_of(key), (), MODEL, 0, 4, expires=now + 30, issued=now)
    assert "manifest_sha256" not in rec.to_dict()  # peers that predate the field read the same record
    assert verify_record(sign_record(rec, key)).manifest_sha256 is None
    pinned = replace(rec, manifest_sha256="ab" * 32)
    assert verify_record(sign_record(pinned, key)).manifest_sha256 == "ab" * 32
    for bad in ("../manifest.json", "AB" * 32, "ab" * 31):
        with pytest.raises(RecordError):
            replace(rec, manifest_sha256=bad)


# --- a swarm on loopback ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-layer tiny Llama: ROOT/hf, and ROOT/store (model tiny-llama8) with a file the manifest does not
    list inside it and a secret next to it (what a hostile request must never reach)."""
    root = tmp_path_factory.mktemp("tiny8")
    save_tiny_model("llama", root / "hf", layers=LAYERS)
    convert(root / "hf", root / "store", model_id=MODEL)
    (root / "store" / "extra.bin").write_bytes(b"inside the store, listed nowhere")
    (root / "secret.bin").write_bytes(b"outside the store")
    return root


def store_for(tiny8: Path, model_id: str) -> Path:
    """The same weights under another model id (a swarm of their own for one test)."""
    out = tiny8 / f"store-{model_id}"
    if not out.exists():
        convert(tiny8 / "hf", out, model_id=model_id)
    return out


@pytest.fixture(scope="module")
def swarm(tiny8: Path, tmp_path_factory: pytest.TempPathFactory):
    """A bootstrap node and a seeder serving blocks 0:4 of tiny-llama8 (its store holds all 8 layers)."""
    with DaemonSwarm(tmp_path_factory.mktemp("shard-swarm")) as net:
        seeder = net.peer("seeder", tiny8 / "store", "0:4")
        yield {"bootstrap": net.bootstrap, "net": net, "state": net.state, "seeder": seeder,
               "sha": manifest_sha256(tiny8 / "store")}


def tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")}


@pytest.mark.network
def test_a_newcomer_fetches_only_its_span_joins_the_route_and_generates_exactly(swarm: dict, tiny8: Path) -> None:
    state, sha = swarm["state"], swarm["sha"]
    info = swarm["net"].start("newcomer", "--model", MODEL, "--manifest-sha256", sha, "--blocks", "4:8",
                              "--fetch-dir", str(state / "fetched"), "--bootstrap", swarm["bootstrap"], "--threads", "1")
    assert (info["start"], info["end"]) == (4, 8)
    fetch = info["fetch"]
    assert fetch["fetched_files"] == SPAN_FILES and fetch["kept_files"] == []
    assert fetch["bytes_received"] == fetch["bytes_needed"] == sum(
        (tiny8 / "store" / f).stat().st_size for f in SPAN_FILES)
    out = Path(fetch["out"])
    assert out == state / "fetched" / MODEL / sha[:16]
    assert tree(out) == {"manifest.json", "fetched.json", *SPAN_FILES}  # exactly the span, nothing else
    verify = cli("store", "verify", str(out))
    assert verify.returncode == 0 and "4 of 12 files" in verify.stdout, verify.stdout + verify.stderr

    # The head fetches its own files the same way; the route must run 0:4 on the seeder, 4:8 on the newcomer.
    prompt = [1, 17, 42, 99, 5, 6]
    gen = cli("generate", "--model", MODEL, "--manifest-sha256", sha, "--fetch-dir", str(state / "head"),
              "--bootstrap", swarm["bootstrap"], "--prompt-ids", ",".join(map(str, prompt)),
              "--max-new-tokens", "12", "--json")
    assert gen.returncode == 0, gen.stderr[-3000:]
    reference = AutoModelForCausalLM.from_pretrained(str(tiny8 / "hf"), dtype=torch.float32).eval()
    assert json.loads(gen.stdout)["tokens"] == hf_greedy(reference, prompt, 12)
    head = Store(tiny8 / "store").manifest
    assert tree(state / "head" / MODEL / sha[:16]) == {"manifest.json", "fetched.json", "embed.safetensors",
                                                       "head.safetensors", *head.tokenizer_files}
    stop_processes([PeerProcess.from_dict(info)])


@pytest.mark.parametrize("command", [["start", "--blocks", "4:8"], ["store", "fetch", "--blocks", "4:8"],
                                     ["generate", "--prompt-ids", "1,2"], ["serve"]])
def test_without_a_trust_root_fetching_commands_refuse_and_say_why(command: list[str]) -> None:
    from dsd.node.cli.main import main

    with pytest.raises(SystemExit) as refused:
        main([*command, "--model", MODEL, "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/" + "1" * 46])
    why = str(refused.value.code)
    assert "--manifest-sha256" in why and "tampered" in why and "--trust-first-manifest" in why


class CorruptingServer(ShardServer):
    """A seeder that flips a byte in every chunk it sends."""

    def read_chunk(self, fd: int, offset: int, n: int) -> bytes:
        data = bytearray(super().read_chunk(fd, offset, n))
        data[len(data) // 2] ^= 0xFF
        return bytes(data)


class SlowServer(ShardServer):
    """An honest seeder that takes half a second per chunk, so the corrupting one surely gets asked too."""

    def read_chunk(self, fd: int, offset: int, n: int) -> bytes:
        time.sleep(0.5)
        return super().read_chunk(fd, offset, n)


async def seed(bootstrap: str, store: Path, server: type[ShardServer], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """An in-process seeder: a libp2p node serving `store` with `server`, announcing all its blocks."""
    sha = manifest_sha256(store)
    model = Store(store).manifest.model_id
    async with P2PNode(create_new_key_pair(), bootstrap=[bootstrap]) as node, trio.open_nursery() as nursery:
        handler = server(Store(store))
        node.set_handler(SHARD_PROTOCOL, handler)
        announcer = Announcer(node, lambda: PeerRecord(node.peer_id, tuple(node.addrs), model, 0, LAYERS,
                                                       manifest_sha256=sha), ttl_s=30)
        await nursery.start(announcer.run)
        task_status.started((node.peer_id, handler))
        await trio.sleep_forever()


@pytest.mark.network
def test_a_corrupting_seeder_is_blacklisted_and_the_fetch_completes_from_another(swarm: dict, tiny8: Path,
                                                                                 tmp_path: Path) -> None:
    store = store_for(tiny8, "tiny-llama8-b")
    sha, out = manifest_sha256(store), tmp_path / "fetched"

    async def main() -> tuple:
        async with trio.open_nursery() as nursery:
            liar, liar_server = await nursery.start(seed, swarm["bootstrap"], store, CorruptingServer)
            honest, _ = await nursery.start(seed, swarm["bootstrap"], store, SlowServer)
            run = await trio.to_thread.run_sync(lambda: cli(
                "store", "fetch", "--model", "tiny-llama8-b", "--manifest-sha256", sha, "--blocks", "4:8",
                "--out", str(out), "--bootstrap", swarm["bootstrap"], "--json"))
            nursery.cancel_scope.cancel()
        return run, liar, honest, sum(liar_server.bytes_sent.values())

    run, liar, honest, liar_sent = trio.run(main)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert liar_sent > 0
    assert report["blacklisted"] == [liar] and report["peers"][liar]["state"] == "blacklisted"
    assert "sha256" in report["peers"][liar]["reason"]
    assert [e["event"] for e in report["events"] if e["peer"] == liar][:2] == ["hash_mismatch", "blacklisted"]
    assert all(f["from"] == {honest: f["size"]} for f in report["files"].values())  # every kept byte is honest
    assert tree(out) == {"manifest.json", "fetched.json", *SPAN_FILES}
    verify = cli("store", "verify", str(out))
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.network
def test_a_seeder_killed_mid_file_is_replaced_without_fetching_a_byte_twice(swarm: dict, tiny8: Path,
                                                                           tmp_path: Path) -> None:
    store = store_for(tiny8, "tiny-llama8-c")
    net = swarm["net"]
    slow = ("--store", str(store), "--blocks", "0:8", "--bootstrap", swarm["bootstrap"], "--wan-mbit", "2", "--threads", "1")
    victim, other = net.spawn("victim", *slow), net.spawn("other", *slow)  # both start at once
    try:
        victim_id = net.ready(victim)["peer_id"]
        other_id = net.ready(other)["peer_id"]
        killed: list[tuple[str, int]] = []
        first_file: list[str] = []

        def on_chunk(peer: str, relpath: str, offset: int, n: int) -> None:
            """Kill the victim at its first chunk of a second file: one file finished, one mid-way."""
            if peer != victim_id or killed:
                return
            if not first_file:
                first_file.append(relpath)
            elif relpath != first_file[0]:
                os.kill(victim.pid, signal.SIGKILL)
                killed.append((relpath, offset + n))

        async def main() -> dict:
            async with head_node([swarm["bootstrap"]]) as (node, _legs):
                request = FetchRequest("tiny-llama8-c", manifest_sha256(store), out=tmp_path / "fetched",
                                       piece_bytes=48 * 1024, chunk_bytes=8 * 1024, reply_timeout_s=20)
                fetcher = Fetcher(node, request, on_chunk=on_chunk)
                local = await fetcher.open()
                return await fetcher.fetch(files_for(local.manifest, (4, 8), False))

        report = trio.run(main)
    finally:
        stop_processes([victim, other])
    assert killed, "the victim never reached a second file"
    files = report["files"]
    sent_by_victim = report["peers"][victim_id]["bytes"]
    assert victim_id in files[first_file[0]]["from"]
    assert sum(f["from"].get(victim_id, 0) for f in files.values()) == sent_by_victim > 0  # all of it kept
    assert set(files[killed[0][0]]["from"]) == {victim_id, other_id}  # resumed mid-file by the other peer
    assert report["peers"][victim_id]["state"] == "dropped" and report["peers"][other_id]["state"] == "ok"
    assert report["bytes_received"] == report["bytes_needed"]  # no byte fetched twice
    assert report["peers"][victim_id]["bytes"] + report["peers"][other_id]["bytes"] == report["bytes_needed"]
    fetched = Store(tmp_path / "fetched")
    assert tree(fetched.path) == {"manifest.json", "fetched.json", *SPAN_FILES}
    assert fetched.verify(only=SPAN_FILES) == []


@pytest.mark.network
def test_hostile_requests_get_clear_errors_and_the_peer_keeps_serving(swarm: dict, tiny8: Path) -> None:
    peer = swarm["seeder"]
    store = Store(tiny8 / "store")
    layer = tiny8 / "store" / layer_file(2)
    size = layer.stat().st_size
    sha_of = {name: hashlib.sha256(path.read_bytes()).hexdigest()
              for name, path in {"layer": layer, "extra": tiny8 / "store" / "extra.bin",
                                 "secret": tiny8 / "secret.bin"}.items()}
    assert store.manifest.files[layer_file(2)]["sha256"] == sha_of["layer"]
    outcomes: dict[str, list] = {}

    async def main() -> None:
        async with head_node([swarm["bootstrap"]]) as (node, _legs):
            one_stream = [  # several bad requests on one stream: each gets its Error, the stream goes on
                GetFile("0" * 64, 0, 1),
                GetFile(sha_of["extra"], 0, 4),
                GetFile(sha_of["secret"], 0, 4),
                GetFile(sha_of["layer"], size, 1),
                GetFile(sha_of["layer"], 10, size),
                GetManifest("someone-elses-model"),
                GetFile(sha_of["layer"], 100, 50, 20),
            ]
            got = await raw_exchange(node, peer, SHARD_PROTOCOL, b"".join(encode(m) for m in one_stream), replies=6 + 3 + 1)
            outcomes["one stream"] = got
            traversal = {**GetFile(sha_of["layer"], 0, 1).to_wire(), "sha256": "../../secret.bin"}
            huge = {**GetFile(sha_of["layer"], 0, 1).to_wire(), "length": 2**60}
            # garbage in a whole frame: a random header would 1 time in 64 claim up to 64 MiB still to come,
            # and the peer rightly waits for them
            garbage = raw_frame(random.Random(0).randbytes(296))
            for label, data in {"garbage": garbage, "4 GiB header": b"\xff\xff\xff\xff" + b"x" * 8,
                                "path as a hash": raw_frame(traversal), "huge length": raw_frame(huge),
                                "not a request": encode(Ping(7))}.items():
                outcomes[label] = await raw_exchange(node, peer, SHARD_PROTOCOL, data)
            flood = await raw_exchange(node, peer, SHARD_PROTOCOL, encode(GetManifest(MODEL)) * 80, replies=80)
            outcomes["flood"] = flood
            await trio.sleep(2.5)  # the flood emptied this peer's request bucket; it refills at 20 requests/s
            records = await fetch_records(node, MODEL, LAYERS)
            assert {r.manifest_sha256 for r in records if r.peer_id == peer["peer_id"]} == {swarm["sha"]}
            good = await raw_exchange(node, peer, SHARD_PROTOCOL, encode(GetFile(sha_of["layer"], 0, size)), replies=2)
            outcomes["good"] = good

    trio.run(main)
    errors = outcomes["one stream"]
    codes = [m.code for m in errors[:6]]
    assert all(isinstance(m, Error) for m in errors[:6]), errors
    assert codes == ["not_found", "not_found", "not_found", "bad_request", "bad_request", "not_found"], errors
    assert "outside its" in errors[3].message
    assert [type(m) for m in errors[6:]] == [FileChunk, FileChunk, FileChunk, FileEnd]  # then a good request
    assert b"".join(m.data for m in errors[6:9]) == layer.read_bytes()[100:150]
    for label in ("garbage", "4 GiB header", "path as a hash", "huge length", "not a request"):
        got = outcomes[label]
        assert len(got) == 1 and isinstance(got[0], Error), (label, got)
    assert "GetFile.sha256" in outcomes["path as a hash"][0].message
    assert outcomes["huge length"][0].code == "limit" and "GetFile.length" in outcomes["huge length"][0].message
    assert outcomes["not a request"][0].code == "bad_request"
    flood = outcomes["flood"]
    assert sum(isinstance(m, ManifestData) for m in flood) >= 30
    assert any(isinstance(m, Error) and m.code == "busy" for m in flood)
    good = outcomes["good"]
    assert b"".join(m.data for m in good if isinstance(m, FileChunk)) == layer.read_bytes()
    assert isinstance(good[-1], FileEnd) and good[-1].end == size, good
    assert pid_alive(peer["pid"])


def test_store_inspect_prints_the_trust_root(tiny8: Path, tmp_path: Path) -> None:
    run = cli("store", "inspect", str(tiny8 / "store"), "--json")
    assert json.loads(run.stdout)["manifest_sha256"] == hashlib.sha256((tiny8 / "store" / "manifest.json").read_bytes()).hexdigest()
    broken = tmp_path / "store"
    shutil.copytree(tiny8 / "store", broken)
    (broken / "fetched.json").write_text(json.dumps({"files": [layer_file(0)], "manifest_sha256": manifest_sha256(broken)}))
    (broken / layer_file(0)).write_bytes(b"torn")
    run = cli("store", "verify", str(broken))
    assert run.returncode == 1 and layer_file(0) in run.stderr


@pytest.mark.network
def test_a_manifest_round_lost_to_dial_errors_is_tried_again(swarm: dict, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every source failing to connect once (a dial that did not come up) is not the end of the fetch: the round over
    the sources is run again after a pause, and the manifest comes from the second one."""
    original = Fetcher._manifest_from
    tries: list[str] = []

    async def flaky(self: Fetcher, src):
        tries.append(src.peer_id)
        if tries.count(src.peer_id) == 1:
            raise ConnectionError("Failed to create stream to peer (test)")
        return await original(self, src)

    monkeypatch.setattr(Fetcher, "_manifest_from", flaky)

    async def main():
        async with head_node([swarm["bootstrap"]]) as (node, _legs):
            fetcher = Fetcher(node, FetchRequest(MODEL, swarm["sha"], out=tmp_path / "fetched"))
            return await fetcher.open()

    local = trio.run(main)
    assert local.manifest.model_id == MODEL and len(tries) >= 2 and tries[0] == tries[-1]
