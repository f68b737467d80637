"""The DeepInfer engine behind a rank (`--engine deepinfer`): deepinfer 0.1.0's `LLMEngine`, one per DP rank.

Every name used from deepinfer here exists in the 0.1.0 sdist (tests/test_deepinfer_contract.py checks them against
the real source). The rank process must run `deepinfer_server.engine.lockstep.serve_lockstep`, not `loop.serve_rank`:
DeepInfer's DP ranks have to step together (`sync` is the one collective per loop iteration).

What the adapter handles (see the reference notes on deepinfer 0.1.0, section 1.4):

* `step()` returns raw pointers to C++ `RequestOutput`s, one token each, valid until the next `step()`/flush: they
  are read at once and merged into one row per request per step (speculative decoding: up to 1 + nextn tokens), the
  plain rows (tokens, finish) as one `StepOutputs`, those with a reason or logprobs as `Output` records.
* Async scheduling (ZOS) returns decode tokens one step late: `flush()` collects them when the group goes idle.
* EOS arrives as a token with reason "stop" (the codec drops it); "length" ends with a real token; any other
  reason ("abort", "prompt_length_exceeded", "insufficient_system_resource", grammar or vision errors) is a
  terminal event without a token and becomes FINISH_ERROR with the reason.
* Aborting a running request emits nothing; an abort can be lost (a request not yet in the scheduler runs anyway):
  any later output for an id the server no longer waits for is dropped and the id is aborted again.
* `add_request` returns None for out-of-range token ids: that is published as an error finish. Any exception
  from it fails that request only, except `ENGINE_FAULTS`, which end the rank (engine/rank.py `die`).
* `max_tokens` is clamped to the context (the engine reserves prompt + max_tokens per sequence).

* A weight reload closes the engine and builds another on the new checkpoint, on every rank together (`reload`).

Nothing here imports numpy, torch or deepinfer at module level: engine/deepinfer_build.py builds the engine in the
rank (and again on a reload). What the server checks and derives before any rank starts (serving environment,
output pool, GPUs and rendezvous) is engine/deepinfer_config.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from deepinfer_server import _native
from deepinfer_server.engine.base import EngineLost, Output, Published, StepOutputs, Submit, failed

log = logging.getLogger("deepinfer_server.deepinfer")

# Text-only requests pass no multi_modal_data. deepinfer's own `LLM.generate` passes empty image lists
# (llm.py:158-159), but any dict, even an empty one, goes to the vision-encoder worker process and back
# (multimodal_processor.py `add`/`fetch`) and leaves the sequence unschedulable until then
# (pybind_sequence.cpp:35 `schedulable = multi_modal_data.is_none()`): an IPC round trip and at least one step
# before prefill, for every request. None is the path of the profiling run and the placeholder sequence
# (prepare_tensor_input_vl.py:88-91, model_runner.py:395), and the model handles a batch without any
# ("pure text / profile run", deepseek_vl.py:219-222). A batch that mixes text-only and image requests is padded
# for the None ones (prepare_tensor_input_vl.py `prepare_input_metadata_vl`: "补全 None 键集").
# A request with images passes {"image_bytes": [encoded bytes], "image_sizes": [(width, height)]}, one pair per
# image placeholder in prompt order (multimodal_processor.py `overwrite_prompt`). The placeholder is the engine's
# `mm_config.image_token_id` (config.json; checked against the tokenizer's `<image>`/`<｜deepseek_image｜>` or
# config `image_token`); deepseek-recipe writes `<｜image｜>`, so its ID is replaced when the two differ.
_USER_ID = "deepinfer-server"
_REAL_TOKEN_REASONS = ("", "stop", "length")
_INT32_MAX = (1 << 31) - 1
# Errors from `add_request` that say the engine, not the request, is broken. Anything else fails that request only.
ENGINE_FAULTS: tuple[type[BaseException], ...] = (MemoryError, SystemError, OSError)


class DeepInferEngine:
    """One DP rank's LLMEngine behind the `Engine` protocol, plus `sync` and `flush` for the lockstep loop.

    Not thread-safe: every call happens on the rank's single engine thread (DeepInfer requires it).
    """

    quiet_step = False  # a real step takes milliseconds: every one wakes the server

    def __init__(
        self,
        engine: Any,
        *,
        cfg: dict[str, Any],
        build: Callable[[dict[str, Any]], DeepInferEngine],
        max_model_len: int,
        np: Any,
        torch: Any,
        dist: Any,
        request_output: Any,
        sampling_params: Any,
        dp_group: Any,
        image_placeholder_id: int | None = None,
        prompt_logprobs: bool = True,
    ) -> None:
        self.engine = engine
        self.cfg = cfg  # what `build` got: a reload builds again from it, with another model
        self._build = build
        self.image_placeholder_id = image_placeholder_id  # the serving tokenizer's <｜image｜>
        self.max_model_len = max_model_len
        self._np = np
        self._torch = torch
        self._dist = dist
        self._ro = request_output
        self._sp = sampling_params
        self._group = dp_group
        self.group_size = int(dp_group.size()) if dp_group is not None else 1
        # Requests without a first token yet: when the rank took each (time.monotonic()), for the server's TTFT
        # breakdown; `firsts` holds (request, taken, step start) for first tokens not yet published.
        self.fresh: dict[int, float] = {}
        self.firsts: list[tuple[int, float, float]] = []
        self.launched = 0.0  # when the step whose outputs the next call returns was launched
        self.live: set[int] = set()  # requests the server still waits for
        self.logprobs: dict[int, int] = {}  # requests that asked for logprobs -> alternatives per token
        self.prompt_logprobs_ok = prompt_logprobs  # False under YoCo prefill truncation
        self.prompt_logprobs: set[int] = set()  # requests waiting for their prompt's logprobs (first output)
        self.re_aborts = 0
        self.drafted = 0  # speculative decoding: draft tokens proposed, and accepted, since start
        self.accepted = 0
        self.stepped = False  # a step ran since the last flush: its post-processing may still be in flight
        self.broken = False  # a collective failed: a peer is gone, never enter another collective
        self.closed = False

    # -- requests ----------------------------------------------------------------------------------------------
    def add(self, req: Submit) -> list[Output]:
        rid = req.request_id
        prompt = req.prompt
        if not prompt:
            return [failed(rid, "empty prompt")]
        if req.prompt_logprobs and not self.prompt_logprobs_ok:
            return [failed(rid, "prompt_logprobs_unavailable")]
        if min(prompt) < 0 or max(prompt) > _INT32_MAX:
            return [failed(rid, "prompt contains a token id outside the vocabulary")]
        n = len(prompt) + (req.images.extra_tokens if req.images is not None else 0)
        max_tokens = max(1, min(req.max_tokens, self.max_model_len - n, _INT32_MAX))
        try:
            sp = self._sp(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                max_tokens=max_tokens,
                ignore_eos=req.ignore_eos,
                seq_seed=req.seed,
                top_logprobs=req.logprobs or 0,
                prompt_logprobs=req.prompt_logprobs,
                so_args=req.so_args,
            )
            ids = self._np.ascontiguousarray(self._np.asarray(prompt, dtype=self._np.int32))
            mm = self._images(ids, req)
            if isinstance(mm, str):
                return [failed(rid, mm)]
            seq = self.engine.add_request(
                user_id=_USER_ID,
                request_id=str(rid),
                sampling_params=sp,
                prompt_token_ids=ids,
                multi_modal_data=mm,
            )
        except ENGINE_FAULTS:
            raise  # the engine (its memory, its worker processes or shared memory) is at fault: the rank exits
        except Exception as e:
            # This request only: the engine refused it (bad parameters, a check of its own). Abort the id in case
            # it got half-way in, so nothing runs unseen; if even that fails, the engine's state is at fault.
            log.warning("request %d: add_request failed: %r", rid, e)
            self.engine.abort_request([str(rid)])
            # The client is told the exception's type only: its text may name the engine's files (logged above).
            return [failed(rid, f"the engine refused the request with {type(e).__name__}")]
        if seq is None:  # dropped by the engine: token ids outside [0, vocab_size)
            return [failed(rid, "prompt contains a token id outside the vocabulary")]
        self.live.add(rid)
        self.fresh[rid] = time.monotonic()
        if req.logprobs is not None:
            self.logprobs[rid] = req.logprobs
        if req.prompt_logprobs:
            self.prompt_logprobs.add(rid)
        return []

    def _images(self, ids: Any, req: Submit) -> dict[str, list[Any]] | str | None:
        """A request's multi_modal_data (its placeholders moved to the engine's image token in `ids`), None for a
        text-only request, or why the engine cannot take its images."""
        images = req.images
        if images is None:
            return None
        processor = self.engine.multi_modal_processor  # None without a vision encoder (llm_engine.py:210-221)
        if processor is None:
            return "images_unsupported"
        want = int(processor.mm_config.image_token_id)
        have = self.image_placeholder_id
        if have is not None and have != want:
            ids[ids == have] = want
        return {"image_bytes": list(images.data), "image_sizes": [(int(w), int(h)) for w, h in images.sizes]}

    def abort(self, request_ids: list[int]) -> None:
        ids = [rid for rid in request_ids if rid in self.live]
        if not ids:
            return
        for rid in ids:
            self.live.discard(rid)
            self.logprobs.pop(rid, None)
            self.prompt_logprobs.discard(rid)
            self.fresh.pop(rid, None)
        self.engine.abort_request([str(rid) for rid in ids])

    # -- state -------------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Local: waiting, running or still-admitting requests on this rank (no collective)."""
        return bool(self.engine.scheduler.has_unfinished_seqs() or self.engine.so_builder_has_pending())

    def load(self) -> tuple[int, int]:
        _, waiting_tokens = self.engine.scheduler.get_sum_prompt_len_waiting()
        return len(self.live), int(waiting_tokens)

    def first_token_times(self) -> list[tuple[int, float, float]]:
        """(request, taken, step start) of the first tokens in the outputs just returned, once each."""
        out, self.firsts = self.firsts, []
        return out

    def spec_tokens(self) -> tuple[int, int]:
        """(draft tokens proposed, accepted) since start, for vllm:spec_decode_* on /metrics."""
        return self.drafted, self.accepted

    def preemptions(self) -> int:
        """Sequences the engine preempted since start (it recomputes them: stop_preempted_request=False)."""
        return int(self.engine.scheduler.get_num_preempted_seqs())

    def kv_usage(self) -> float:
        """Share of this rank's KV blocks in use (block manager's free count against the profiled total)."""
        total = self.engine.cache_config.num_gpu_blocks
        if not total:
            return 0.0
        free = self.engine.scheduler.get_num_free_gpu_blocks()
        return float(min(1.0, max(0.0, 1.0 - free / total)))

    def kv_capacity_tokens(self) -> int:
        """The profiled KV blocks times the block size."""
        return int(self.engine.cache_config.num_gpu_blocks or 0) * int(self.engine.cache_config.block_size)

    def sync(self, busy: bool, stop: bool, reload: bool = False) -> tuple[bool, bool, bool]:
        """THE collective of a loop iteration, the same answer on every rank: (any busy, any stopping, all holding a
        reload), one MAX over the DP group (of "not holding" for the third)."""
        if self.group_size <= 1:
            return busy, stop, reload
        flags = self._torch.tensor([int(busy), int(stop), int(not reload)], dtype=self._torch.int64)
        with self._breaks_on_error():
            self._dist.all_reduce(flags, op=self._dist.ReduceOp.MAX, group=self._group)
        return bool(flags[0]), bool(flags[1]), not flags[2]

    def reload(self, model_path: str) -> None:
        """Collective: serve `model_path` from now on; raise if it did not load (`EngineLost` if neither did).

        DeepInfer 0.1.0 has no in-place weight update: its one loader runs in the constructor, which also profiles
        memory and captures the CUDA graphs against the weights' addresses. So every DP rank, at the same lockstep
        iteration and with nothing running (the server drained or aborted first, rust/path/reload.rs), closes its
        engine (workers, graphs and process groups torn down) and builds another. A checkpoint that fails to load
        fails on every rank (the same files), so every rank builds the old one again. The loop, its status and any
        wrapper keep this object: it takes over the new engine's state."""
        cfg = self.cfg
        if self.broken:
            raise EngineLost("a DP peer is gone: the group cannot close and load together")
        try:
            self.close()  # flushes the step still in flight first (async scheduling)
        except BaseException as e:
            raise EngineLost(f"closing the engine to load {model_path} failed: {e!r}") from e
        self.engine = None  # the only reference: its GPU memory (weights, KV cache, graphs) goes before the load
        gc.collect()
        if self._torch.cuda.is_available():
            self._torch.cuda.empty_cache()
        error = None
        try:
            fresh = self._build({**cfg, "model": model_path})
        except Exception as e:
            log.exception("loading %s failed; loading %s again", model_path, cfg["model"])
            error = RuntimeError(f"{model_path} did not load ({type(e).__name__}: {e})")
            gc.collect()  # the half-built engine's __del__ closes what it started (collective: all failed alike)
            try:
                fresh = self._build(cfg)
            except BaseException as again:
                raise EngineLost(f"neither {model_path} nor the one served before ({cfg['model']}) loads") from again
        self.__dict__.update(fresh.__dict__)
        if error is not None:
            raise error

    # -- steps -------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _breaks_on_error(self) -> Iterator[None]:
        """A failed engine call or collective leaves the group out of step: mark it broken, then re-raise."""
        try:
            yield
        except BaseException:
            self.broken = True
            raise

    def step(self) -> list[Published]:
        started = time.monotonic()
        with self._breaks_on_error():
            ptrs = self.engine.step()
        self.stepped = True
        out = self._collect(ptrs)
        self.launched = started  # under async scheduling (ZOS) this step's tokens come back from the next call
        return out

    def flush(self) -> list[Published]:
        """Post-process the step still in flight (async scheduling) when the group goes idle."""
        with self._breaks_on_error():
            ptrs = self.engine.flush_inflight_reqs()
        self.stepped = False
        out = self._collect(ptrs)
        self.fresh.clear()  # idle now: whatever is left never got a token
        if self.live and not self.has_work():
            # Nothing left in the engine, yet the server still waits: the engine dropped these without an output.
            for rid in sorted(self.live):
                out.append(failed(rid, "the engine dropped the request without a result"))
            self.live.clear()
        return out

    def _collect(self, ptrs: Any) -> list[Published]:
        """Read the step's RequestOutputs now (they are released by the next step) into one row per request."""
        ro = self._ro
        rows: dict[int, list[Any]] = {}
        re_abort: list[str] = []
        for p in ptrs:
            sid = ro.get_request_id(p)
            try:
                rid = int(sid)
            except ValueError:
                continue  # not ours (e.g. an engine-internal placeholder)
            row = rows.get(rid)
            if row is None:
                if rid not in self.live:
                    # Aborted (or already finished): drop. Still running means the abort was lost: abort again.
                    if not ro.get_finished(p) and sid not in re_abort:
                        re_abort.append(sid)
                    continue
                row = rows[rid] = [[], _native.FINISH_NONE, None, [] if rid in self.logprobs else None, None]
                if rid in self.prompt_logprobs:  # DeepInfer sets them on a request's first output
                    self.prompt_logprobs.discard(rid)
                    row[4] = [float(v) for v in ro.get_prompt_logprobs(p)]
                if self.fresh:  # its first output: its prefill ran in the step launched before this call
                    taken = self.fresh.pop(rid, None)
                    if taken is not None:
                        self.firsts.append((rid, taken, max(taken, self.launched)))
            elif row[1] != _native.FINISH_NONE:
                continue  # after the finish in this step (the engine trims these; be safe)
            drafted = ro.get_draft_tok(p)  # set on a request's last token of a speculative step, else 0
            if drafted:
                self.drafted += int(drafted)
                self.accepted += int(ro.get_accept_tok(p))
            reason = ro.get_finish_reason(p)
            if reason in _REAL_TOKEN_REASONS:
                row[0].append(int(ro.get_token_id(p)))
                if row[3] is not None:  # DeepInfer returns token_logprobs always, alternatives when asked
                    top = self.logprobs[rid]
                    ids, values = ro.get_top_token_ids(p), ro.get_top_logprobs(p)
                    alts = [(int(t), float(v)) for t, v in zip(list(ids)[:top], list(values)[:top], strict=False)]
                    row[3].append((float(ro.get_token_logprobs(p)), alts))
                if ro.get_finished(p):
                    row[1] = _native.FINISH_STOP if reason == "stop" else _native.FINISH_LENGTH
            else:  # terminal without a token: its token_id is a prompt or earlier token
                row[1] = _native.FINISH_ERROR
                row[2] = reason
            if row[1] != _native.FINISH_NONE:
                self.live.discard(rid)
                self.logprobs.pop(rid, None)
                self.prompt_logprobs.discard(rid)
        if re_abort:
            self.re_aborts += len(re_abort)
            log.info("re-aborting %d request(s) whose abort was lost: %s", len(re_abort), ", ".join(re_abort[:8]))
            self.engine.abort_request(re_abort)
        out: list[Published] = []
        rids, toks, fins = [], [], []  # the plain rows, as one StepOutputs
        for rid, (tokens, finish, reason, lps, plps) in rows.items():
            if reason is None and lps is None and plps is None and finish != _native.FINISH_ERROR:
                rids.append(rid)
                toks.append(tokens)
                fins.append(finish)
            else:
                out.append(
                    Output(
                        request_id=rid, tokens=tokens, finish=finish, reason=reason, logprobs=lps, prompt_logprobs=plps
                    )
                )
        return [*out, StepOutputs(request_ids=rids, tokens=toks, finishes=fins)] if rids else out

    def close(self) -> None:
        """Collective close (all ranks leave the loop at the same iteration). After a failed collective, skip it."""
        if self.closed:
            return
        self.closed = True
        if self.broken:
            log.warning("a DP peer is gone: skipping the collective engine.close()")
            with contextlib.suppress(Exception):
                self.engine.closed = True  # LLMEngine.__del__ would run the collective close() otherwise
            return
        if self.stepped:
            # Async scheduling leaves the last step's post-processing in flight; close() must not tear the
            # engine down under it. Every rank stepped the same way, so every rank flushes here (collective).
            self.engine.flush_inflight_reqs()
            self.stepped = False
        self.engine.close()
