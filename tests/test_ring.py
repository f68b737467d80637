"""Tests of the shared-memory ring bindings (deepinfer_server._native.Ring)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from deepinfer_server._native import (
    FINISH_ERROR,
    FINISH_NONE,
    FINISH_STOP,
    Output,
    Ring,
    RingClosed,
    RingError,
    SubmitImages,
    SubmitInput,
)
from ring_records import drained


def test_create_open_errors(ring_path) -> None:
    p = ring_path()
    with pytest.raises(ValueError):
        Ring.create(p, 1000)
    r = Ring.create(p, 4096)
    assert r.capacity == 4096 and r.used_bytes == 0 and not r.closed
    with pytest.raises(FileExistsError):
        Ring.create(p, 4096)
    with pytest.raises(FileNotFoundError):
        Ring.open(ring_path())
    r.set_aux(15, 2**64 - 1)
    assert Ring.open(p).aux(15) == 2**64 - 1
    with pytest.raises(IndexError):
        r.aux(16)


def test_request_round_trip(ring_path) -> None:
    p = ring_path()
    prod = Ring.create(p, 1 << 16)
    cons = Ring.open(p)
    s = SubmitInput
    prod.push_submit(
        s(
            request_id=7,
            prompt=[1, 2, 3, 2**32 - 1],
            max_tokens=128,
            temperature=0.7,
            top_p=0.95,
            top_k=40,
            seed=1234,
            ignore_eos=True,
        )
    )
    two = (5).to_bytes(4, "little") + (6).to_bytes(4, "little")
    prod.push_submit(s(request_id=8, prompt=two, max_tokens=16, temperature=0.0, top_p=1.0, top_k=-1))
    prod.push_submit(s(request_id=9, prompt=[], max_tokens=1))
    prod.push_submit(s(request_id=11, prompt=[4, 5], max_tokens=1, logprobs=2, prompt_logprobs=True))
    prod.push_abort(7)
    prod.push_shutdown()
    assert prod.used_bytes > 0
    assert cons.wait(0)
    got = drained(cons)
    assert got == [
        (1, 7, [1, 2, 3, 2**32 - 1], 128, 0.7, 0.95, 40, 1234, True, (None, False), None, None),
        (1, 8, [5, 6], 16, 0.0, 1.0, -1, None, False, (None, False), None, None),
        (1, 9, [], 1, 1.0, 1.0, -1, None, False, (None, False), None, None),
        (1, 11, [4, 5], 1, 1.0, 1.0, -1, None, False, (2, True), None, None),
        (2, 7),
        (3,),
    ]
    assert cons.drain_requests() == []
    # A request's images travel as a file name and sizes, never their bytes.
    pics = SubmitImages(
        path="/dev/shm/deepinfer-x-media/chatcmpl-1", extra_tokens=650, sizes=[(1036, 1036, 2006), (8, 9, 10)]
    )
    prod.push_submit(s(request_id=10, prompt=[129264, 5, 129264], max_tokens=4, images=pics))
    (got_images,) = drained(cons)
    assert got_images[-1] == (pics.path, 650, [[1036, 1036, 2006], [8, 9, 10]]) and got_images[2] == [129264, 5, 129264]
    assert prod.used_bytes == 0
    with pytest.raises(ValueError):
        s(request_id=1, prompt=b"abc", max_tokens=1)
    with pytest.raises(OverflowError):
        s(request_id=1, prompt=[-1], max_tokens=1)


def test_tokens_round_trip(ring_path) -> None:
    p = ring_path()
    prod = Ring.create(p, 1 << 16)
    cons = Ring.open(p)
    o = Output
    prod.publish([o(request_id=1, tokens=[10, 11], finish=FINISH_NONE), o(request_id=2, tokens=[], finish=FINISH_STOP)])
    prod.publish([o(request_id=4, tokens=[1], finish=FINISH_ERROR, reason="engine exploded: ü")])
    prod.publish([o(request_id=5, tokens=[], finish=FINISH_ERROR)])
    prod.publish([])
    prod.publish([o(request_id=6, tokens=(7, 8), finish=FINISH_NONE)])  # any sequence of IDs, not only lists
    prod.publish([o(request_id=8, tokens=12, finish=FINISH_STOP)])  # or one token as an int (the sim's step)
    assert cons.drain_tokens() == [
        o(request_id=1, tokens=[10, 11], finish=FINISH_NONE),
        o(request_id=2, tokens=[], finish=FINISH_STOP),
        o(request_id=4, tokens=[1], finish=FINISH_ERROR, reason="engine exploded: ü"),
        o(request_id=5, tokens=[], finish=FINISH_ERROR, reason=""),
        o(request_id=6, tokens=[7, 8], finish=FINISH_NONE),
        o(request_id=8, tokens=[12], finish=FINISH_STOP),
    ]
    # The prompt's logprobs ride on a first token, with or without the tokens' own.
    first = o(request_id=10, tokens=[3], finish=FINISH_NONE, prompt_logprobs=[-0.5, -2.25])
    both = o(request_id=11, tokens=[4], finish=FINISH_STOP, logprobs=[(-1.0, [])], prompt_logprobs=[])
    prod.publish([first, both])
    assert cons.drain_tokens() == [first, both]
    with pytest.raises(ValueError):
        o(request_id=1, tokens=[1], finish=99)
    with pytest.raises(TypeError):
        o(request_id=1, tokens=[1])  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        o(request_id=1, tokens="12", finish=FINISH_NONE)  # type: ignore[arg-type]  # neither a token nor tokens
    with pytest.raises(TypeError):
        prod.publish([(1, [1], FINISH_NONE)])  # type: ignore[list-item]  # a tuple is no Output
    with pytest.raises(RingError):
        prod.publish([o(request_id=1, tokens=list(range(20000)), finish=FINISH_NONE)])
    # Requests on an output ring are malformed data, not a crash.
    prod.push_abort(3)
    with pytest.raises(RingError):
        cons.drain_tokens()


def test_wraparound_through_python(ring_path) -> None:
    p = ring_path()
    prod = Ring.create(p, 4096)
    cons = Ring.open(p)
    expected: list[tuple] = []
    got: list[Output] = []
    for i in range(3000):
        entries = [Output(request_id=i * 10 + j, tokens=list(range(i % 23 + j)), finish=j % 3) for j in range(i % 5)]
        while True:
            try:
                prod.publish(entries, timeout=0)
                break
            except TimeoutError:
                got.extend(cons.drain_tokens(max_bytes=1000))
        expected.extend(entries)
    got.extend(cons.drain_tokens())
    assert got == expected


def test_full_ring_blocks_publish_until_drained(ring_path) -> None:
    p = ring_path()
    prod = Ring.create(p, 4096)
    cons = Ring.open(p)
    big = [Output(request_id=1, tokens=list(range(400)), finish=FINISH_NONE)]  # ~1.6 KiB per record
    prod.publish(big)
    prod.publish(big)
    with pytest.raises(TimeoutError):
        prod.publish(big, timeout=0.05)

    done = threading.Event()

    def blocked_publish() -> None:
        prod.publish(big)  # blocks with the GIL released
        done.set()

    t = threading.Thread(target=blocked_publish)
    t.start()
    assert not done.wait(0.2)  # still blocked; the main thread runs meanwhile
    assert len(cons.drain_tokens()) == 2
    assert done.wait(5)
    t.join()
    assert len(cons.drain_tokens()) == 1

    # Closing wakes a blocked publisher with RingClosed.
    prod.publish(big)
    prod.publish(big)
    errors: list[BaseException] = []

    def publish_until_closed() -> None:
        try:
            prod.publish(big)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=publish_until_closed)
    t.start()
    time.sleep(0.1)
    cons.close()
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RingClosed)
    assert prod.closed
    with pytest.raises(RingClosed):
        prod.push_shutdown()


def test_wait_timeout_then_data(ring_path) -> None:
    p = ring_path()
    prod = Ring.create(p, 4096)
    cons = Ring.open(p)
    t0 = time.monotonic()
    assert cons.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    timer = threading.Timer(0.1, prod.push_abort, args=(42,))
    timer.start()
    t0 = time.monotonic()
    assert cons.wait(5.0) is True
    assert time.monotonic() - t0 < 4
    timer.join()
    assert drained(cons) == [(2, 42)]
    # A closed ring is always "readable".
    prod.close()
    assert cons.wait(None) is True


CHILD_ECHO = textwrap.dedent(
    """
    import sys
    from deepinfer_server._native import Abort, Output, Ring, Shutdown, FINISH_STOP
    req = Ring.open(sys.argv[1])
    out = Ring.open(sys.argv[2])
    out.set_aux(0, 1)  # tell the parent both rings are open
    while True:
        req.wait(10.0)
        batch = []
        stop = False
        for r in req.drain_requests():
            if isinstance(r, Shutdown):
                stop = True
            elif isinstance(r, Abort):
                batch.append(Output(request_id=r.request_id, tokens=[], finish=3))
            else:
                echo = [r.max_tokens, r.top_k & 0xFFFFFFFF, r.seed or 0, int(r.ignore_eos)]
                batch.append(Output(request_id=r.request_id, tokens=r.prompt[::-1] + echo, finish=FINISH_STOP))
        for k in range(0, len(batch), 32):  # keep each record well under capacity / 2
            out.publish(batch[k : k + 32])
        if stop:
            break
    out.set_aux(0, 2)
    """
)


def _wait_aux(ring: Ring, value: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while ring.aux(0) != value:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "child did not report"
        time.sleep(0.005)


def test_two_processes_10k_requests(ring_path) -> None:
    req_path, out_path = ring_path(), ring_path()
    req = Ring.create(req_path, 1 << 16)
    out = Ring.create(out_path, 1 << 16)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_ECHO, req_path, out_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_aux(out, 1, proc)
        Ring.unlink(req_path)
        Ring.unlink(out_path)
        assert not os.path.exists(req_path) and not os.path.exists(out_path)

        n = 10_000
        received: list[Output] = []

        def reader() -> None:
            while len(received) < n and proc.poll() is None:
                out.wait(1.0)
                received.extend(out.drain_tokens())

        rt = threading.Thread(target=reader)
        rt.start()
        expected = []
        for i in range(n):
            prompt = [(i * 7 + k) % 50000 for k in range(i % 97)]
            seed = i if i % 2 else None
            if i % 10 == 9:
                req.push_abort(i)
                expected.append(Output(request_id=i, tokens=[], finish=3))
                continue
            submit = SubmitInput(
                request_id=i,
                prompt=prompt,
                max_tokens=i % 300 + 1,
                temperature=0.5,
                top_p=0.9,
                top_k=i % 50,
                seed=seed,
                ignore_eos=bool(i % 3 == 0),
            )
            req.push_submit(submit, timeout=10)
            tail = [i % 300 + 1, i % 50, seed or 0, int(i % 3 == 0)]
            expected.append(Output(request_id=i, tokens=prompt[::-1] + tail, finish=FINISH_STOP))
        rt.join(60)
        assert not rt.is_alive()
        assert proc.poll() is None, proc.communicate()
        assert received == expected
        req.push_shutdown()
        assert proc.wait(30) == 0, proc.communicate()
        assert out.aux(0) == 2
        # Still gone from /dev/shm while the mappings kept working.
        assert not os.path.exists(req_path) and not os.path.exists(out_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


CHILD_WAITER = textwrap.dedent(
    """
    import sys, time
    from deepinfer_server._native import Ring
    r = Ring.open(sys.argv[1])
    r.set_aux(0, 1)
    t0 = time.monotonic()
    ok = r.wait(30.0)
    print(ok, r.closed, time.monotonic() - t0)
    """
)


def test_close_wakes_waiter_in_other_process(ring_path) -> None:
    p = ring_path()
    ring = Ring.create(p, 4096)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_WAITER, p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_aux(ring, 1, proc)
        time.sleep(0.2)  # let the child go to sleep in wait()
        ring.close()
        stdout, stderr = proc.communicate(timeout=10)
        assert proc.returncode == 0, stderr
        ok, closed, elapsed = stdout.split()
        assert ok == "True" and closed == "True"
        assert float(elapsed) < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
