"""Starting processes from tests: two ranks under torchrun.

Tests reach it through the `torchrun` fixture of tests/conftest.py, which also marks them `ranks` (and so `slow`):
a test cannot start ranks and still land in the fast tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
WORLD = 2


def child_env() -> dict[str, str]:
    """This checkout and tests/support/ first on the children's path, so they import what the test imports."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SUPPORT), os.environ.get("PYTHONPATH", "")])}


def torchrun(script: str | Path, config: dict, out: Path, *extra: str, world: int = WORLD, timeout: float = 240,
             check: bool = True) -> subprocess.CompletedProcess:
    """`script --config <json> --out <out> *extra` at `world` ranks under torch.distributed.run (gloo, standalone);
    check: fail the test with the end of the ranks' stderr unless every rank exited 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script),
           "--config", json.dumps(config), "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


class Shared:
    """Runs launched once for a module and read by several of its tests: `shared(key)` is the folder of key's run,
    launching it (`launch(key, folder)`) the first time it is asked for."""

    def __init__(self, launch: Callable[[Hashable, Path], object], tmp: Any) -> None:
        self.launch, self.tmp, self.folders = launch, tmp, {}

    def __call__(self, key: Hashable) -> Path:
        if key not in self.folders:
            folder = self.tmp.mktemp("-".join(map(str, key)) if isinstance(key, tuple) else str(key))
            self.launch(key, folder)
            self.folders[key] = folder
        return self.folders[key]
