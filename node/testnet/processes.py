"""A local multi-peer testnet: a bootstrap node and N block peers as background processes on loopback.

`up` returns once a head can see a complete route; the state directory keeps
`testnet.json` (what runs where), the peers' identity keys and their logs, so
`down` and `status` work from any later shell.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
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
    started: int | None = None  # the kernel's start time of the process (clock ticks): tells it from a reused pid
    fault: str | None = None  # with `testnet up --faulty INDEX:MODE`: how this block peer lies on purpose
    cpus: list[int] | None = None  # the CPUs the kernel let it run on once started (pinned by `--peer-cpus`)
    link: dict | None = None  # the link it sends on: {"profile", "latency_ms", "jitter_ms", "mbit"}

    @classmethod
    def from_dict(cls, d: dict) -> PeerProcess:
        """From its saved or reported form (`testnet.json`, `testnet status --json`; extra keys ignored)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class TestnetState:
    """What `testnet up` started; written to DIR/testnet.json."""

    bootstrap: str
    model: str | None
    store: str | None
    num_layers: int | None
    peers: list[PeerProcess] = field(default_factory=list)
    wan: dict = field(default_factory=dict)  # every daemon's link unless its own says otherwise (a link record)
    peer_cpus: list[int] | None = None  # `--peer-cpus`: what the bootstrap and every peer are pinned to
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
        data["peers"] = [PeerProcess.from_dict(p) for p in data.get("peers", [])]
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


def log_path_of(state_dir: Path, name: str) -> Path:
    """DIR/logs/NAME.log, the daemon's stdout and stderr (its folder created)."""
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"{name}.log"


def spawn(
    name: str, args: list[str], state_dir: Path, env: dict[str, str] | None = None, netns: str | None = None
) -> PeerProcess:
    """Start one daemon in its own process group with its log in DIR/logs/NAME.log (in the network namespace
    `netns`, a machine of a NAT testbed, if given: `ip netns exec` becomes the daemon, so the pid is its own)."""
    log_path = log_path_of(state_dir, name)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            (["ip", "netns", "exec", netns] if netns else []) + daemon_command(*args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return PeerProcess(name=name, pid=proc.pid, log=str(log_path), started=process_start(proc.pid))


def preload_daemon_imports(family_module: str | None = None) -> None:
    """Import what a serving daemon loads (torch, libp2p, the servers, the model family's transformers module),
    so that daemons forked from this process (`fork_daemon`) start without 5-9 s of imports each."""
    import importlib

    for name in ("dsd.node.peer.daemon", "dsd.node.peer.loading", family_module):
        if name:
            importlib.import_module(name)


def fork_daemon(name: str, args: list[str], state_dir: Path, program: Callable[[list[str]], None]) -> PeerProcess:
    """Start one daemon as a fork of this process running `program(["-v", *args])` (the `dsd-node` program,
    which ends the process), in its own session, its log in DIR/logs/NAME.log: `spawn` without the imports
    (see `preload_daemon_imports`). Only from a process that has started no thread, event loop or torch
    computation yet (Linux: a fork copies only the calling thread)."""
    log_path = log_path_of(state_dir, name)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here may reach the child's log
        stream.flush()
    pid = os.fork()
    if pid == 0:
        run_in_child(program, ["-v", *args], log_path, log_path, daemon=True)
    return PeerProcess(name=name, pid=pid, log=str(log_path), started=process_start(pid))


def run_in_child(program: Callable[[list[str]], None], argv: list[str], stdout: Path, stderr: Path, *,
                 daemon: bool) -> None:
    """In a forked child: run `program(argv)` (which ends the process) with stdin from /dev/null and stdout, stderr
    to those files; a daemon in a session of its own, appending to its log. Never returns."""
    code = 1
    try:
        if daemon:
            os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if daemon else os.O_TRUNC)
        for fd, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, mode, 0o644), fd)
        os.closerange(3, 65536)  # nothing of the parent's (its pipes, its sockets) stays open in the child
        program(argv)
    except SystemExit as exc:  # argparse's errors and --help
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


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


def process_start(pid: int) -> int | None:
    """The kernel's start time of process `pid` in clock ticks since boot (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def is_our_daemon(proc: PeerProcess) -> bool:
    """Guard against signalling a reused pid: the process started when ours did (or, for a state written
    without start times, runs dsd-node)."""
    if proc.started is not None:
        return process_start(proc.pid) == proc.started
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"dsd.node.cli" in cmdline or b"dsd-node" in cmdline


def stop_processes(procs: Sequence[PeerProcess | int], timeout_s: float = 15.0) -> dict[int, str]:
    """SIGTERM each daemon, SIGKILL what is left after the deadline; returns how each ended, by pid.
    A bare pid is taken for a daemon started as `dsd-node` (its command line says so)."""
    outcome: dict[int, str] = {}
    ours = {p.pid: p for p in (q if isinstance(q, PeerProcess) else PeerProcess(str(q), q, "") for q in procs)}
    for pid, proc in ours.items():
        if pid_alive(pid) and is_our_daemon(proc):
            os.kill(pid, signal.SIGTERM)
            outcome[pid] = "terminated"
        else:
            outcome[pid] = "not running"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in outcome):
        reap_children()
        time.sleep(0.1)
    for pid in outcome:
        if pid_alive(pid) and is_our_daemon(ours[pid]):
            os.kill(pid, signal.SIGKILL)
            outcome[pid] = "killed"
    reap_children()
    return outcome


def reap_children() -> None:
    """Collect exited children of this process so they do not linger as zombies."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
