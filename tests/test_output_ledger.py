"""The engine core's OutputLedger (engine_core/output_ledger.py): what a restarted frontend re-attaches to."""

from __future__ import annotations

from metrale.engine_core.output_ledger import OutputLedger
from metrale.ipc.messages import AddRequest, RequestOutputDelta, TokenLogprob
from metrale.ipc.sampling import SamplingParams
from metrale.testing.fake_device import FakeClock


def add(request_id: str, key: str | None = None, reattach: str | None = None) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=[1, 2], params=SamplingParams(), resume_key=key,
                      reattach=reattach)


def out(request_id: str, ids: list[int], finish: str | None = None, **kw) -> RequestOutputDelta:
    return RequestOutputDelta(request_id, ids, finish, **kw)


def ledger() -> tuple[OutputLedger, FakeClock]:
    clock = FakeClock()
    return OutputLedger(clock=clock, window_s=30.0, max_finished=3), clock


def test_a_reattach_gets_every_token_so_far_then_its_outputs_under_the_new_id():
    book, _ = ledger()
    book.added(add("a-0", "k"))
    book.record([out("a-0", [5, 6], logprobs=[TokenLogprob(5, -0.1), TokenLogprob(6, -0.2)]), out("a-0", [7])])
    assert book.frontend_up("b") == []
    catch_up = book.attach(add("b-0", "k", "only"))
    assert catch_up.request_id == "b-0" and catch_up.new_token_ids == [5, 6, 7] and catch_up.finish_reason is None
    assert [lp.token_id for lp in catch_up.logprobs] == [5, 6]
    later = [out("a-0", [8], "length")]
    book.record(later)
    assert later[0].request_id == "b-0", "the engine core's id is rewritten to the one the frontend knows"
    assert book.engine_id("b-0") == "a-0", "an abort from the new frontend reaches the running request"


def test_a_request_that_ended_while_no_frontend_listened_is_answered_whole():
    book, _ = ledger()
    book.added(add("a-0", "k"))
    book.record([out("a-0", [5]), out("a-0", [6], "stop", num_cached_tokens=0)])
    catch_up = book.attach(add("b-3", "k", "only"))
    assert (catch_up.new_token_ids, catch_up.finish_reason) == ([5, 6], "stop")


def test_a_running_request_of_a_live_frontend_is_not_taken_from_it():
    book, _ = ledger()
    book.added(add("a-0", "k"))
    book.record([out("a-0", [5])])
    assert book.attach(add("a-1", "k", "or_start")) is None
    assert book.added(add("a-1", "k")) == "a-0", "a new request under the same key replaces it (the old is aborted)"


def test_plain_requests_of_a_dead_frontend_are_aborted_when_the_next_comes_up():
    book, _ = ledger()
    book.added(add("a-0"))
    book.added(add("a-1", "k"))
    book.added(add("b-0"))
    assert book.frontend_up("b") == ["a-0"]


def test_a_resumable_request_nobody_reattaches_is_aborted_after_the_window():
    book, clock = ledger()
    book.added(add("a-0", "k"))
    book.frontend_up("b")
    clock.advance(29.0)
    assert book.expire() == []
    clock.advance(2.0)
    assert book.expire() == ["a-0"]
    assert book.attach(add("b-0", "k", "only")) is None and len(book) == 0


def test_an_aborted_request_is_not_held():
    book, _ = ledger()
    book.added(add("a-0", "k"))
    book.aborted("a-0")
    book.frontend_up("b")
    assert book.attach(add("b-0", "k", "or_start")) is None and len(book) == 0


def test_finished_requests_are_bounded():
    book, _ = ledger()
    for i in range(5):
        book.added(add(f"a-{i}", f"k{i}"))
        book.record([out(f"a-{i}", [i], "length")])
    book.expire()
    assert len(book) == 3
    assert book.attach(add("b-0", "k0", "only")) is None and book.attach(add("b-4", "k4", "only")) is not None
