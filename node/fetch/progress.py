"""A rich progress bar for a fetch on stderr: bytes, rate, files and peers; a no-op when not on a terminal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from .request import FetchProgress


@contextmanager
def fetch_progress(description: str, enabled: bool) -> Iterator[Callable[[FetchProgress], None] | None]:
    """Yields an `on_progress` callback for `Fetcher` that draws the bar (None when disabled)."""
    if not enabled:
        yield None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[files]} files, {task.fields[peers]} peers"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(description, total=None, files="0/?", peers=0)

    def update(p: FetchProgress) -> None:
        bar.update(task, completed=p.received, total=p.total or None, files=f"{p.files_done}/{p.files_total}",
                   peers=p.peers)

    with bar:
        yield update
