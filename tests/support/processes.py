"""The CLI as a user runs it: `dsd-node` commands and daemons as processes of their own (forked from one fork
server that imported torch, transformers and libp2p once), local testnets, `serve`, daemons started one by one."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


class ForkServer:
    """The session's fork server (tests/support/forkserver.py): `dsd-node` commands as processes of their own,
    forked from one interpreter that imported torch, transformers and libp2p once."""

    _session: ForkServer | None = None

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if self.replies.get(timeout=300) != {"ready": True}:
            raise RuntimeError("the fork server did not start (see stderr)")

    @classmethod
    def session(cls) -> ForkServer:
        if cls._session is None or cls._session.proc.poll() is not None:
            cls._session = cls()
        return cls._session

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)

    def run(self, argv: list[str], timeout: float, netns: str | None = None) -> subprocess.CompletedProcess:
        """Run `dsd-node ARGV` in a forked child; its output and exit code, or TimeoutExpired (the child killed)."""
        import tempfile

        assert self.proc.stdin is not None
        cmd = ["dsd-node", *argv]
        with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "stdout": str(out), "stderr": str(err),
                       "daemon": False, "netns": netns}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            started = self.replies.get(timeout=60)
            assert started is not None, "the fork server died"
            try:
                done = self.replies.get(timeout=timeout)
            except queue.Empty:
                os.kill(started["pid"], signal.SIGKILL)
                self.replies.get(timeout=60)
                raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(errors="replace"),
                                                stderr=err.read_text(errors="replace")) from None
            assert done is not None, "the fork server died"
            return subprocess.CompletedProcess(cmd, done["returncode"], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def start(self, name: str, argv: list[str], state: Path, netns: str | None = None):
        """Start the daemon `dsd-node -v ARGV` in a forked child of its own session, its log in STATE/logs/NAME.log
        (`dsd.node.testnet.processes.spawn` without the imports); its process, which `stop_processes` stops."""
        from dsd.node.testnet.processes import PeerProcess, log_path_of, process_start

        assert self.proc.stdin is not None
        log = str(log_path_of(state, name))
        request = {"argv": ["-v", *argv], "cwd": os.getcwd(), "env": dict(os.environ), "stdout": log, "stderr": log,
                   "daemon": True, "netns": netns}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = self.replies.get(timeout=60)
        assert started is not None, "the fork server died"
        return PeerProcess(name=name, pid=started["pid"], log=log, started=process_start(started["pid"]))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def daemon(name: str, args: list[str], state: Path):
    """`dsd-node -v ARGS` as a daemon of its own (`dsd.node.testnet.processes.spawn`, forked from the session's
    fork server): log in STATE/logs/NAME.log; its process, for `wait_ready` and `stop_processes`."""
    return ForkServer.session().start(name, args, state)


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `dsd-node ARGS` in a process of its own, as a user's shell would (forked from the session's
    fork server, so it skips the imports; see tests/support/forkserver.py)."""
    return ForkServer.session().run(list(args), timeout)


@contextlib.contextmanager
def cli_testnet(state: Path, *args: str) -> Iterator[dict]:
    """`dsd-node testnet up --state STATE ARGS --json` for the block; always `testnet down` after it."""
    up = cli("testnet", "up", "--state", str(state), *args, "--json")
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        yield json.loads(up.stdout)
    finally:
        cli("testnet", "down", "--state", str(state), timeout=60)


@contextlib.contextmanager
def cli_serve(state: Path, bootstrap: str, store: Path | None, *args: str) -> Iterator[dict]:
    """`dsd-node serve` on a free port for the block (ready file and log in STATE); yields its ready info + log.
    `store` None: ARGS say where the target comes from (`--model ... --manifest-sha256 ...`)."""
    from dsd.node.testnet.processes import stop_processes, wait_ready

    target = [] if store is None else ["--store", str(store)]
    proc = ForkServer.session().start("serve", ["serve", "--bootstrap", bootstrap, *target, "--port", "0",
                                                "--ready-file", str(state / "serve.json"), "--threads", "1", *args],
                                      state)
    try:
        info = wait_ready(state / "serve.json", proc, 120)
        yield {**info, "log": proc.log}
    finally:
        stop_processes([proc])
        print(f"serve log: {proc.log}")


class DaemonSwarm:
    """`dsd-node start` daemons on loopback: a bootstrap node, then peers added one by one, each with its key,
    ready file and log in `state`; `stop` (or leaving the `with` block) ends them all, the last started first."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.procs: list = []
        self.bootstrap = self.start("bootstrap", "--bootstrap-only")["addrs"][0]

    def __enter__(self) -> DaemonSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, name: str, *args: str):
        """Start `dsd-node start ARGS` as NAME without waiting (`ready` waits): several daemons start at once."""
        proc = ForkServer.session().start(name, ["start", *args, "--identity", str(self.state / f"{name}.key"),
                                                 "--ready-file", str(self.state / f"{name}.json")], self.state)
        self.procs.append(proc)
        return proc

    def ready(self, proc) -> dict:
        """A spawned daemon's ready info (peer_id, addrs, its span...) with its name, pid, start time and log,
        once it serves (`PeerProcess.from_dict` of it is what `stop_processes` takes)."""
        from dsd.node.testnet.processes import wait_ready

        info = wait_ready(self.state / f"{proc.name}.json", proc, 120)
        return {**info, "name": proc.name, "pid": proc.pid, "started": proc.started, "log": proc.log}

    def start(self, name: str, *args: str) -> dict:
        return self.ready(self.spawn(name, *args))

    def peer(self, name: str, store: Path, blocks: str, *args: str) -> dict:
        """A block peer serving `blocks` of `store` (one torch thread), joined through the bootstrap node; its
        ready info, pid, log and the bootstrap address."""
        info = self.start(name, "--store", str(store), "--blocks", blocks, "--bootstrap", self.bootstrap,
                          "--threads", "1", *args)
        return {**info, "bootstrap": self.bootstrap}

    def wait_route(self, model: str, num_layers: int, blocks: tuple[int, int] | None = None) -> None:
        """Until the peers announce a complete route over `blocks` (default every layer)."""
        import trio

        from dsd.discovery.survey import wait_for_route
        from dsd.node.peer.host import head_node

        async def main() -> None:
            async with head_node([self.bootstrap]) as (node, _legs):
                await wait_for_route(node, model, num_layers, 60, poll_s=0.3, blocks=blocks)

        trio.run(main)

    def stop(self) -> None:
        from dsd.node.testnet.processes import stop_processes

        stop_processes(list(reversed(self.procs)))
