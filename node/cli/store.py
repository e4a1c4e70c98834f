"""`dsd-node convert` (import a checkpoint into a store) and `dsd-node store inspect|verify`."""

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
            )
        summary = Store(args.out).summary()
    except StoreError as exc:
        return _err(str(exc))
    summary["convert_seconds"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
        print(f"converted in {summary['convert_seconds']:.1f} s")
    return 0


def _print_summary(summary: dict) -> None:
    table = Table(title=f"store {summary['path']}", show_header=False)
    rows = [
        ("model id", summary["model_id"]),
        ("family", summary["family"]),
        ("layers", str(summary["num_layers"])),
        ("hidden size", str(summary["hidden_size"])),
        ("vocab size", str(summary["vocab_size"])),
        ("dtype", summary["dtype"]),
        ("files", str(summary["files"])),
        ("total size", _human(summary["total_bytes"])),
        ("head (embed+norm+lm_head)", _human(summary["head_bytes"])),
        ("tied embeddings", "yes" if summary["tied_embeddings"] else "no"),
        ("tokenizer", "yes" if summary["tokenizer"] else "no (token-id prompts only)"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a store's manifest summary (table, or JSON with --json)."""
    from dsd.shard_store import Store, StoreError

    try:
        summary = Store(args.store).summary()
    except StoreError as exc:
        return _err(str(exc))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every file of a store; exit 1 naming each file that is missing or does not match."""
    from dsd.shard_store import Store, StoreError

    try:
        store = Store(args.store)
        with _progress("hashing", sys.stderr.isatty()) as progress:
            bad = store.verify(progress=progress)
    except StoreError as exc:
        return _err(str(exc))
    if bad:
        for relpath in bad:
            print(f"MISMATCH {relpath}", file=sys.stderr)
        return _err(f"{len(bad)} of {len(store.manifest.files)} files in {args.store} do not match the manifest: {', '.join(bad)}")
    print(f"ok: {len(store.manifest.files)} files, {_human(store.manifest.total_bytes)} match the manifest")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `convert` and `store {inspect,verify}` to the dsd-node parser."""
    p = sub.add_parser("convert", help="import an HF model folder or a GGUF file into a model store")
    p.add_argument("src", type=Path, help="HF model folder (config.json + weights) or a .gguf file")
    p.add_argument("--out", type=Path, required=True, help="store directory to create")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="weight dtype of the store")
    p.add_argument("--model-id", default=None, help="model id recorded in the manifest (default: the source name)")
    p.add_argument("--gguf-file", default=None, metavar="NAME", help="GGUF file name inside SRC when SRC is a folder")
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
    pv = ssub.add_parser("verify", help="re-hash every file; exit 1 naming any file that does not match")
    pv.add_argument("store", type=Path)
    pv.set_defaults(func=cmd_verify)
