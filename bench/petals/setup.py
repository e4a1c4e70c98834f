"""Build Petals 2.2's own virtualenv (outside dsd's environment and outside git) from the package registry only.

Petals 2.2.0.post1 does not install as is on this Python/torch: its pinned hivemind 1.1.10.post2 ships only as a
source archive whose setup.py downloads the `p2pd` Go binary from the internet and imports `pkg_resources`; torch
2.13 moved a private import hivemind 1.1.10 uses; and several pins are not enforced by pip. The steps below apply
the workarounds of `bench/petals/README.md`. Run with the system python3 (3.11):

    python3 bench/petals/setup.py                 # venv at $DSD_PETALS_VENV or ~/.cache/dsd/petals-venv
    python3 bench/petals/setup.py --venv DIR      # elsewhere
    python3 bench/petals/setup.py --force         # rebuild (the venv is deleted first)

A second run finds the marker file the first one wrote (`dsd-petals.json` in the venv: what was installed) and
exits at once. A failed step is named with the reason and the tail of its log; the logs stay in `<venv>/logs/`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

PETALS = "petals==2.2.0.post1"
HIVEMIND = "1.1.10.post2"  # what petals 2.2.0.post1 pins: published as a source archive only
HIVEMIND_P2PD_DONOR = "1.1.12"  # its manylinux x86_64 wheel carries a linux p2pd (1.1.11's is a macOS binary)
PINS = ["transformers==4.34.1", "accelerate==0.24.1", "multiaddr==0.0.9", "numpy<2"]
BUILD_TOOLS = ["setuptools<81", "wheel", "grpcio-tools"]  # hivemind's setup.py needs pkg_resources, grpc_tools
DEFAULT_TORCH = "torch==2.13.0"  # the CPU build on this machine's registry; unpinned torch pulls a CUDA build
MARKER = "dsd-petals.json"
RECIPE_VERSION = 1  # bump when the steps change: an older marker then no longer counts as complete
GRAD_SCALER_OLD = "from torch.cuda.amp.grad_scaler import OptState, _refresh_per_optimizer_state\n"
GRAD_SCALER_NEW = (
    "try:  # torch >= 2.3 (dsd bench/petals/setup.py: what hivemind 1.1.12 does)\n"
    "    from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state\n"
    "except ImportError:\n"
    "    " + GRAD_SCALER_OLD
)


class StepFailed(Exception):
    """A setup step that could not be done, with the reason in words."""


def default_venv() -> Path:
    """$DSD_PETALS_VENV, else ~/.cache/dsd/petals-venv."""
    env = os.environ.get("DSD_PETALS_VENV")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dsd" / "petals-venv"


def recipe(torch_spec: str) -> dict[str, Any]:
    """What this script installs, as recorded in the marker; a marker with another recipe is not complete."""
    return {"version": RECIPE_VERSION, "petals": PETALS, "hivemind": HIVEMIND, "p2pd_from": HIVEMIND_P2PD_DONOR,
            "pins": PINS, "torch": torch_spec, "build_tools": BUILD_TOOLS}


class Setup:
    """The steps, each logged to its own file under <venv>/logs and named when it fails."""

    def __init__(self, venv: Path, torch_spec: str) -> None:
        self.venv, self.torch_spec = venv, torch_spec
        self.python = venv / "bin" / "python"
        self.logs = venv / "logs"

    def run(self, step: str, argv: list[str], cwd: Path | None = None) -> str:
        """Run one command of `step`, its output to logs/<step>.log; raise StepFailed with the reason on failure."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{step}.log"
        started = time.monotonic()
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n{out.stdout}{out.stderr}\n[exit {out.returncode}]\n")
        if out.returncode != 0:
            raise StepFailed(f"{' '.join(argv[:6])}... exited {out.returncode}: {pip_reason(out.stdout + out.stderr)}"
                             f"\n--- last lines of {log} ---\n{tail(out.stdout + out.stderr)}")
        print(f"  {step}: ok ({time.monotonic() - started:.0f} s)", flush=True)
        return out.stdout

    def pip(self, step: str, *args: str, cwd: Path | None = None) -> str:
        """The venv's pip (quiet about the version check)."""
        return self.run(step, [str(self.python), "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd)

    def create_venv(self) -> None:
        """A fresh venv with the build tools hivemind's setup.py needs (no build isolation: it imports them)."""
        if not self.python.exists():
            self.run("venv", [sys.executable, "-m", "venv", str(self.venv)])
        self.pip("build-tools", "install", *BUILD_TOOLS)

    def install_torch(self) -> None:
        """Torch first and alone, so nothing later resolves it to another (CUDA) build."""
        self.pip("torch", "install", self.torch_spec)

    def p2pd_from_wheel(self, work: Path) -> Path:
        """The linux x86_64 p2pd binary of the hivemind donor wheel (checked to be an x86-64 ELF executable)."""
        self.pip("download-p2pd", "download", "--no-deps", "--only-binary", ":all:", "--platform",
                 "manylinux2014_x86_64", f"hivemind=={HIVEMIND_P2PD_DONOR}", "-d", str(work / "donor"))
        wheels = list((work / "donor").glob(f"hivemind-{HIVEMIND_P2PD_DONOR}-*manylinux*x86_64*.whl"))
        if not wheels:
            raise StepFailed(f"the registry gave no manylinux x86_64 wheel of hivemind {HIVEMIND_P2PD_DONOR}")
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                data = z.read("hivemind/hivemind_cli/p2pd")
            except KeyError as exc:
                raise StepFailed(f"{wheels[0].name} has no hivemind/hivemind_cli/p2pd") from exc
        if data[:4] != b"\x7fELF" or int.from_bytes(data[18:20], "little") != 0x3E:
            raise StepFailed(f"the p2pd of {wheels[0].name} is not a linux x86-64 executable")
        binary = work / "p2pd"
        binary.write_bytes(data)
        binary.chmod(0o755)
        return binary

    def hivemind_wheel(self, work: Path, p2pd: Path) -> Path:
        """hivemind 1.1.10.post2 built from its source archive with the donor p2pd and the torch.amp import fix."""
        self.pip("download-hivemind", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
                 f"hivemind=={HIVEMIND}", "-d", str(work / "sdist"))
        archives = list((work / "sdist").glob(f"hivemind-{HIVEMIND}.tar.gz"))
        if not archives:
            raise StepFailed(f"the registry gave no source archive of hivemind {HIVEMIND}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(work / "sdist", filter="data")
        src = work / "sdist" / f"hivemind-{HIVEMIND}"
        shutil.copy2(p2pd, src / "hivemind" / "hivemind_cli" / "p2pd")
        digest = hashlib.sha256(p2pd.read_bytes()).hexdigest()
        setup_py = src / "setup.py"
        text, n = re.subn(r'("p2pd-linux-amd64":\s*")[0-9a-f]{64}(")', rf"\g<1>{digest}\g<2>", setup_py.read_text())
        if n != 1:
            raise StepFailed(f"hivemind {HIVEMIND} setup.py: found {n} linux-amd64 p2pd hashes, expected one")
        setup_py.write_text(text)
        scaler = src / "hivemind" / "optim" / "grad_scaler.py"
        code = scaler.read_text()
        if GRAD_SCALER_OLD not in code:
            raise StepFailed(f"hivemind {HIVEMIND} grad_scaler.py: the torch.cuda.amp import to fix is not there")
        scaler.write_text(code.replace(GRAD_SCALER_OLD, GRAD_SCALER_NEW))
        self.pip("build-hivemind", "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(src))
        built = list((work / "dist").glob(f"hivemind-{HIVEMIND}-*.whl"))
        if not built:
            raise StepFailed("pip wheel finished but left no hivemind wheel")
        return built[0]

    def install_petals(self, hivemind: Path, work: Path) -> None:
        """Petals with the local hivemind wheel and the pins pip does not enforce, torch held where it is."""
        constraints = work / "constraints.txt"
        constraints.write_text("\n".join([self.torch_spec, f"hivemind=={HIVEMIND}", *PINS]) + "\n")
        self.pip("install-petals", "install", "-c", str(constraints), str(hivemind), PETALS, *PINS)

    def check(self) -> dict[str, Any]:
        """Import petals in the venv and run its p2pd: the versions installed, or StepFailed."""
        probe = (
            "import json, os, subprocess, hivemind, petals, torch, transformers, accelerate, multiaddr, numpy\n"
            "p2pd = os.path.join(os.path.dirname(hivemind.__file__), 'hivemind_cli', 'p2pd')\n"
            "out = subprocess.run([p2pd, '-h'], capture_output=True, text=True)\n"
            "assert 'listen' in out.stdout + out.stderr, 'p2pd -h printed no usage'\n"
            "print(json.dumps({'petals': petals.__version__, 'hivemind': hivemind.__version__,\n"
            "  'torch': torch.__version__, 'torch_cuda': torch.version.cuda, 'transformers': transformers.__version__,\n"
            "  'accelerate': accelerate.__version__, 'numpy': numpy.__version__,\n"
            "  'multiaddr': __import__('importlib.metadata').metadata.version('multiaddr'),\n"
            "  'p2pd_sha256': __import__('hashlib').sha256(open(p2pd, 'rb').read()).hexdigest()}))\n"
        )
        versions = json.loads(self.run("check", [str(self.python), "-c", probe]).strip().splitlines()[-1])
        want = {"petals": PETALS.split("==")[1], "hivemind": HIVEMIND, "transformers": "4.34.1", "accelerate": "0.24.1",
                "multiaddr": "0.0.9"}
        wrong = {k: versions[k] for k, v in want.items() if versions[k] != v}
        if wrong or not versions["numpy"].startswith("1."):
            raise StepFailed(f"installed versions differ from the pins: {wrong or versions['numpy']}")
        if versions["torch_cuda"] is not None:
            print(f"  note: torch {versions['torch']} is a CUDA build (CUDA {versions['torch_cuda']})", flush=True)
        return versions


def pip_reason(output: str) -> str:
    """The line of pip's output that says why it failed, in words when the registry lacks something."""
    missing = re.search(r"No matching distribution found for (\S+)", output)
    if missing:
        return f"the package registry has no {missing.group(1)} for this platform/Python"
    for pattern in (r"ERROR: .*", r"\w*Error: .*", r"error: .*"):
        found = re.findall(pattern, output)
        if found:
            return found[0].strip()
    return "see the log"


def tail(text: str, lines: int = 15) -> str:
    """The last `lines` lines of a command's output, without pip's ignored-location warnings."""
    kept = [ln for ln in text.splitlines() if "is ignored: it is neither a file nor a directory" not in ln]
    return "\n".join(kept[-lines:])


def complete(venv: Path, torch_spec: str) -> dict[str, Any] | None:
    """The marker of a finished setup with this recipe and a python still there, else None."""
    try:
        marker = json.loads((venv / MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = marker.get("recipe") == recipe(torch_spec) and (venv / "bin" / "python").exists()
    return marker if ok else None


def main(argv: list[str] | None = None) -> int:
    """Parse options, skip a complete venv, else run the steps and write the marker."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", type=Path, default=default_venv(), help="where (default $DSD_PETALS_VENV or "
                   "~/.cache/dsd/petals-venv)")
    p.add_argument("--torch", default=DEFAULT_TORCH, help="torch requirement (default %(default)s: a CPU build here)")
    p.add_argument("--force", action="store_true", help="delete the venv and build it again")
    args = p.parse_args(argv)
    venv: Path = args.venv.expanduser().absolute()
    if args.force and venv.exists():
        shutil.rmtree(venv)
    marker = complete(venv, args.torch)
    if marker is not None:
        print(f"Petals venv is complete: {venv} (petals {marker['installed']['petals']}, "
              f"torch {marker['installed']['torch']}; --force rebuilds)")
        return 0
    print(f"Building the Petals venv in {venv}", flush=True)
    setup = Setup(venv, args.torch)
    step = "start"
    try:
        with tempfile.TemporaryDirectory(prefix="dsd-petals-build-") as tmp:
            work = Path(tmp)
            step = "venv and build tools"
            setup.create_venv()
            step = "torch"
            setup.install_torch()
            step = f"p2pd from the hivemind {HIVEMIND_P2PD_DONOR} wheel"
            p2pd = setup.p2pd_from_wheel(work)
            step = f"hivemind {HIVEMIND} wheel"
            wheel = setup.hivemind_wheel(work, p2pd)
            step = "petals and pins"
            setup.install_petals(wheel, work)
            step = "import check"
            installed = setup.check()
    except StepFailed as exc:
        print(f"FAILED at step '{step}': {exc}", file=sys.stderr)
        return 1
    freeze = setup.pip("freeze", "freeze").split()
    (venv / MARKER).write_text(json.dumps({"recipe": recipe(args.torch), "installed": installed, "freeze": freeze,
                                           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
    print(f"Petals venv ready: {venv}/bin/python ({json.dumps(installed)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
