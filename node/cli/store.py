"""`dsd-node convert` (import a checkpoint into a store), `dsd-node store inspect|verify|fetch`, and the
options every command that fetches a store from the swarm shares (`add_fetch_options`, `fetched_store`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _err(message: str) -> int:
    print(f"dsd-node: error: {message}", file=sys.stderr)
    return 1


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


@contextmanager
def _progress(description: str, enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich progress bar on stderr fed by (what, done, total) callbacks; None when disabled."""
    if not enabled:
        yield None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(description, total=None)

    def update(what: str, done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        yield update


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert an HF folder or GGUF file into a store and print its summary."""
    from dsd.shard_store import Store, StoreError, convert

    started = time.perf_counter()
    try:
        with _progress("writing store files", sys.stderr.isatty()) as progress:
            convert(
                args.src,
                args.out,
                dtype=args.dtype,
                model_id=args.model_id,
                gguf_file=args.gguf_file,
                overwrite=args.overwrite,
                progress=progress,
                weights=args.weights,
            )
        summary = Store(args.out).summary()
    except StoreError as exc:
        return _err(str(exc))
    summary["convert_seconds"] = round(time.perf_counter() - started, 2)
    return _show_written(args, summary, f"converted in {summary['convert_seconds']:.1f} s")


def _show_written(args: argparse.Namespace, summary: dict, line: str) -> int:
    """A store just written: its summary as JSON (`--json`), or the table and `line`."""
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
        print(line)
    return 0


def _print_summary(summary: dict) -> None:
    table = Table(title=f"store {summary['path']}", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")  # the manifest sha256 is copied from here whole
    rows = [
        ("model id", summary["model_id"]),
        ("family", summary["family"]),
        ("layers", str(summary["num_layers"])),
        ("hidden size", str(summary["hidden_size"])),
        ("vocab size", str(summary["vocab_size"])),
        ("dtype", summary["dtype"]),
        ("weights", summary.get("weights", "")),
        ("files", str(summary["files"])),
        ("total size", _human(summary["total_bytes"])),
        ("head (embed+norm+lm_head)", _human(summary["head_bytes"])),
        ("tied embeddings", "yes" if summary["tied_embeddings"] else "no"),
        ("tokenizer", "yes" if summary["tokenizer"] else "no (token-id prompts only)"),
    ]
    if summary.get("manifest_sha256"):
        rows.append(("manifest sha256 (trust root)", summary["manifest_sha256"]))
    if summary.get("fetched_files") is not None:
        rows.append(("fetched", f"{summary['fetched_files']} of {summary['files']} files (a partial store)"))
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a store's manifest summary (table, or JSON with --json), with the manifest's sha256 (the trust root)."""
    from dsd.node.fetch.local import manifest_sha256, read_marker
    from dsd.shard_store import Store, StoreError

    try:
        summary = Store(args.store).summary()
        summary["manifest_sha256"] = manifest_sha256(args.store)
        marker = read_marker(args.store)
    except StoreError as exc:
        return _err(str(exc))
    summary["fetched_files"] = None if marker is None else len(marker["files"])
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
        print(f"manifest sha256 {summary['manifest_sha256']}  (pin it: --manifest-sha256)")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Write a quantized copy of a float store (its layers' linears in int8 or int4), then print its summary."""
    from dsd.node.fetch.local import manifest_sha256
    from dsd.shard_store import Store, StoreError
    from dsd.shard_store.writer import quantize_store

    t0 = time.perf_counter()
    try:
        quantize_store(args.store, args.out, args.weights, overwrite=args.overwrite)
        summary = Store(args.out).summary()
    except (StoreError, ValueError) as exc:
        return _err(str(exc))
    summary["manifest_sha256"] = manifest_sha256(args.out)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return _show_written(args, summary, f"wrote {args.out} in {summary['seconds']} s; manifest sha256 "
                                        f"{summary['manifest_sha256']}")


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every file of a store (of a fetched store: every file it fetched); exit 1 naming each one that is
    missing or does not match."""
    from dsd.node.fetch.local import files_to_verify, manifest_sha256
    from dsd.shard_store import Store, StoreError

    try:
        store = Store(args.store)
        files, marker = files_to_verify(args.store, store.manifest)
        if marker is not None and marker.get("manifest_sha256") != manifest_sha256(args.store):
            return _err(f"{args.store}: the manifest is not the one the files were fetched for")
        with _progress("hashing", sys.stderr.isatty()) as progress:
            bad = store.verify(progress=progress, only=None if marker is None else files)
    except StoreError as exc:
        return _err(str(exc))
    if bad:
        for relpath in bad:
            print(f"MISMATCH {relpath}", file=sys.stderr)
        return _err(f"{len(bad)} of {len(files)} files in {args.store} do not match the manifest: {', '.join(bad)}")
    nbytes = sum(store.manifest.files[f]["size"] for f in files)
    partial = "" if marker is None else f" (a fetched store holding {len(files)} of {len(store.manifest.files)} files)"
    print(f"ok: {len(files)} files, {_human(nbytes)} match the manifest{partial}")
    return 0


def add_fetch_options(p: argparse.ArgumentParser, *, model_help: str, out: bool = False) -> None:
    """`--model`, `--manifest-sha256`, `--trust-first-manifest` and where fetched stores go.

    `--model` itself is added by the caller when it belongs to a group (start: --store | --model);
    `model_help` is None then.
    """
    g = p.add_argument_group("fetching the store from the swarm (/dsd/shard/1)")
    if model_help:
        g.add_argument("--model", default=None, metavar="MODEL_ID", help=model_help)
    g.add_argument("--manifest-sha256", default=None, metavar="HEX", help="sha256 of the model's manifest.json, the trust root every fetched file is checked against (printed by `dsd-node store inspect` on a trusted copy, and announced by the peers)")
    g.add_argument("--trust-first-manifest", action="store_true", help="without --manifest-sha256: trust the manifest most peers announce (its hash is printed; any peer could lie)")
    if out:
        g.add_argument("--out", type=Path, default=None, metavar="DIR", help="store directory to fill (default: under --fetch-dir)")
    g.add_argument("--fetch-dir", type=Path, default=None, metavar="DIR", help="where fetched stores go, as DIR/<model>/<first 16 hex of the manifest sha256> (default ~/.cache/dsd/fetched)")
    g.add_argument("--fetch-peers", type=int, default=8, metavar="N", help="peers to fetch from at once (default 8)")
    g.add_argument("--piece-mib", type=float, default=32.0, metavar="MIB", help="bytes asked of one peer per request; a big file is fetched from several peers in pieces (default 32)")


def fetch_request(args: argparse.Namespace):
    """The fetch options as a FetchRequest; a missing trust root or a bad value exits with one line saying why."""
    from dsd.node.fetch.request import FetchRequest

    if not args.model:
        raise SystemExit("dsd-node: fetching needs --model MODEL_ID (the model id the peers announce)")
    if not args.bootstrap:
        raise SystemExit(f"dsd-node: --model {args.model} fetches from the swarm: give --bootstrap MULTIADDR")
    try:
        return FetchRequest(
            model=args.model, manifest_sha256=args.manifest_sha256, trust_first=args.trust_first_manifest,
            out=getattr(args, "out", None), fetch_root=args.fetch_dir, max_peers=args.fetch_peers,
            piece_bytes=max(1, int(args.piece_mib * 2**20)),
        )
    except ValueError as exc:
        raise SystemExit(f"dsd-node: {exc}") from None


def run_fetch(request, bootstrap: list[str], blocks: str | None, head: bool, *, progress: bool) -> dict:
    """Join the swarm as a head, fetch the files of `blocks` (A:B, `all` or None) and of the head (`head`)
    into a local store; returns the fetch report. FetchError / StoreError / ValueError when it cannot."""
    import trio

    from dsd.node.fetch.fetch import Fetcher
    from dsd.node.fetch.plan import files_for
    from dsd.node.fetch.progress import fetch_progress
    from dsd.node.peer.config import parse_blocks
    from dsd.node.peer.host import head_node

    async def main() -> dict:
        failure: Exception | None = None
        with fetch_progress(f"fetching {request.model}", progress) as on_progress:
            async with head_node(bootstrap) as (node, _legs):
                try:
                    fetcher = Fetcher(node, request, on_progress=on_progress)
                    local = await fetcher.open()
                    layers = local.manifest.num_layers
                    span = None if blocks is None else (0, layers) if blocks == "all" else parse_blocks(blocks, layers)
                    report = await fetcher.fetch(files_for(local.manifest, span, head))
                    report.update(blocks=list(span) if span else None, head=head)
                    return report
                except Exception as exc:  # raised below, outside the node's nursery (not as an exception group)
                    failure = exc
        assert failure is not None
        raise failure

    return trio.run(main)


def fetched_store(args: argparse.Namespace, blocks: str | None = None) -> Path:
    """`--model` in place of `--store`: fetch the head's files (and `blocks`' layers) and return the store path."""
    from dsd.node.fetch.request import FetchError
    from dsd.shard_store import StoreError

    try:
        report = run_fetch(fetch_request(args), args.bootstrap, blocks, True, progress=sys.stderr.isatty())
    except (FetchError, StoreError, ValueError) as exc:
        raise SystemExit(f"dsd-node: fetching {args.model} failed: {exc}") from None
    return Path(report["out"])


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch a span's files (and the head's) from the swarm into a local store, verified; print the report."""
    from dsd.node.fetch.request import FetchError
    from dsd.shard_store import StoreError

    if args.blocks is None and not args.head:
        return _err("say what to fetch: --blocks A:B (or all) and/or --head")
    request = fetch_request(args)
    try:
        report = run_fetch(request, args.bootstrap, args.blocks, args.head,
                           progress=sys.stderr.isatty() and not args.json)
    except (FetchError, StoreError, ValueError) as exc:
        return _err(str(exc))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    peers = report["peers"]
    used = sum(1 for p in peers.values() if p["bytes"])
    print(f"fetched {len(report['fetched_files'])} files ({_human(report['bytes_needed'])}) from {used} peers in "
          f"{report['seconds']:.1f} s ({report['mb_per_s'] or 0:.1f} MB/s); kept {len(report['kept_files'])} already there")
    for peer_id, p in peers.items():
        if p["state"] != "ok":
            print(f"  {p['state']} {peer_id}: {p['reason']}")
    print(f"store {report['out']} (manifest sha256 {report['manifest_sha256']})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `convert` and `store {inspect,verify,fetch}` to the dsd-node parser."""
    p = sub.add_parser("convert", help="import an HF model folder or a GGUF file into a model store")
    p.add_argument("src", type=Path, help="HF model folder (config.json + weights) or a .gguf file")
    p.add_argument("--out", type=Path, required=True, help="store directory to create")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weight dtype of the store")
    p.add_argument("--model-id", default=None, help="model id recorded in the manifest (default: the source name)")
    p.add_argument("--gguf-file", default=None, metavar="NAME", help="GGUF file name inside SRC when SRC is a folder")
    p.add_argument("--weights", choices=["int8", "int4", "q4k"], default=None,
                   help="write a quantized store (default: a float store in --dtype): int8 | int4 from the weights' "
                        "values; q4k from a GGUF, its own 4-bit blocks as they are (int4 groups of 32) and its wider "
                        "tensors int8 (docs/quantization.md)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at --out")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_convert)

    s = sub.add_parser("store", help="inspect or verify a model store")
    ssub = s.add_subparsers(dest="store_command", metavar="ACTION")
    ssub.required = True
    pi = ssub.add_parser("inspect", help="print the manifest summary")
    pi.add_argument("store", type=Path)
    pi.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pi.set_defaults(func=cmd_inspect)
    pq = ssub.add_parser("quantize", help="write a copy of a float store whose layers hold int8 or int4 weights "
                         "(peers serve and fetch it as it is: docs/quantization.md)")
    pq.add_argument("store", type=Path, help="a float store")
    pq.add_argument("out", type=Path, help="the quantized store to write (an empty or new directory)")
    pq.add_argument("--weights", choices=("int8", "int4"), required=True)
    pq.add_argument("--overwrite", action="store_true", help="replace an existing store at OUT")
    pq.add_argument("--json", action="store_true", help="print the summary as JSON")
    pq.set_defaults(func=cmd_quantize)
    pv = ssub.add_parser("verify", help="re-hash every file; exit 1 naming any file that does not match")
    pv.add_argument("store", type=Path)
    pv.set_defaults(func=cmd_verify)
    pf = ssub.add_parser("fetch", help="fetch a span's files (and the head's) from peers into a local store, verified")
    pf.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR", help="a peer of the swarm (repeatable)")
    pf.add_argument("--blocks", default=None, metavar="A:B|all", help="layers whose files to fetch (half-open)")
    pf.add_argument("--head", action="store_true", help="also fetch the head's files (embeddings, final norm, lm_head, tokenizer)")
    pf.add_argument("--json", action="store_true", help="print the fetch report as JSON")
    add_fetch_options(pf, model_help="model id as announced (see `dsd-node store inspect`)", out=True)
    pf.set_defaults(func=cmd_fetch)
