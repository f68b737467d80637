"""The simulated engine's scheduler on its own: admission, chunked prefill within the batched-token budget, the
first token at the end of prefill, the step cost model and aborts. (Over HTTP the same engine is checked by the
other suites; here each step's batch and cost is visible.)"""

from __future__ import annotations

from deepinfer_server import _native
from deepinfer_server.engine.base import Submit
from deepinfer_server.engine.base import rows as output_rows
from deepinfer_server.engine.sim import SimConfig, SimEngine
from deepinfer_server.launcher import BUNDLED_TOKENIZER


def engine(max_num_seqs: int = 2, max_num_batched_tokens: int = 100) -> SimEngine:
    """1 ms decode steps and 10 ms of prefill per 1k prompt tokens."""
    return SimEngine(
        SimConfig(
            tokenizer_path=str(BUNDLED_TOKENIZER),
            max_model_len=4096,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            decode_step_ms=1.0,
            prefill_ms_per_1k_tokens=10.0,
        )
    )


def submit(e: SimEngine, rid: int, prompt_len: int, max_tokens: int = 50) -> None:
    prompt = [100 + i % 50 for i in range(prompt_len)]
    assert e.add(Submit(rid, prompt, max_tokens, 1.0, 1.0, -1, 7, True)) == []


def step(e: SimEngine) -> tuple[float, dict[int, int]]:
    """One step: (its cost in ms, request id -> finish code of the token it got)."""
    cost = e.plan()
    out = output_rows(e.commit())  # a StepOutputs' rows too
    assert all(len(o.tokens) == 1 for o in out), "one token per request per step"
    return cost, {o.request_id: o.finish for o in out}


def test_chunked_prefill_admission_and_costs() -> None:
    e = engine()
    submit(e, 1, 150)
    submit(e, 2, 30)
    submit(e, 3, 10)
    assert e.load() == (3, 190)

    cost, out = step(e)  # 1 and 2 admitted (two sequences at most); 1 takes the whole 100-token budget
    assert out == {} and cost == 1.0 + 100 * 10 / 1000
    assert e.load() == (3, 90)

    cost, out = step(e)  # 1 finishes its prompt (50), 2 prefills in the same step (30): both get a first token
    assert out == {1: _native.FINISH_NONE, 2: _native.FINISH_NONE} and cost == 1.0 + 80 * 10 / 1000

    cost, out = step(e)  # 3 still waits for a free sequence slot
    assert out == {1: _native.FINISH_NONE, 2: _native.FINISH_NONE} and cost == 1.0
    assert e.load() == (3, 10)

    e.abort([1])
    cost, out = step(e)  # 3 takes 1's slot at once and its 10-token prompt fits next to 2's decode
    assert out == {2: _native.FINISH_NONE, 3: _native.FINISH_NONE} and cost == 1.0 + 10 * 10 / 1000
    assert e.load() == (2, 0)


def test_decoding_requests_go_first_and_prefill_gets_what_is_left() -> None:
    e = engine(max_num_seqs=8, max_num_batched_tokens=20)
    for rid in range(4):
        submit(e, rid, 1)
    step(e)  # four one-token prompts: four first tokens
    submit(e, 9, 40)
    budgets = []
    while 9 not in step(e)[1]:
        budgets.append(e.load()[1])
    assert budgets == [24, 8], "16 prompt tokens a step: the budget less the four decoding requests"


def test_max_tokens_ends_with_length_and_frees_the_slot() -> None:
    e = engine(max_num_seqs=1)
    submit(e, 1, 5, max_tokens=2)
    submit(e, 2, 5, max_tokens=1)
    assert step(e)[1] == {1: _native.FINISH_NONE}
    assert step(e)[1] == {1: _native.FINISH_LENGTH}
    assert step(e)[1] == {2: _native.FINISH_LENGTH}
    assert not e.has_work()
    assert step(e) == (0.0, {})


def test_an_aborted_request_in_prefill_or_waiting_never_gets_a_token() -> None:
    e = engine(max_num_seqs=1, max_num_batched_tokens=10)
    submit(e, 1, 30)
    submit(e, 2, 5)
    step(e)  # 1 is part-way through its prompt, 2 waits
    e.abort([1, 2])
    assert not e.has_work()
    assert step(e) == (0.0, {})


def test_a_seeded_answer_is_the_same_every_time() -> None:
    outs = []
    for _ in range(2):
        e = engine(max_num_seqs=1)
        submit(e, 1, 20, max_tokens=300)  # longer than any planned answer: the corpus continues, wrapping around
        tokens = []
        while e.has_work():
            e.plan()
            tokens += [t for o in output_rows(e.commit()) for t in o.tokens]
        outs.append(tokens)
    assert len(outs[0]) == 300 and outs[0] == outs[1]


def test_quiet_steps_are_those_that_start_and_end_nothing() -> None:
    """The rank publishes a quiet step without waking the server (engine/loop.py): a step that gives a request its
    first token or ends one must never be quiet."""
    e = engine(max_num_seqs=4)
    submit(e, 1, 5, max_tokens=3)
    e.plan()
    e.commit()
    assert not e.quiet_step  # request 1's first token
    submit(e, 2, 5, max_tokens=3)
    e.plan()
    e.commit()
    assert not e.quiet_step  # request 2's first token
    e.plan()
    e.commit()
    assert not e.quiet_step  # request 1's third token ends it
    e.plan()
    e.commit()
    assert not e.quiet_step  # request 2 ends
    submit(e, 3, 5, max_tokens=4)
    quiet = []
    while e.has_work():
        e.plan()
        e.commit()
        quiet.append(e.quiet_step)
    assert quiet == [False, True, True, False]


def test_the_prefill_vote_admits_new_prompts_only_at_vote_points_and_costs_its_all_reduce() -> None:
    e = SimEngine(
        SimConfig(
            tokenizer_path=str(BUNDLED_TOKENIZER),
            max_model_len=4096,
            max_num_seqs=4,
            max_num_batched_tokens=100,
            decode_step_ms=1.0,
            vote_ms=0.5,
            vote_every_all=8,
            vote_every_any=4,
        )
    )
    submit(e, 1, 10)
    cost, out = step(e)  # step 1 is no vote point, but nothing decodes yet: the prompt starts at once
    assert out == {1: _native.FINISH_NONE} and cost == 1.0
    submit(e, 2, 10)
    firsts = []
    for n in range(2, 10):
        cost, out = step(e)
        votes = (n % 8 == 0) + (n % 4 == 0)
        assert cost == 1.0 + 0.5 * votes, n  # one all-reduce per vote point; at step 8 both votes fall
        if 2 in out:
            firsts.append(n)
    assert firsts[0] == 4, "request 2 waited for the step-4 vote while request 1 was decoding"
    e.ride_along()  # an idle rank's steps in lockstep still count (10, 11): its next step, 12, is a vote point
    e.ride_along()
    cost, _ = step(e)
    assert cost == 1.5


def test_without_the_vote_model_prompts_start_at_any_step() -> None:
    e = engine(max_num_seqs=4)
    submit(e, 1, 10)
    step(e)
    submit(e, 2, 10)
    _, out = step(e)
    assert 2 in out


def test_the_partial_prefill_gate_hands_prompts_to_the_engine_first_come_first_served() -> None:
    from deepinfer_server.engine.prefill_gate import PrefillGate

    g = PrefillGate(engine(max_num_seqs=8, max_num_batched_tokens=1000), limit=1)
    for rid in (1, 2, 3):
        submit(g, rid, 150)  # type: ignore[arg-type]
    assert g.load() == (3, 450) and len(g.waiting) == 2
    firsts = []
    for _ in range(6):
        cost, _ = step(g)  # type: ignore[arg-type]
        firsts += [rid for rid, _, _ in g.first_token_times()]
        assert cost <= 1.0 + 150 * 10 / 1000, "one prompt's prefill per step, never several side by side"
    assert firsts == [1, 2, 3]
    # A waiting request that is aborted never reaches the engine; the next one moves up.
    for rid in (4, 5, 6):
        submit(g, rid, 150)  # type: ignore[arg-type]
    g.abort([5])
    for _ in range(4):
        step(g)  # type: ignore[arg-type]
        firsts += [rid for rid, _, _ in g.first_token_times()]
    assert firsts[3:] == [4, 6] and not g.waiting


def test_the_gate_reports_when_the_rank_took_a_request_not_when_it_let_it_through() -> None:
    from deepinfer_server.engine.prefill_gate import PrefillGate

    g = PrefillGate(engine(max_num_seqs=8, max_num_batched_tokens=1000), limit=1)
    submit(g, 1, 150)  # type: ignore[arg-type]
    submit(g, 2, 150)  # type: ignore[arg-type]
    held_since = g.taken[2]
    times = {}
    for _ in range(3):
        g.step_start()  # as the rank loop does: the step's start is what `scheduled` reports
        step(g)  # type: ignore[arg-type]
        times.update({rid: (taken, scheduled) for rid, taken, scheduled in g.first_token_times()})
    assert times[2][0] == held_since < times[2][1], "its wait in the gate comes before the step that prefills it"
    assert not g.taken
