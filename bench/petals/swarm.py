"""A local Petals swarm for the Petals venv's scripts: servers on loopback inside a network namespace, always stopped.

Hivemind turns on NAT port mapping and, without a private swarm, dials public bootstrap peers, so everything runs in
a network namespace whose only interface is loopback (`run_isolated` re-runs the calling script there).
Imported by scripts of this folder that run with the Petals venv's python (see bench/petals/README.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ISOLATED_FLAG = "--isolated"  # set on the re-run inside the namespace
BASE_PORT = 31330
PROXY_PORT_OFFSET = 100  # server i listens on BASE_PORT + i, its delay proxy on BASE_PORT + 100 + i
DELAY_PROXY = Path(__file__).resolve().parent / "delay_proxy.py"
PUSH_FIX = Path(__file__).resolve().parent / "push_fix.py"


def isolated_argv(argv: Sequence[str] | None) -> tuple[bool, list[str]]:
    """(whether this is the re-run inside the namespace, the arguments without the flag that says so)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return ISOLATED_FLAG in args, [a for a in args if a != ISOLATED_FLAG]


def run_isolated(script: str, argv: Sequence[str]) -> int:
    """Re-run `script argv` with this python in a fresh network namespace that has only loopback; its exit code."""
    unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--net", "--map-root-user"]
    return subprocess.run([*unshare, "--", sys.executable, script, ISOLATED_FLAG, *argv]).returncode


def bring_up_loopback() -> None:
    """Inside the namespace: set loopback up and check it is the only interface (nothing can leave the machine)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    others = sorted({line.split(":")[1].strip() for line in links.splitlines()} - {"lo"})
    if others:
        raise RuntimeError(f"not an isolated namespace: interfaces {others} besides lo")


def split_blocks(num_layers: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal spans of the layers, one per server."""
    cuts = [round(i * num_layers / servers) for i in range(servers + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(servers)]


@dataclass
class PetalsSwarm:
    """Petals servers of `model_dir` on loopback, one per span; `__enter__` returns once every block is online."""

    model_dir: Path
    spans: list[tuple[int, int]]
    log_dir: Path
    dht_prefix: str = "dsd-petals"
    timeout_s: float = 300.0
    delay_ms: float = 0.0  # > 0: a delay proxy in front of every server, which announces the proxy's address
    threads: int = 1
    push_fix: bool = False  # start servers through push_fix.py (server-to-server push as on Petals' main branch)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    maddrs: list[str] = field(default_factory=list)
    proxy: subprocess.Popen[str] | None = None

    def _start_proxies(self) -> None:
        """One delay proxy process for all servers (each direction of each link delayed by delay_ms)."""
        maps = [arg for i in range(len(self.spans)) for arg in (
            "--map", f"127.0.0.1:{BASE_PORT + PROXY_PORT_OFFSET + i}=127.0.0.1:{BASE_PORT + i}")]
        self.proxy = subprocess.Popen([sys.executable, str(DELAY_PROXY), "serve", "--delay-ms", str(self.delay_ms),
                                       *maps], stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proxy.stdout is not None
        if not self.proxy.stdout.readline():
            raise RuntimeError(f"the delay proxy exited with {self.proxy.wait()}")

    def _start(self, index: int, start: int, end: int) -> str:
        """Start server `index` for blocks [start, end) and return its first visible maddr from its log."""
        port = BASE_PORT + index
        peers = ["--initial_peers", self.maddrs[0]] if self.maddrs else ["--new_swarm"]
        proxy_port = BASE_PORT + PROXY_PORT_OFFSET + index
        announce = ["--announce_maddrs", f"/ip4/127.0.0.1/tcp/{proxy_port}"] if self.delay_ms > 0 else []
        entry = [str(PUSH_FIX)] if self.push_fix else ["-m", "petals.cli.run_server"]
        argv = [sys.executable, *entry, str(self.model_dir), *peers, "--block_indices",
                f"{start}:{end}", "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}", *announce, "--dht_prefix",
                self.dht_prefix, "--throughput", "1.0", "--device", "cpu", "--torch_dtype", "float32",
                "--no_auto_relay", "--skip_reachability_check"]
        log = self.log_dir / f"server{index}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        with log.open("wb") as out:
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"Running a server on \[([^\]]*)\]", log.read_text(errors="replace"))
            if found:
                return found.group(1).split(",")[0].strip().strip("'\"")
            self._check_alive()
            time.sleep(0.2)
        raise TimeoutError(f"server {index} printed no address within {self.timeout_s} s: {self.tail(index)}")

    def _check_alive(self) -> None:
        """Raise with the log tail when a server has exited."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise RuntimeError(f"Petals server {i} exited with {proc.returncode}: {self.tail(i)}")

    def tail(self, index: int, lines: int = 25) -> str:
        """The last lines of server `index`'s log."""
        text = (self.log_dir / f"server{index}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_online(self) -> None:
        """Poll the swarm's DHT until each block has an ONLINE server (servers load weights after announcing)."""
        from hivemind import DHT
        from petals.data_structures import UID_DELIMITER, ServerState
        from petals.utils.dht import get_remote_module_infos

        uids = [f"{self.dht_prefix}{UID_DELIMITER}{i}" for i in range(self.spans[0][0], self.spans[-1][1])]
        dht = DHT(initial_peers=[self.maddrs[0]], client_mode=True, start=True)
        try:
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                infos = get_remote_module_infos(dht, uids, latest=True)
                if all(any(s.state == ServerState.ONLINE for s in m.servers.values()) for m in infos):
                    return
                self._check_alive()
                time.sleep(0.5)
            raise TimeoutError(f"blocks not all online within {self.timeout_s} s")
        finally:
            dht.shutdown()

    def __enter__(self) -> PetalsSwarm:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.delay_ms > 0:
                self._start_proxies()
            for i, (start, end) in enumerate(self.spans):
                self.maddrs.append(self._start(i, start, end))
            self.wait_online()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate every server's process group (its p2pd and workers too; killed after 20 s)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait()

    def client(self, torch_dtype: Any = None) -> Any:
        """A Petals client model of `model_dir` on this swarm (float32 unless told)."""
        import torch
        from petals import AutoDistributedModelForCausalLM

        return AutoDistributedModelForCausalLM.from_pretrained(
            str(self.model_dir), initial_peers=[self.maddrs[0]], dht_prefix=self.dht_prefix,
            torch_dtype=torch_dtype or torch.float32)
