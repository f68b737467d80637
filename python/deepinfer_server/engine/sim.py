"""Simulated engine (`--engine sim`): batched steps, chunked prefill and a cost model, emitting real text.

Output is text from a bundled corpus tokenized by the serving tokenizer, deterministic for the same prompt and
seed. Like a real model it reads the prompt (sim_script.py): a prompt ending in `<think>` gets a reasoning part and
`</think>` first; a prompt that offers tools (and does not end in a tool result) gets a well-formed DSML tool call.
The engine's EOS token ends the output at a plausible length unless `ignore_eos`.

A request that asks for logprobs is sampled, token by token, from a distribution (`sampling.py`): the scripted
token is the most likely, its shorter spellings (prefixes of its bytes) and a few other tokens less so, with the
request's temperature, top-k and top-p applied; the logprobs it returns are that distribution's. A request
without logprobs follows its script and pays nothing for them.

Images cost their tokens in prefill, as the engine's expanded prompt would. A prompt with images that asks
`sim:images` gets, as its answer, what reached the rank: `images=N` and each one's `WxH/bytes/sha256 prefix`.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from deepinfer_server import _native
from deepinfer_server.engine.base import Output, Published, StepOutputs, Submit, failed
from deepinfer_server.engine.constrained import GRAMMAR_FAILED, GrammarRun, SimGrammars
from deepinfer_server.engine.sampling import Sampler, Spelling, prompt_logprobs
from deepinfer_server.engine.sim_config import script_seed
from deepinfer_server.engine.sim_script import Script
from deepinfer_server.vocabulary import Vocabulary

log = logging.getLogger("deepinfer_server.sim")
ANCHOR_SLACK_S = 0.001


@dataclass(frozen=True)
class SimConfig:
    tokenizer_path: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_step_ms: float = 0.0
    prefill_ms_per_1k_tokens: float = 0.0
    decode_ms_per_seq: float = 0.0  # extra decode time per sequence in the batch
    overlap_prefill: bool = False  # step = max(decode, prefill) instead of their sum
    prefill_chunk_tokens: int = 0  # largest prefill chunk per request per step; 0 = the batched-token budget
    # DeepInfer's prefill vote (None: not modelled, prompts start at any step). A rank that is decoding admits new
    # prompts only at vote points, every `vote_every_any` (one rank's prompt wins) or `vote_every_all` decode steps
    # (every rank must want one; the sim, which sees only its own rank, counts its own want), and each vote point
    # adds `vote_ms` to its step, an all-reduce over the DP group. A rank with nothing decoding admits at once.
    vote_ms: float | None = None
    vote_every_all: int = 1
    vote_every_any: int = 1
    script_seed: int = 0  # the checkpoint's (sim_config.py `script_seed`)
    rank: int = 0


class _Seq:
    __slots__ = (
        "generated",
        "grammar",
        "grammar_params",
        "max_tokens",
        "offset",
        "plan",
        "prompt_left",
        "prompt_len",
        "rid",
        "sampler",
        "scheduled",
        "taken",
    )

    def __init__(self, rid: int, prompt_len: int, max_tokens: int, plan: list[int], offset: int) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.prompt_left = prompt_len
        self.max_tokens = max_tokens
        self.plan = plan  # scripted tokens; past its end the corpus continues (ignore_eos)
        self.offset = offset
        self.generated = 0
        self.sampler: Sampler | None = None  # requests with logprobs: sampled token by token
        # For the server's TTFT breakdown (CLOCK_MONOTONIC s): taken from the ring, first prefill chunk's step start.
        self.taken = time.perf_counter()
        self.scheduled = 0.0
        self.grammar: GrammarRun | None = None  # requests with a constraint (so_args)
        self.grammar_params: tuple[random.Random, float, int, float, int | None] | None = None


class SimEngine:
    """One rank's simulated engine. Not thread-safe: the rank loop owns it."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        vocab = Vocabulary.load(cfg.tokenizer_path)
        self.max_id = vocab.vocab_size - 1
        self.script = Script(cfg.tokenizer_path, vocab, cfg.script_seed)
        self.eos, self.corpus = self.script.eos, self.script.corpus
        self.vocab = Spelling(vocab)
        self._grammars: SimGrammars | None = None  # built on the first constrained request
        self.waiting: deque[_Seq] = deque()
        # Admitted requests, split so a step's batch is one list concatenation: past their prompt (decoding), and
        # still in prefill, in admission order (chunked prefill serves them in that order).
        self.decoding: list[_Seq] = []
        self.prefilling: list[_Seq] = []
        self.by_id: dict[int, _Seq] = {}
        self._batch: list[_Seq] = []
        # The last step gave no request its first token and ended none: the rank need not wake the server for it.
        self.quiet_step = False
        self._next_start = 0.0
        self._steps = 0  # group steps taken (idle rides included), for the vote points
        self._step_t0 = 0.0  # when the step being planned starts
        self._firsts: list[tuple[int, float, float]] = []  # see first_token_times
        self._prompt_logprobs: dict[int, list[float]] = {}  # asked for, until the request's first token

    # -- request side --------------------------------------------------------------------------------------------
    def add(self, req: Submit) -> list[Output]:
        prompt = req.prompt
        if not prompt:
            return [failed(req.request_id, "empty prompt")]
        if max(prompt) > self.max_id:  # IDs come off the ring as u32: never negative
            return [failed(req.request_id, "prompt contains a token id outside the vocabulary")]
        n_prompt = len(prompt) + (req.images.extra_tokens if req.images is not None else 0)
        if n_prompt >= self.cfg.max_model_len:
            return [failed(req.request_id, "prompt_length_exceeded")]
        max_tokens = max(1, min(req.max_tokens, self.cfg.max_model_len - n_prompt))
        script = self.script
        rng = script.rng(req)
        plan = script.plan(prompt, rng, req.ignore_eos)
        if req.images is not None and script.wants_images(prompt):
            plan = script.describe(req.images) + ([] if req.ignore_eos else [self.eos])
        seq = _Seq(req.request_id, n_prompt, max_tokens, plan, rng.randrange(1 << 30))
        if req.logprobs is not None:
            seq.sampler = Sampler(self.vocab, plan, script.free_text(plan), req, random.Random(rng.getrandbits(64)))
        if req.so_args is not None:
            if self._grammars is None:
                self._grammars = SimGrammars(self.cfg.tokenizer_path, self.eos, self.vocab)
            run = self._grammars.run(req.so_args)
            if isinstance(run, str):
                log.warning("request %d: grammar failed to compile: %s", req.request_id, run)
                return [failed(req.request_id, GRAMMAR_FAILED)]
            seq.grammar = run
            grng = random.Random(rng.getrandbits(64))
            seq.grammar_params = (grng, req.temperature, req.top_k, req.top_p, req.logprobs)
        if req.prompt_logprobs:
            # As DeepInfer: one per prompt token after the first (an image's expansion included), with the first
            # token. The sim's prompt holds one placeholder per image: it scores its expansion as that token.
            expanded = prompt + [prompt[-1]] * (n_prompt - len(prompt))
            self._prompt_logprobs[req.request_id] = prompt_logprobs(expanded, req.temperature)
        self.waiting.append(seq)
        self.by_id[req.request_id] = seq
        return []

    def abort(self, request_ids: list[int]) -> None:
        gone = {rid for rid in request_ids if self.by_id.pop(rid, None) is not None}
        for rid in gone:
            self._prompt_logprobs.pop(rid, None)
        if gone:
            self._batch = [s for s in self._batch if s.rid not in gone]
            self.waiting = deque(s for s in self.waiting if s.rid not in gone)
            self.decoding = [s for s in self.decoding if s.rid not in gone]
            self.prefilling = [s for s in self.prefilling if s.rid not in gone]

    def reload(self, model_path: str) -> None:
        """Serve the checkpoint in `model_path`: its script (the server checked its tokenizer is the one served).
        Built whole before it replaces the old one, so a checkpoint that fails to load leaves the old one served."""
        seed = script_seed(model_path, self.cfg.rank)
        tokenizer = str(Path(model_path) / "tokenizer.json")
        script = Script(tokenizer, Vocabulary.load(tokenizer), seed)
        self.script, self.eos, self.corpus = script, script.eos, script.corpus

    def has_work(self) -> bool:
        return bool(self.decoding or self.prefilling or self.waiting)

    def load(self) -> tuple[int, int]:
        queued = sum(s.prompt_left for s in self.waiting) + sum(s.prompt_left for s in self.prefilling)
        return len(self.decoding) + len(self.prefilling) + len(self.waiting), queued

    def kv_usage(self) -> float:
        """Share of the KV cache (max_num_seqs x max_model_len token slots) the running requests hold."""
        held = sum(s.prompt_len - s.prompt_left + s.generated for s in (*self.decoding, *self.prefilling))
        return min(1.0, held / self.kv_capacity_tokens())

    def kv_capacity_tokens(self) -> int:
        return self.cfg.max_num_seqs * self.cfg.max_model_len

    def close(self) -> None:
        self.waiting.clear()
        self.decoding.clear()
        self.prefilling.clear()
        self.by_id.clear()
        self._prompt_logprobs.clear()

    # -- one step ------------------------------------------------------------------------------------------------
    def step(self) -> list[Published]:
        start = self.step_start()
        cost = self.plan()
        self.wait_until(start, cost)
        self.step_done(start, cost)
        return self.commit()

    def step_start(self) -> float:
        """When the next step starts: back to back with the previous one if the rank loop's own work between
        steps took less than a millisecond, so that work and sleep overshoot do not stretch the step period."""
        now = time.perf_counter()
        self._step_t0 = self._next_start if 0.0 <= now - self._next_start < ANCHOR_SLACK_S else now
        return self._step_t0

    def plan(self) -> float:
        """Schedule the next step (admission, decode batch, prefill chunks) and return its cost in ms."""
        cfg = self.cfg
        decoding, prefilling = self.decoding, self.prefilling
        vote_ms, admit = self._vote()
        while admit and self.waiting and len(decoding) + len(prefilling) < cfg.max_num_seqs:  # into the next step
            prefilling.append(self.waiting.popleft())
        if not decoding and not prefilling:
            self._batch = []
            return vote_ms
        budget = cfg.max_num_batched_tokens - len(decoding)
        prefill_tokens = 0
        prefilled = []
        for s in prefilling:  # chunked prefill in admission order, within the batched-token budget
            if budget <= 0:
                break
            take = min(s.prompt_left, budget, cfg.prefill_chunk_tokens or s.prompt_left)
            if s.prompt_left == s.prompt_len:
                s.scheduled = self._step_t0  # the step that carries its prefill (its first chunk) starts
            s.prompt_left -= take
            budget -= take
            prefill_tokens += take
            if not s.prompt_left:
                prefilled.append(s)  # prefill ends with the request's first token
                self._firsts.append((s.rid, s.taken, s.scheduled))
        self.quiet_step = not prefilled
        if prefilled:
            self.prefilling = [s for s in prefilling if s.prompt_left]
        # Everything in this step's batch decodes from now on.
        self._batch = self.decoding = decoding + prefilled
        decode_ms = cfg.decode_step_ms + cfg.decode_ms_per_seq * len(decoding)
        prefill_ms = prefill_tokens * cfg.prefill_ms_per_1k_tokens / 1000.0
        # overlap: a step is bound by the slower of memory-bound decode and compute-bound prefill (roofline);
        # otherwise prefill adds to the step.
        return vote_ms + (max(decode_ms, prefill_ms) if cfg.overlap_prefill else decode_ms + prefill_ms)

    def _vote(self) -> tuple[float, bool]:
        """This step's vote cost, and whether waiting prompts may start in it."""
        cfg = self.cfg
        if cfg.vote_ms is None:
            return 0.0, True
        self._steps += 1
        votes = (self._steps % cfg.vote_every_all == 0) + (self._steps % cfg.vote_every_any == 0)
        return votes * cfg.vote_ms, votes > 0 or not self.decoding

    def first_token_times(self) -> list[tuple[int, float, float]]:
        """(request, taken, step start) of the first tokens of the step just committed, once each."""
        out, self._firsts = self._firsts, []
        return out

    def ride_along(self) -> None:
        """An idle rank's step in lockstep: it still counts toward the group's vote points."""
        if self.cfg.vote_ms is not None:
            self._steps += 1

    def step_done(self, start: float, cost_ms: float) -> None:
        """Record a step run outside `step` (the lockstep loop), for `step_start`."""
        self._next_start = start + cost_ms / 1000.0

    def commit(self) -> list[Published]:
        """Emit the tokens of the step `plan` scheduled: the plain rows as one StepOutputs (three columns appended
        to, one record per step), rows with logprobs or an error as Output records."""
        out: list[Output] = []
        rids: list[int] = []
        toks: list[int] = []
        fins: list[int] = []
        finished = False
        corpus, n_corpus, eos, plps = self.corpus, len(self.corpus), self.eos, self._prompt_logprobs
        running, stop, length = _native.FINISH_NONE, _native.FINISH_STOP, _native.FINISH_LENGTH
        for s in self._batch:
            i = s.generated
            if s.grammar is not None:
                finished |= self._commit_constrained(s, out)
                continue
            if s.sampler is not None:
                finished |= self._commit_sampled(s, out)
                continue
            plan = s.plan
            tok = plan[i] if i < len(plan) else corpus[(s.offset + i) % n_corpus]
            s.generated = i + 1
            if i + 1 < s.max_tokens and (tok != eos or i >= len(plan)):
                finish = running
            else:
                finish = stop if tok == eos and i < len(plan) else length
                del self.by_id[s.rid]
                finished = True
            if plps and s.rid in plps:  # its first token, with the prompt's logprobs it asked for
                out.append(Output(request_id=s.rid, tokens=tok, finish=finish, prompt_logprobs=plps.pop(s.rid)))
                continue
            rids.append(s.rid)
            toks.append(tok)
            fins.append(finish)
        if finished:
            self.quiet_step = False
            self.decoding = [s for s in self.decoding if s.rid in self.by_id]
        self._batch = []
        if plps:
            out = [self._with_prompt_logprobs(row) for row in out]
        published: list[Published] = list(out)
        if rids:
            published.append(StepOutputs(request_ids=rids, tokens=toks, finishes=fins))
        return published

    def _with_prompt_logprobs(self, row: Output) -> Output:
        """A request's first output row, with the prompt's logprobs it asked for."""
        values = self._prompt_logprobs.pop(row.request_id, None)
        if values is None:
            return row
        rid, tokens, finish, reason, logprobs = row.request_id, row.tokens, row.finish, row.reason, row.logprobs
        return Output(
            request_id=rid, tokens=tokens, finish=finish, reason=reason, logprobs=logprobs, prompt_logprobs=values
        )

    def _commit_sampled(self, s: _Seq, out: list[Output]) -> bool:
        """One sampled token of a request with logprobs; True if it ended the request."""
        sampler = s.sampler
        assert sampler is not None
        s.generated += 1
        tok, lp, scripted_end = sampler.next(lambda j: self.corpus[(s.offset + j) % len(self.corpus)])
        eos_stop = tok == self.eos and scripted_end
        if s.generated < s.max_tokens and not eos_stop:
            out.append(Output(request_id=s.rid, tokens=tok, finish=_native.FINISH_NONE, logprobs=[lp]))
            return False
        finish = _native.FINISH_STOP if eos_stop else _native.FINISH_LENGTH
        out.append(Output(request_id=s.rid, tokens=tok, finish=finish, logprobs=[lp]))
        del self.by_id[s.rid]
        return True

    def _commit_constrained(self, s: _Seq, out: list[Output]) -> bool:
        """One token of a request with a grammar (engine/constrained.py); True if it ended the request."""
        run, params = s.grammar, s.grammar_params
        assert run is not None and params is not None
        rng, temperature, top_k, top_p, top = params
        corpus, plan = self.corpus, s.plan
        if s.generated == 0 and run.constrained:
            run.follow(plan)  # constrained from the first token
        i = s.generated
        s.generated += 1
        lp = None
        if not run.constrained:
            forced = run.forced
            if forced is not None:
                tok, lp = forced, (0.0, [(forced, 0.0)][: top or 0])
            elif s.sampler is not None:
                tok, lp, _ = s.sampler.next(lambda j: corpus[(s.offset + j) % len(corpus)])
            else:
                tok = plan[i] if i < len(plan) else corpus[(s.offset + i) % len(corpus)]
            run.free(tok)
            if run.constrained:
                run.follow(plan[s.sampler.cursor if s.sampler is not None else s.generated :])
            end = tok == self.eos
        else:
            hint = run.hint()
            if hint is None:
                hint = corpus[(s.offset + i) % len(corpus)]
            got = run.choose(hint, rng, temperature, top_k, top_p, top)
            if got is None or not run.accept(got[0]):
                out.append(failed(s.rid, GRAMMAR_FAILED))
                del self.by_id[s.rid]
                return True
            tok, lp = got
            end = tok == self.eos
        logprobs = [lp] if top is not None and lp is not None else None
        if s.generated < s.max_tokens and not end:
            out.append(Output(request_id=s.rid, tokens=tok, finish=_native.FINISH_NONE, logprobs=logprobs))
            return False
        finish = _native.FINISH_STOP if end else _native.FINISH_LENGTH
        out.append(Output(request_id=s.rid, tokens=tok, finish=finish, logprobs=logprobs))
        del self.by_id[s.rid]
        return True

    @staticmethod
    def wait_until(t0: float, cost_ms: float) -> None:
        """Take `cost_ms` of wall time for the step, as the GPU would (sleeping, not spinning)."""
        if cost_ms > 0:
            left = t0 + cost_ms / 1000.0 - time.perf_counter()
            if left > 0:
                time.sleep(left)
