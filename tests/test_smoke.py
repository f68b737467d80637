"""scripts/smoke.py, the operator's post-deploy check, passes against the simulated engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import Server

SMOKE = Path(__file__).resolve().parent.parent / "scripts" / "smoke.py"


def test_smoke_script_passes_against_the_sim(server: Server) -> None:
    r = subprocess.run(
        [sys.executable, str(SMOKE), "--base-url", server.url, "--require-tool-call", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SMOKE OK" in r.stdout
