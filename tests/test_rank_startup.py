"""A rank process maps every shared file before it reports READY: the launcher unlinks them all as soon as every
rank is ready, so a file opened after that is gone (a lockstep rank then died at start-up, now and then)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

from deepinfer_server import _native
from deepinfer_server.launcher import BUNDLED_TOKENIZER

# The rank's main() with the launcher at its fastest: every shared file is unlinked the moment READY is written.
RANK_WITH_AN_EAGER_LAUNCHER = """
import json, os, sys, types
from deepinfer_server import _native
from deepinfer_server.engine import rank

conf = json.loads(sys.argv[1])
shared = [conf[k] for k in ("request_ring", "output_ring", "lockstep", "doorbell")]


class UnlinkOnReady:
    def __init__(self, ring):
        self.ring = ring

    def __getattr__(self, name):
        return getattr(self.ring, name)

    def set_aux(self, i, v):
        self.ring.set_aux(i, v)
        if i == _native.AUX_STATE and v == _native.STATE_READY:
            for path in shared:
                os.unlink(path)


class Ring:
    @staticmethod
    def open(path):
        ring = _native.Ring.open(path)
        return UnlinkOnReady(ring) if path == conf["output_ring"] else ring


rank._native = types.SimpleNamespace(**{**{k: getattr(_native, k) for k in dir(_native)}, "Ring": Ring})
sys.exit(rank.main(["--config", sys.argv[1]]))
"""


def test_a_lockstep_rank_maps_every_shared_file_before_it_reports_ready(ring_path: Callable[[], str]) -> None:
    paths = {k: ring_path() for k in ("request_ring", "output_ring", "lockstep", "doorbell")}
    requests = _native.Ring.create(paths["request_ring"], 1 << 20)
    outputs = _native.Ring.create(paths["output_ring"], 1 << 20)
    lock = _native.Lockstep.create(paths["lockstep"], 1)
    bell = _native.Doorbell.create(paths["doorbell"])
    conf = {
        "rank": 0,
        "engine": "sim",
        "parent_pid": os.getpid(),
        "log_level": "warning",
        "engine_config": {
            "tokenizer_path": str(BUNDLED_TOKENIZER),
            "max_model_len": 4096,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 4096,
        },
        **paths,
    }
    cmd = [sys.executable, "-c", RANK_WITH_AN_EAGER_LAUNCHER, json.dumps(conf)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while outputs.aux(_native.AUX_STATE) != _native.STATE_READY and proc.poll() is None:
            assert time.monotonic() < deadline, "the rank never became ready"
            time.sleep(0.01)
        # Still served through the unlinked files.
        requests.push_submit(_native.SubmitInput(request_id=1, prompt=[100, 101, 102], max_tokens=3, ignore_eos=True))
        bell.ring()
        assert outputs.wait(10.0), f"no output; the rank exited with {proc.poll()}"
        got = outputs.drain_tokens()
        while sum(len(o.tokens) for o in got) < 3:
            assert outputs.wait(10.0), got
            got += outputs.drain_tokens()
        assert got[-1].finish == _native.FINISH_LENGTH
        requests.push_shutdown()
        bell.ring()
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
        lock.close()
