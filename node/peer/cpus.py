"""CPU affinity: pin a process (or the processes it starts) to a set of CPUs, so that one box can play
several machines without the head's drafting and the peers' compute taking turns on the same cores.

Linux only (`os.sched_setaffinity`). A CPU list is written as the kernel writes it: `1`, `1-3`, `0,2-3`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

# The CPUs this process could use before it pinned itself: a head pinned to CPU 0 may still pin its peers to CPU 1.
_AT_START: frozenset[int] = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its affinity now and before it pinned itself (ValueError where the
    platform cannot pin)."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("pinning to CPUs needs Linux (os.sched_setaffinity)")
    return _AT_START | frozenset(os.sched_getaffinity(0))


def format_cpus(cpus: Iterable[int]) -> str:
    """A CPU set in the kernel's list form, ranges collapsed: {0, 1, 2, 5} -> "0-2,5"."""
    parts: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu != run[-1] + 1:
            parts.append(_span(run))
            run = []
        run.append(cpu)
    if run:
        parts.append(_span(run))
    return ",".join(parts)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def check_cpus(cpus: Iterable[int], available: Iterable[int] | None = None) -> frozenset[int]:
    """The set itself when every CPU is one this process may use (default: `available_cpus()`); else ValueError
    naming the missing ones and the available ones."""
    want = frozenset(cpus)
    have = frozenset(available) if available is not None else available_cpus()
    if not want:
        raise ValueError("the CPU list is empty")
    missing = want - have
    if missing:
        many = "s" if len(missing) > 1 else ""
        raise ValueError(f"CPU{many} {format_cpus(missing)} not available here (available: {format_cpus(have)})")
    return want


def parse_cpus(text: str, available: Iterable[int] | None = None) -> frozenset[int]:
    """`1`, `1-3` or `0,2-3` as a set of CPUs, each checked against `available` (default: `available_cpus()`);
    ValueError with one line saying what is wrong."""
    cpus: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected numbers and ranges such as 1, 1-3 or 0,2-3")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"bad CPU list {text!r}: the range {item} runs backwards")
        cpus.update(range(first, last + 1))
    return check_cpus(cpus, available)


def pin_process(cpus: Iterable[int], pid: int | None = None) -> frozenset[int]:
    """Pin every thread of process `pid` (default: this one) to `cpus`, so threads it starts later inherit them
    too; returns the set. Threads that end meanwhile are skipped."""
    want = check_cpus(cpus)
    pid = os.getpid() if pid is None else pid
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # no /proc: the calling thread (pid 0) or the process's main thread
        tids = [0 if pid == os.getpid() else pid]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, want)
    return want


def pin_head(cpus: Iterable[int], threads: int | None = None) -> int:
    """Pin this process (the head) to `cpus` and give torch `threads` threads (default one per CPU); returns
    the number of torch threads set."""
    import torch

    want = pin_process(cpus)
    n = threads or len(want)
    torch.set_num_threads(n)
    return n


def affinity_of(pid: int) -> list[int] | None:
    """The CPUs process `pid` may run on, as the kernel says now (None when it is gone or cannot be asked)."""
    try:
        return sorted(os.sched_getaffinity(pid))
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def children_pinned(cpus: Iterable[int] | None) -> Iterator[None]:
    """While inside, the calling thread runs on `cpus`, so a process it forks or spawns starts pinned to them
    (a child inherits the affinity of the thread that forked it) before it runs a line or starts a thread;
    None: nothing changes."""
    if cpus is None:
        yield
        return
    want = check_cpus(cpus)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, want)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
