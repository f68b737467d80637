"""Fake of deepinfer/engine/llm_engine.py: `LLMEngine` with the real method names and the serving quirks.

Output is real text: tokens of a small corpus (`_fake_corpus.txt`) encoded with the checkpoint's tokenizer.json,
deterministic per prompt and seq_seed, ending with EOS after a plausible length (EOS stays an ordinary token
under ignore_eos). See ../README.md for the quirks and the test knobs.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import sys
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from deepinfer._C import engine as _C
from deepinfer._C.engine import RequestOutput
from deepinfer.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.engine_type import EngineType
from deepinfer.environ import envs
from deepinfer.model_executor.parallel_utils.parallel_state import PG
from deepinfer.sampling_params import SamplingParams
from deepinfer.utils import get_distributed_init_method

CORPUS = Path(__file__).resolve().parent.parent / "_fake_corpus.txt"
NUM_IMAGE_SPECIAL = 5


def _cp_worker(conn: Any, rank: int, world: int, init_method: str) -> None:
    """A CP worker (cp_rank >= 1): dies with its driver (set_pdeathsig, worker/base.py), joins the world
    (global rank engine_rank x CP + cp_rank) and runs the collective part of every call its driver forwards."""
    import ctypes
    import signal
    from datetime import timedelta

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dist.init_process_group(
        backend="gloo", init_method=init_method, timeout=timedelta(seconds=600), world_size=world, rank=rank
    )
    dist.barrier()  # model init and warm-up
    steps = flushes = 0
    while True:
        try:
            method = conn.recv()
        except EOFError:
            return
        if method == "step":
            dist._collective("step", [], None)  # the forward's all-to-all
            steps += 1
        elif method == "flush":
            dist._collective("flush", [], None)
            flushes += 1
        elif method == "close":
            dist._collective("close", [steps, -steps, flushes, -flushes], dist.ReduceOp.MAX)
            dist.destroy_process_group()
            _say(f"cp worker {rank}/{world} closed: steps={steps} flushes={flushes}")
        conn.send("ok")
        if method == "close":
            return


def _ve_worker(conn: Any) -> None:
    """The multimodal preprocessing worker: maps each request's multi_modal_data and sends it back. Nothing ties
    it to its parent's death (the worst case for teardown): when the driver is gone it just waits."""
    while True:
        try:
            request_id = conn.recv()
        except EOFError:
            while True:
                time.sleep(3600)
        conn.send(request_id)


def _start_cp_worker(pc: ParallelConfig, cp_rank: int) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    cp, world = pc.context_parallel_size, pc.data_parallel_size * pc.context_parallel_size
    args = (child, pc.engine_rank * cp + cp_rank, world, get_distributed_init_method(pc))
    w = ctx.Process(target=_cp_worker, args=args, daemon=True, name=f"cp{cp_rank}")
    w.start()
    child.close()
    return w, parent


def _start_ve_worker() -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    w = ctx.Process(target=_ve_worker, args=(child,), daemon=True, name="ve")
    w.start()
    child.close()
    return w, parent


def _say(msg: str) -> None:
    # One write per line: the ranks share the server's stderr, and print() writes the text and "\n" separately.
    sys.stderr.write(f"fake-deepinfer {msg}\n")
    sys.stderr.flush()


class _MMConfig:
    def __init__(self, image_token_id: int) -> None:
        self.image_token_id = image_token_id


class MultimodalProcessor:
    """The parts of deepinfer/ve/multimodal_processor.py the adapter touches: `mm_config.image_token_id` and the
    prompt expansion of `overwrite_prompt` (each placeholder -> vocab+IMAGE then N-1 x vocab+IMAGE_PAD, N from the
    image's (width, height); more placeholders than images: the rest stay plain tokens)."""

    IMAGE, IMAGE_PAD = 2, 1  # ImageTokenOffset

    def __init__(self, image_token_id: int, vocab_size: int) -> None:
        self.mm_config = _MMConfig(image_token_id)
        self.vocab_size = vocab_size

    def overwrite_prompt(self, token_ids: np.ndarray, multi_modal_data: dict) -> np.ndarray:
        from deepseek_recipe import ImageInfo, MultiModalData  # the V4.1 image token spec, as the engine's estimate

        sizes = multi_modal_data.get("image_sizes", [])
        at = np.flatnonzero(token_ids == self.mm_config.image_token_id)[: len(sizes)]
        pieces, cursor = [], 0
        for (w, h), pos in zip(sizes, at.tolist(), strict=False):
            n = MultiModalData([ImageInfo(b"", int(w), int(h))]).image_token_adjustment() + 1
            expanded = np.full(n, self.vocab_size + self.IMAGE_PAD, dtype=np.int32)
            expanded[0] = self.vocab_size + self.IMAGE
            pieces += [token_ids[cursor:pos], expanded]
            cursor = pos + 1
        pieces.append(token_ids[cursor:])
        return np.concatenate(pieces).astype(np.int32)


class Sequence:
    def __init__(self, request_id: str, prompt: list[int], sp: SamplingParams, plan: list[int], offset: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.sampling_params = sp
        self.plan = plan
        self.grammar_failed = False  # structured output that xgrammar fails to compile
        self.ve_failed = False  # multi_modal_data with image_bytes None: FINISHED_VE_FAILED
        self.offset = offset
        self.output: list[int] = []
        self.status = "WAITING"
        self.schedulable = True

    def get_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def get_prompt_len(self) -> int:
        return len(self.prompt)


class Scheduler:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.decode_step = 0
        self.num_preempted = 0

    def get_num_preempted_seqs(self) -> int:
        return self.num_preempted

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_seqs(self) -> int:
        return len(self.waiting) + len(self.running)

    def get_num_free_gpu_blocks(self) -> int:
        bs = self.engine.cache_config.block_size
        used = sum(-(-s.get_len() // bs) for s in self.running)
        return max(0, self.engine.cache_config.num_gpu_blocks - used)

    def get_sum_prompt_len_waiting(self) -> tuple[int, int]:
        return len(self.waiting), sum(len(s.prompt) for s in self.waiting)

    def abort_sequence(self, request_ids: list[str]) -> list[Sequence]:
        ids = set(request_ids)
        gone = [s for s in self.waiting + self.running if s.request_id in ids]
        for s in gone:
            s.status = "FINISHED_ABORTED"
        self.running = [s for s in self.running if s.request_id not in ids]
        return gone


class LLMEngine:
    """This release does not include an online-serving wrapper (nor does the fake)."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        parallel_config: ParallelConfig,
        scheduler_config: SchedulerConfig,
        log_stats: bool = True,
        engine_type: EngineType = EngineType.NORMAL,
        offline_inference: bool = False,
    ) -> None:
        gpu_ids = list(map(int, os.environ["CUDA_VISIBLE_DEVICES"].split(",")))
        self.driver_gpu_id = gpu_ids[0]
        self.model_config = model_config
        self.cache_config = cache_config
        self.parallel_config = parallel_config
        self.scheduler_config = scheduler_config
        self.log_stats = log_stats
        self.engine_type = engine_type
        self.offline_inference = offline_inference
        self.closed = False
        self.tokenizer = Tokenizer.from_file(str(Path(model_config.tokenizer) / "tokenizer.json"))
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.eos_id = vocab["<｜end▁of▁sentence｜>"]
        self.corpus = self.tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False).ids
        self.starts = [i + 1 for i, t in enumerate(self.corpus[:-1]) if self.tokenizer.id_to_token(t) in (".", ".Ċ")]
        self.nextn = max(0, envs.DEEPINFER_USE_NEXTN_DECODE)
        self.zos = envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING
        self.step_s = float(os.environ.get("FAKE_DEEPINFER_STEP_MS", "0")) / 1000.0
        self.admission_steps = int(os.environ.get("FAKE_DEEPINFER_ADMISSION_STEPS", "0"))
        # Failure injection: add_request raises for prompts longer than this; abort_request raises.
        self.add_raises_over = int(os.environ.get("FAKE_DEEPINFER_ADD_RAISES_OVER", "0"))
        self.abort_raises = os.environ.get("FAKE_DEEPINFER_ABORT_RAISES", "") == "1"
        # Structured output: requests with so_args fail in xgrammar as the real engine reports it (a compile error
        # or timeout in the builder thread), after being admitted through the builder.
        self.grammar_fails = os.environ.get("FAKE_DEEPINFER_GRAMMAR_FAILS", "") == "1"
        # Prompts longer than this end with "insufficient_system_resource" (no memory for them right now).
        self.no_memory_over = int(os.environ.get("FAKE_DEEPINFER_NO_MEMORY_OVER", "0"))
        kv = int(os.environ.get("FAKE_DEEPINFER_KV_TOKENS", str(1 << 24)))
        self.kv_tokens = int(kv * cache_config.gpu_memory_utilization)
        pc = parallel_config
        # The real engine forks a multimodal preprocessing worker, then spawns CP-1 workers (llm_engine.py).
        self._ve, self._ve_conn = _start_ve_worker()
        self._ve_pending: dict[str, Sequence] = {}  # sent to the VE worker; schedulable once it answers
        self.ve_round_trips = 0
        self._cp: list[tuple[Any, Any]] = [_start_cp_worker(pc, r) for r in range(1, pc.context_parallel_size)]
        if self._cp:
            _say(f"rank {pc.engine_rank}: CP workers {[w.pid for w, _ in self._cp]} ve worker {self._ve.pid}")
        # Distributed init (worker/base.py): world = DP x CP, this driver is global rank engine_rank x CP.
        if not dist.is_initialized():
            dist.init_process_group(
                backend="gloo",
                init_method=get_distributed_init_method(pc),
                timeout=__import__("datetime").timedelta(seconds=envs.DEEPINFER_GLOO_TIMEOUT),
                world_size=pc.data_parallel_size * pc.context_parallel_size,
                rank=pc.engine_rank * pc.context_parallel_size,
            )
        PG.create_process_groups(pc.context_parallel_size)
        dist.barrier()  # model init and warm-up are collective
        # The checkpoint's weights, as far as the fake has any (config.json): `fake_weights_seed` changes what every
        # prompt generates, so a weight reload shows; `fake_load_fails` fails the constructor at its end, after the
        # collective init (the half-built engine's __del__ then runs the collective close, as the real one's does).
        config = Path(model_config.model) / "config.json"
        ckpt = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        self.weights_seed = int(ckpt.get("fake_weights_seed", 0))
        self.cache_config.num_gpu_blocks = max(1, self.kv_tokens // cache_config.block_size)
        self.scheduler = Scheduler(self)
        # A V4.1 checkpoint has a vision config; its image token comes from config.json (here: the environment,
        # so a test can make it differ from the serving tokenizer's <｜image｜>).
        image_id = int(os.environ.get("FAKE_DEEPINFER_IMAGE_TOKEN_ID", vocab.get("<｜image｜>", 0)))
        self.multi_modal_processor = MultimodalProcessor(image_id, self.model_config.get_vocab_size())
        self._admitting: list[tuple[int, Sequence]] = []  # (admitted at step, seq): the lost-abort window
        self._inflight: list[RequestOutput] = []  # ZOS: decode outputs of the last step, returned one step late
        self._ignored: list[RequestOutput] = []  # terminal outputs of aborted-while-waiting requests
        self._to_release: list[int] = []  # output pointers the engine frees in the next step
        self.accept_all = os.environ.get("FAKE_DEEPINFER_ACCEPT_ALL", "") == "1"  # every draft token accepted
        self.vote_s = float(os.environ.get("FAKE_DEEPINFER_VOTE_MS", "0")) / 1000.0  # cost of one scheduler vote
        self.preempt_every = int(os.environ.get("FAKE_DEEPINFER_PREEMPT_EVERY", "0"))  # decode steps per preemption
        self.votes = 0
        self.placeholder_steps = 0
        self.generate_step = 0
        self.flushes = 0
        self.max_tokens_per_req_step = 0
        self.lost_aborts = 0
        self.aborted_ids: set[str] = set()
        self.reaborted = 0
        self._lost: set[str] = set()
        _say(
            f"rank {pc.engine_rank}/{pc.data_parallel_size}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} "
            f"rendezvous={get_distributed_init_method(pc)} nextn={self.nextn} zos={int(self.zos)} "
            f"prefill_intervals={scheduler_config.prefill_attempt_interval}/"
            f"{scheduler_config.prefill_any_attempt_interval} "
            f"multimodal_pool={int(envs.DEEPINFER_USE_MULTIMODAL_POOL)} max_model_len={scheduler_config.max_model_len} "
            f"max_num_seqs={scheduler_config.max_num_seqs} trust_remote_code={model_config.trust_remote_code} "
            f"log_stats={int(log_stats)} weights={model_config.model} weights_seed={self.weights_seed}"
        )
        if ckpt.get("fake_load_fails"):
            raise RuntimeError(f"fake deepinfer: {model_config.model}: the checkpoint's weights do not load")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        engine_configs = engine_args.create_engine_configs()
        return cls(
            *engine_configs,
            log_stats=not engine_args.disable_log_stats,
            engine_type=engine_args.engine_type,
            offline_inference=engine_args.offline_inference,
        )

    # -- requests --------------------------------------------------------------------------------------------------
    def add_request(
        self,
        /,
        user_id: str,
        request_id: str,
        sampling_params: dict | SamplingParams | None,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict | None = None,
        arrival_time: float | None = None,
        extra: dict | None = None,
        enqueue: bool = True,
        chunk_checkpoints: list[int] | None = None,
    ) -> Sequence | None:
        if sampling_params is None:
            sampling_params = {}
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams(**{k: v for k, v in sampling_params.items() if v is not None})
        sampling_params.eos_id = self.eos_id
        if envs.DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE != "off" and sampling_params.prompt_logprobs:
            # As the engine (llm_engine.py:529-537): a warning, and the request runs without them.
            _say(f"Request {request_id}: prompt_logprobs is forced to False under YoCo prefill truncation")
            sampling_params.prompt_logprobs = False
        a = prompt_token_ids
        if not (isinstance(a, np.ndarray) and a.dtype == np.int32 and a.ndim == 1 and a.flags.c_contiguous):
            raise TypeError("prompt_token_ids must be a 1-D C-contiguous np.ndarray[np.int32] (noconvert)")
        # As the engine: images expand their placeholders first, then the empty and token-range checks.
        ve_failed = False
        if multi_modal_data is not None:
            if multi_modal_data.get("image_bytes", []) is None:
                ve_failed = True
            else:
                data, sizes = multi_modal_data.get("image_bytes", []), multi_modal_data.get("image_sizes", [])
                placeholders = int((a == self.multi_modal_processor.mm_config.image_token_id).sum())
                digests = [hashlib.sha256(bytes(d)).hexdigest()[:16] for d in data]
                a = self.multi_modal_processor.overwrite_prompt(a, multi_modal_data)
                shown = json.dumps([list(map(int, x)) for x in sizes], separators=(",", ":"))
                _say(
                    f"multi_modal_data {request_id} placeholders={placeholders} sizes={shown} "
                    f"sha={','.join(digests)} expanded_len={a.size}"
                )
        if a.size == 0:
            raise ValueError("prompt must not be empty")
        max_valid = self.model_config.get_vocab_size() + (NUM_IMAGE_SPECIAL if multi_modal_data is not None else 0)
        if a.min() < 0 or a.max() >= max_valid:
            _say(f"Drop request {request_id} from {user_id=} due to invalid token")
            return None
        if self.add_raises_over and a.size > self.add_raises_over:
            raise RuntimeError(f"fake: the scheduler cannot take a {a.size}-token prompt")
        so_args = sampling_params.so_args
        grammar_failed = False
        if so_args is not None:
            # The real builder's checks (structure_output/so_matcher_builder.py, matcher.py validate_trigger_bound).
            if "serialized" in so_args or "bound_token_ids" in so_args:
                raise ValueError("fake: serialized grammars and bound_token_ids are not accepted")
            if so_args["schema_type"] not in ("json", "regex", "ebnf"):
                raise ValueError("Unsupported Grammar Type")
            triggers = so_args.get("trigger_token_ids") or []
            bad_trigger = not isinstance(triggers, list) or any(type(t) is not int or t < 0 for t in triggers)
            bound = so_args.get("bound_token_id")
            grammar_failed = bad_trigger or (
                bound is not None and (type(bound) is not int or bound < 0 or not triggers)
            )
            grammar_failed = grammar_failed or self.grammar_fails
            _say(f"so_args {request_id} {json.dumps(so_args, sort_keys=True)}")
        prompt = a.tolist()
        rng = random.Random((zlib.crc32(a.tobytes()) ^ self.weights_seed) * 1_000_003 + sampling_params.seq_seed)
        plan = [] if not self.corpus else self._text(rng, rng.randint(8, 60))
        plan.append(self.eos_id)
        seq = Sequence(request_id, prompt, sampling_params, plan, rng.randrange(1 << 30))
        seq.grammar_failed = grammar_failed
        seq.ve_failed = ve_failed
        if so_args is not None:  # through the grammar builder: the scheduler sees it a step later at the earliest
            self._admitting.append((self.generate_step + max(1, self.admission_steps), seq))
            return seq
        if multi_modal_data is not None:
            # Not schedulable until the VE worker has mapped its multi_modal_data, even an empty one
            # (pybind_sequence.cpp: schedulable = multi_modal_data.is_none(); multimodal_processor.add/fetch).
            seq.schedulable = False
            self._ve_pending[request_id] = seq
            self._ve_conn.send(request_id)
            self.ve_round_trips += 1
        if self.admission_steps > 0:
            self._admitting.append((self.generate_step + self.admission_steps, seq))
        else:
            self.scheduler.waiting.append(seq)
        return seq

    def _text(self, rng: random.Random, n: int) -> list[int]:
        start = rng.choice(self.starts) if self.starts else 0
        return [self.corpus[(start + k) % len(self.corpus)] for k in range(n)]

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        assert isinstance(request_id, (str, dict, set, list, tuple)), f"invalid request_id type: {type(request_id)}"
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.abort_raises:
            raise RuntimeError("fake: abort_request failed (scheduler state corrupt)")
        for rid in ids:
            if rid in self._lost:
                self.reaborted += 1
                self._lost.discard(rid)
            if any(s.request_id == rid for _, s in self._admitting):
                self.lost_aborts += 1  # not in the scheduler yet: the abort finds nothing and the request runs later
                self._lost.add(rid)
        sched = self.scheduler
        waiting = [s for s in sched.waiting if s.request_id in ids]
        seqs = sched.abort_sequence(ids)
        for s in waiting:  # aborted while waiting: one terminal output with reason "abort", next step
            sched.waiting.remove(s)
            self._ignored.append(self._out(s, s.prompt[-1], "abort", True))
        dropped = set(ids)
        self._inflight = [r for r in self._inflight if r.request_id not in dropped]  # running: nothing more
        return len(seqs), sum(s.get_len() for s in seqs)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seqs() + len(self._admitting)

    def so_builder_has_pending(self) -> bool:
        return bool(self._admitting)

    def has_unfinished_requests(self) -> bool:
        unfinished = self.scheduler.has_unfinished_seqs() or self.so_builder_has_pending()
        dp_group = PG.cpu_data_parallel_group()
        if dp_group.size() > 1:
            t = torch.full((1,), unfinished, dtype=torch.int64, device="cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
            unfinished = t.item() > 0
        return bool(unfinished)

    def get_num_pendings(self) -> int:
        num_pendings, _ = self.scheduler.get_sum_prompt_len_waiting()
        return num_pendings

    # -- steps -----------------------------------------------------------------------------------------------------
    def _out(self, s: Sequence, token: int, reason: str, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=s.request_id,
            prompt_len=len(s.prompt),
            token_id=token,
            finish_reason=reason,
            finished=finished,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            num_output_tokens=len(s.output) + 1,  # the generated-token case overwrites it
        )

    def _generate(self, s: Sequence, n: int) -> list[RequestOutput]:
        """Up to n tokens for s; stops at EOS (unless ignore_eos), max_tokens or the context."""
        outs = []
        sp = s.sampling_params
        for _ in range(n):
            i = len(s.output)
            tok = s.plan[i] if i < len(s.plan) else self.corpus[(s.offset + i) % len(self.corpus)]
            s.output.append(tok)
            if tok == self.eos_id and not sp.ignore_eos:
                reason = "stop"
            elif len(s.output) >= sp.max_tokens or s.get_len() > self.scheduler_config.max_model_len:
                reason = "length"
            else:
                reason = ""
            outs.append(self._out(s, tok, reason, reason != ""))
            outs[-1].num_output_tokens = len(s.output)
            # As DeepInfer: token_logprobs always, top_logprobs / top_token_ids as many as asked, best first.
            lp = -0.125 * (1 + i % 4)
            outs[-1].token_logprobs = lp
            alts = [tok] + [(tok + k) % self.model_config.get_vocab_size() for k in range(1, sp.top_logprobs)]
            outs[-1].top_token_ids = alts[: sp.top_logprobs]
            outs[-1].top_logprobs = [lp - k for k in range(sp.top_logprobs)]
            if i == 0 and sp.prompt_logprobs:
                # As DeepInfer: on the first token, one value per prompt token after the first (a deterministic
                # stand-in for the model's log-softmax at each position).
                outs[-1].prompt_logprobs = [-0.25 * (1 + int(t) % 7) for t in s.prompt[1:]]
            if reason:
                s.status = "FINISHED"
                break
        return outs

    def _allreduce_min(self, value: int) -> int:
        """The scheduler's `_dp_allreduce`: over the DP group (the drivers), not the world."""
        self.votes += 1
        if self.vote_s:
            time.sleep(self.vote_s)
        return int(dist._collective("vote", [value], dist.ReduceOp.MIN, PG.cpu_data_parallel_group())[0])

    def _vote_prefill(self, want: bool) -> bool:
        """The NORMAL engine's step type (scheduler.hpp:295-341): prefill only at vote points, decided by
        all-reduces over the DP group. ALL points (every prefill_attempt_interval decode steps) need every rank
        to want it; ANY points (every prefill_any_attempt_interval) need one; a prompt step resets the count.
        A second vote asks whether any rank really scheduled a prefill (the fake always does when it wants);
        a rank with nothing to prefill rides along with an empty prompt step."""
        sc, step = self.scheduler_config, self.scheduler.decode_step
        is_any = step != 0 and step % sc.prefill_any_attempt_interval == 0
        is_all = step % sc.prefill_attempt_interval == 0
        if not (is_any or is_all):
            return False
        # MIN of "0 if I want it" is 0 when any rank wants it; MIN of "1 if I want it" is 1 when all do.
        any_rank, all_ranks = (0, 1) if want else (1, 0)
        if not (self._allreduce_min(any_rank) == 0 if is_any else self._allreduce_min(all_ranks) == 1):
            return False
        return self._allreduce_min(0 if want else 1) == 0

    def _forward(self, method: str) -> None:
        """Driver -> CP workers, as the engine's shm MessageQueue broadcast: each runs the call's collectives
        with the world (a stopped worker stalls them, as a stopped peer does the real ones)."""
        for _, conn in self._cp:
            conn.send(method)

    def _forwarded(self) -> None:
        """Wait for every CP worker to finish the forwarded call."""
        for _, conn in self._cp:
            conn.recv()

    def step(self) -> np.ndarray:
        _C._release_all()
        self._forward("step")
        t0 = time.perf_counter()
        self.generate_step += 1
        sched = self.scheduler
        ready = [s for at, s in self._admitting if at <= self.generate_step]
        self._admitting = [(at, s) for at, s in self._admitting if at > self.generate_step]
        sched.waiting += ready
        # Prefill looks at the head of `waiting` only: one still with the VE worker blocks it (scheduler.hpp).
        want = bool(sched.waiting) and sched.waiting[0].schedulable
        want = want and len(sched.running) < self.scheduler_config.max_num_seqs
        prefill = self._vote_prefill(want)
        if dist.get_world_size() > 1:
            dist._collective("step", [], None)  # the forward's MoE all-to-all: every rank, every step
        vote = [prefill]
        outs: list[RequestOutput] = self._ignored
        self._ignored = []
        if self.zos:
            outs += self._inflight
            self._inflight = []
        # The worker post-processes the previous async step (allocating its outputs) before pre_sampler_sync frees
        # what the last call returned: both are live at once (worker.py execute_model_step).
        ptrs = _C._allocate(outs)
        _C._release(self._to_release)
        self._to_release = []
        outs = []
        limit = min(self.scheduler_config.max_model_len, self.scheduler_config.max_num_batched_tokens)
        if vote[0]:  # prefill step (NORMAL engines never mix prefill and decode); first tokens come back now
            sched.decode_step = 0
            budget = self.scheduler_config.max_num_batched_tokens
            while sched.waiting and len(sched.running) < self.scheduler_config.max_num_seqs:
                s = sched.waiting[0]
                if not s.schedulable:
                    break
                if s.ve_failed:  # the VE worker had no image bytes to map
                    sched.waiting.pop(0)
                    s.status = "FINISHED_IGNORED"
                    outs.append(self._out(s, s.prompt[-1], "ve_error", True))
                    continue
                if s.grammar_failed:  # the builder's aborted matcher: finished before running, without a token
                    sched.waiting.pop(0)
                    s.status = "FINISHED_IGNORED"
                    outs.append(self._out(s, s.prompt[-1], "xgrammar runtime errors or timeout", True))
                    continue
                if len(s.prompt) > limit or len(s.prompt) > self.kv_tokens:
                    sched.waiting.pop(0)
                    s.status = "FINISHED_IGNORED"
                    outs.append(self._out(s, s.prompt[-1], "prompt_length_exceeded", True))
                    continue
                if self.no_memory_over and len(s.prompt) > self.no_memory_over:  # as a preempted, stopped request
                    sched.waiting.pop(0)
                    s.status = "FINISHED_IGNORED"
                    outs.append(self._out(s, s.prompt[-1], "insufficient_system_resource", True))
                    continue
                if len(s.prompt) > budget and budget < self.scheduler_config.max_num_batched_tokens:
                    break
                budget -= len(s.prompt)
                sched.waiting.pop(0)
                s.status = "RUNNING"
                sched.running.append(s)
                outs += self._generate(s, 1)
        else:  # decode step: 1 + accepted draft tokens per request
            produced: list[RequestOutput] = []
            for s in sched.running:
                rng = random.Random(zlib.crc32(f"{s.request_id}/{self.generate_step}".encode()))
                n = 1 + (self.nextn if self.accept_all else rng.randint(0, self.nextn) if self.nextn else 0)
                got = self._generate(s, n)
                self.max_tokens_per_req_step = max(self.max_tokens_per_req_step, len(got))
                if got:
                    got[-1].draft_tok, got[-1].accept_tok = self.nextn, len(got) - 1
                produced += got
            if self.zos:
                self._inflight = produced
            else:
                outs += produced
            sched.decode_step += 1
            if self.preempt_every and sched.decode_step % self.preempt_every == 0:
                # Out of KV: the newest running sequence is preempted and recomputed (stop_preempted_request
                # False): back to the head of `waiting`, its output kept, prefilled again (scheduler.hpp _preempt).
                victims = [s for s in sched.running if s.status == "RUNNING"]
                if victims:
                    victims[-1].status = "WAITING"
                    sched.waiting.insert(0, victims[-1])
                    sched.num_preempted += 1
            if not sched.running:
                self.placeholder_steps += 1  # an idle rank rides along with a one-token dummy batch
        sched.running = [s for s in sched.running if s.status == "RUNNING"]
        # The engine pumps the multimodal queue after scheduling: what the VE worker finished is schedulable from
        # the next step on (a round trip and at least one step later than a request without multi_modal_data).
        while self._ve_pending and self._ve_conn.poll():
            seq = self._ve_pending.pop(self._ve_conn.recv(), None)
            if seq is not None:
                seq.schedulable = True
        if self.step_s:
            left = t0 + self.step_s - time.perf_counter()
            if left > 0:
                time.sleep(left)
        ptrs += _C._allocate(outs)
        self._to_release += ptrs  # freed in the next step's pre_sampler_sync
        self._forwarded()
        return _C._as_array(ptrs)

    def flush_inflight_reqs(self) -> np.ndarray:
        _C._release_all()
        self._forward("flush")
        self.flushes += 1
        if dist.get_world_size() > 1:
            dist._collective("flush", [], None)  # stricter than the real engine: ranks flush together
        ptrs = _C._allocate(self._inflight)
        self._inflight = []
        self._to_release += ptrs  # freed in the next step, not here
        self._forwarded()
        return _C._as_array(ptrs)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _C._reset()
        self._forward("close")  # the workers join the close collective: their step counts are checked too
        counts = [self.generate_step, -self.generate_step, self.flushes, -self.flushes]
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = dist._collective("close", counts, dist.ReduceOp.MAX)
            if counts[0] != -counts[1] or counts[2] != -counts[3]:
                raise RuntimeError(f"fake deepinfer: ranks stepped a different number of times: {counts}")
        _say(
            f"rank {self.parallel_config.engine_rank} closed: steps={self.generate_step} flushes={self.flushes} "
            f"max_tokens_per_request_step={self.max_tokens_per_req_step} lost_aborts={self.lost_aborts} "
            f"reaborted={self.reaborted} ve_round_trips={self.ve_round_trips} votes={self.votes} "
            f"placeholder_steps={self.placeholder_steps} preempted={self.scheduler.num_preempted} lockstep=ok"
        )
        dist.destroy_process_group()
        self._forwarded()
        for w, _ in self._cp:
            w.join()
        self._ve_conn.close()
        self._ve.terminate()  # a stopped VE worker cannot act on this: the server kills it (rank process group)

    def __del__(self) -> None:
        self.close()  # as the real one's: collective, unless closed already (the adapter marks a broken group so)
