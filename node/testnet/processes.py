"""A local multi-peer testnet: a bootstrap node and N block peers as background processes on loopback.

`up` returns once a head can see a complete route; the state directory keeps
`testnet.json` (what runs where), the peers' identity keys and their logs, so
`down` and `status` work from any later shell.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsd.shard_store.files import atomic_write_bytes

log = logging.getLogger(__name__)

STATE_FILE = "testnet.json"


@dataclass
class PeerProcess:
    """One daemon of the testnet."""

    name: str
    pid: int
    log: str
    peer_id: str = ""
    multiaddr: str = ""
    start: int | None = None
    end: int | None = None
    role: str = "block"
    metrics_url: str | None = None  # with `testnet up --metrics`: its Prometheus endpoint


@dataclass
class TestnetState:
    """What `testnet up` started; written to DIR/testnet.json."""

    bootstrap: str
    model: str | None
    store: str | None
    num_layers: int | None
    peers: list[PeerProcess] = field(default_factory=list)
    wan: dict = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    up_seconds: float = 0.0

    def save(self, state_dir: Path) -> None:
        atomic_write_bytes(state_dir / STATE_FILE, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def load(cls, state_dir: Path) -> TestnetState:
        path = state_dir / STATE_FILE
        if not path.exists():
            raise FileNotFoundError(f"no testnet at {state_dir} ({STATE_FILE} is missing); run `dsd-node testnet up` first")
        data = json.loads(path.read_text())
        data["peers"] = [PeerProcess(**p) for p in data.get("peers", [])]
        return cls(**data)


def even_spans(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, num_layers) into `parts` contiguous spans whose sizes differ by at most one."""
    if not 1 <= parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} spans")
    base, extra = divmod(num_layers, parts)
    spans, at = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        spans.append((at, at + size))
        at += size
    return spans


def daemon_command(*args: str) -> list[str]:
    """The command line of a `dsd-node` subprocess using this interpreter."""
    return [sys.executable, "-m", "dsd.node.cli", "-v", *args]


def spawn(name: str, args: list[str], state_dir: Path, env: dict[str, str] | None = None) -> PeerProcess:
    """Start one daemon in its own process group with its log in DIR/logs/NAME.log."""
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            daemon_command(*args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return PeerProcess(name=name, pid=proc.pid, log=str(log_path))


def wait_ready(ready_file: Path, proc: PeerProcess, timeout_s: float) -> dict:
    """Wait for a daemon's ready file; fail early (with its log's tail) if it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists():
            return json.loads(ready_file.read_text())
        if not pid_alive(proc.pid):
            raise RuntimeError(f"{proc.name} exited during start-up; last log lines:\n{tail(proc.log)}")
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f} s; last log lines:\n{tail(proc.log)}")


def tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def pid_alive(pid: int) -> bool:
    """True when the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def is_our_daemon(pid: int) -> bool:
    """Guard against signalling a reused pid: the process must be a dsd daemon."""
    try:
        return b"dsd.node.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def stop_processes(pids: list[int], timeout_s: float = 15.0) -> dict[int, str]:
    """SIGTERM each daemon, SIGKILL what is left after the deadline; returns how each ended."""
    outcome: dict[int, str] = {}
    for pid in pids:
        if pid_alive(pid) and is_our_daemon(pid):
            os.kill(pid, signal.SIGTERM)
            outcome[pid] = "terminated"
        else:
            outcome[pid] = "not running"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in outcome):
        _reap()
        time.sleep(0.1)
    for pid in outcome:
        if pid_alive(pid) and is_our_daemon(pid):
            os.kill(pid, signal.SIGKILL)
            outcome[pid] = "killed"
    _reap()
    return outcome


def _reap() -> None:
    """Collect exited children of this process so they do not linger as zombies."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
