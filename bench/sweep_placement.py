"""Where a sweep's processes run: with `--pin-head`, the head on the first CPU and the testnet (bootstrap and
peers) on the others, so the head drafts on a core of its own as it would on its own machine; a `-shared` mode
re-pins everything to every CPU for its run (the old, one-box placement), so the effect of pinning is paired
per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sweep_model import SHARED

from dsd.node.peer.cpus import affinity_of, available_cpus, format_cpus, pin_process


@dataclass
class Placement:
    """The head's CPUs and the testnet's when pinned (None: nobody is pinned), every CPU, and the testnet's pids."""

    head: frozenset[int] | None = None
    peers: frozenset[int] | None = None
    every: frozenset[int] = field(default_factory=frozenset)
    pids: list[int] = field(default_factory=list)

    @classmethod
    def plan(cls, pin_head: bool) -> Placement:
        """The first available CPU for the head and the rest for the testnet (`pin_head`), or no pinning;
        SystemExit on a machine with one CPU."""
        every = available_cpus()
        if not pin_head:
            return cls(every=every)
        if len(every) < 2:
            raise SystemExit(f"--pin-head needs two CPUs or more; this process may use {format_cpus(every)}")
        head = frozenset({min(every)})
        return cls(head=head, peers=every - head, every=every)

    def pin_head(self) -> None:
        """Pin this process (the head) to its CPU, when pinning; threads it starts later inherit it."""
        if self.head is not None:
            pin_process(self.head)

    def record(self) -> dict[str, Any]:
        """How a setting records its placement (shown with its machine in every table)."""
        if self.head is None or self.peers is None:
            return {"pin_head": False, "cpus": format_cpus(self.every)}
        return {"pin_head": True, "head_cpus": format_cpus(self.head), "peer_cpus": format_cpus(self.peers)}

    def apply(self, mode: str) -> dict[str, Any] | None:
        """Pin the head and the testnet for one run of `mode` (a `-shared` mode: everyone on every CPU); returns
        the affinities the kernel reports after pinning, recorded with the run (None: nothing is pinned)."""
        if self.head is None or self.peers is None:
            return None
        shared = mode.endswith(SHARED)
        pin_process(self.every if shared else self.head)
        for pid in self.pids:
            pin_process(self.every if shared else self.peers, pid)
        seen = {format_cpus(c) for pid in self.pids if (c := affinity_of(pid)) is not None}
        return {"head": format_cpus(affinity_of(0) or []), "testnet": sorted(seen)}
