"""Several frontends on one engine core (--api-server-count), piece by piece without a server: the engine core sends
each answer to the frontend its id names, a frontend restarted at one index leaves the others' requests alone, the
metrics a scrape reaches are every frontend's summed, and a LoRA adapter one frontend loads is seen by the others.
(Through a real `metrale serve`: test_api_servers_e2e.py.)"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from metrale.engine_core.frontend_links import FrontendLinks
from metrale.engine_core.output_ledger import OutputLedger
from metrale.frontend.metrics import Metrics
from metrale.frontend.served_state import StateFile
from metrale.ipc.frontend_ids import frontend_of_prefix, new_prefix
from metrale.ipc.messages import AddRequest, EngineOutput, EngineReady, EngineStats, RequestOutputDelta, StatsResponse
from metrale.ipc.sampling import SamplingParams

WAIT_MS = 5000


def test_a_prefix_names_its_frontend_and_is_fresh_each_start():
    assert frontend_of_prefix(new_prefix(0)) == 0 and "." not in new_prefix(0)  # as with one frontend
    assert frontend_of_prefix(new_prefix(3)) == 3
    assert new_prefix(1) != new_prefix(1)
    assert frontend_of_prefix("abc.x") == 0  # a prefix that names no index goes to frontend 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def two_frontends(tmp_path):
    """The engine core's FrontendLinks to two frontends' PULL sockets (bound as a frontend binds them)."""
    ctx = zmq.Context()
    pulls = []
    addresses = []
    for i in range(2):
        out = f"ipc://{tmp_path}/out{i}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(out)
        pulls.append(pull)
        addresses.append((f"ipc://{tmp_path}/in{i}", out))
    clock = Clock()
    links = FrontendLinks(ctx, addresses, heartbeat_s=0.5, clock=clock)
    try:
        yield links, pulls, clock
    finally:
        links.close()
        for pull in pulls:
            pull.close(0)
        ctx.term()


def _received(pull: zmq.Socket) -> EngineOutput:
    assert pull.poll(WAIT_MS), "nothing came"
    return msgspec.msgpack.decode(pull.recv(), type=EngineOutput)


def _nothing_waits(pulls: list[zmq.Socket]) -> None:
    """No frame is queued for any frontend (the sender's sends are done by the time poll looks: same host, ipc)."""
    assert [p.poll(50) for p in pulls] == [0, 0]


def test_each_output_goes_to_the_frontend_its_id_names(two_frontends):
    links, pulls, clock = two_frontends
    a, b = new_prefix(0), new_prefix(1)
    clock.now = 0.1  # no heartbeat is due
    links.send_outputs([RequestOutputDelta(f"{a}-0", [1]), RequestOutputDelta(f"{b}-0", [2]),
                        RequestOutputDelta(f"{b}-1", [3])], None)
    first, second = _received(pulls[0]), _received(pulls[1])
    assert [o.request_id for o in first.outputs] == [f"{a}-0"]
    assert [o.request_id for o in second.outputs] == [f"{b}-0", f"{b}-1"]
    _nothing_waits(pulls)


def test_a_frontend_without_outputs_gets_its_heartbeat_when_due(two_frontends):
    links, pulls, clock = two_frontends
    b = new_prefix(1)
    clock.now = 0.1
    links.send_outputs([RequestOutputDelta(f"{b}-0", [2])], None)
    assert _received(pulls[1]).outputs
    _nothing_waits(pulls)  # frontend 0 heard from the engine core less than heartbeat_s ago
    clock.now = 0.7
    links.send_outputs([RequestOutputDelta(f"{b}-0", [3])], None)
    assert _received(pulls[0]).outputs == [], "frontend 0's heartbeat"
    assert _received(pulls[1]).outputs


def test_answers_go_to_who_asked_and_readiness_to_all(two_frontends):
    links, pulls, _ = two_frontends
    probe = f"{new_prefix(1)}-ready"  # a restarted frontend's probe: the engine core never heard of its prefix
    links.answer(probe, StatsResponse(id=probe, stats=EngineStats()))
    assert _received(pulls[1]).id == probe
    links.broadcast(EngineReady(vocab_size=8, max_model_len=16, num_kv_blocks=4, block_size=16))
    assert all(isinstance(_received(p), EngineReady) for p in pulls)
    _nothing_waits(pulls)


def test_a_frontend_whose_connection_dropped_is_down_until_one_connects_again(two_frontends, tmp_path):
    links, pulls, _ = two_frontends
    zero, one = f"{new_prefix(0)}-0", f"{new_prefix(1)}-0"
    endpoint = pulls[1].getsockopt_string(zmq.LAST_ENDPOINT)
    links.answer(one, StatsResponse(id=one, stats=EngineStats()))
    assert _received(pulls[1]).id == one  # connected
    assert not links.is_down(one)
    pulls[1].close(0)  # frontend 1 dies
    _until(lambda: links.is_down(one), "frontend 1 is seen down")
    assert not links.is_down(zero)
    successor = zmq.Context.instance().socket(zmq.PULL)
    try:
        successor.bind(endpoint)
        _until(lambda: not links.is_down(one), "frontend 1's successor is seen connected")
    finally:
        successor.close(0)


def _until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll a condition the engine core's I/O thread makes true (a socket event), with a deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not seen in time: {what}"
        time.sleep(0.005)


def _add(request_id: str, key: str | None = None) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=[1], params=SamplingParams(), resume_key=key)


def test_a_frontend_restarted_at_one_index_leaves_the_others_requests_alone():
    """Frontend 1 comes back with a new prefix: its predecessor's plain request is aborted and its resumable one
    counted down; frontend 0's, plain or resumable, run on for frontend 0."""
    book = OutputLedger(clock=Clock())
    zero, one_before, one_after = new_prefix(0), new_prefix(1), new_prefix(1)
    for msg in (_add(f"{zero}-0"), _add(f"{zero}-1", "k0"), _add(f"{one_before}-0"), _add(f"{one_before}-1", "k1")):
        book.added(msg)
    assert book.frontend_up(one_after) == [f"{one_before}-0"]
    assert book.attach(AddRequest(request_id=f"{one_after}-5", prompt_token_ids=[1], params=SamplingParams(),
                                  resume_key="k1", reattach="only")) is not None, "frontend 1's own to re-attach"
    assert book.attach(AddRequest(request_id=f"{one_after}-6", prompt_token_ids=[1], params=SamplingParams(),
                                  resume_key="k0", reattach="only")) is None, "frontend 0 still streams it"
    assert book.frontend_up(new_prefix(0)) == [f"{zero}-0"], "frontend 0's plain request waited for its own successor"


def test_another_frontend_reattaches_a_dead_frontends_request_before_its_successor_is_up():
    book = OutputLedger(clock=Clock())
    zero, one = new_prefix(0), new_prefix(1)
    book.added(_add(f"{one}-0", "k"))
    retry = AddRequest(request_id=f"{zero}-7", prompt_token_ids=[1], params=SamplingParams(), resume_key="k",
                       reattach="or_start")
    assert book.attach(retry) is None, "frontend 1 lives (as far as anyone knows): it streams the request"
    caught_up = book.attach(retry, gone=lambda sent_as: sent_as.startswith(one + "-"))
    assert caught_up is not None and caught_up.request_id == f"{zero}-7"
    out = [RequestOutputDelta(f"{one}-0", [4])]  # the engine core runs it under its first id
    book.record(out)
    assert out[0].request_id == f"{zero}-7", "its outputs now go to frontend 0"
    assert book.frontend_up(new_prefix(1)) == [], "frontend 1's successor finds nothing of its predecessor's left"


def _families(text: bytes) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_a_scrape_sums_every_frontends_counters_and_shows_each_ones_requests():
    zero, one = Metrics(api_server=0), Metrics(api_server=1)
    zero.finished("length", 3, 5, 0.2)
    one.finished("length", 4, 6, 0.3)
    one.finished("stop", 1, 1, 0.1)
    one.next_tokens(0.01)
    got = _families(zero.render(others=[one.own_families()]))
    assert got["metrale_requests_total"][(("finish_reason", "length"),)] == 2
    assert got["metrale_requests_total"][(("finish_reason", "stop"),)] == 1
    assert got["metrale_prompt_tokens_total"][()] == 8 and got["metrale_generation_tokens_total"][()] == 12
    assert got["metrale_e2e_request_latency_seconds_count"][()] == 3
    assert got["metrale_inter_token_latency_seconds_count"][()] == 1
    assert got["metrale_api_server_requests_total"] == {(("api_server", "0"),): 1, (("api_server", "1"),): 2}
    alone = _families(zero.render())  # one frontend: its own, unchanged
    assert alone["metrale_requests_total"][(("finish_reason", "length"),)] == 1


def test_an_adapter_one_frontend_loads_is_seen_by_the_other_and_changes_are_not_lost(tmp_path):
    path = str(tmp_path / "state.json")
    zero, one = StateFile(path), StateFile(path)
    start = {"base-lora": "/a"}
    assert one.if_changed() is None, "nothing changed yet"
    assert zero.update(start, "late", "/b") == {"base-lora": "/a", "late": "/b"}
    assert one.if_changed().adapters == {"base-lora": "/a", "late": "/b"}
    assert one.if_changed() is None, "seen once"
    assert one.update(start, "other", "/c") == {"base-lora": "/a", "late": "/b", "other": "/c"}, "zero's kept"
    assert zero.update(start, "base-lora", "") == {"late": "/b", "other": "/c"}
    assert one.if_changed().adapters == {"late": "/b", "other": "/c"}
    assert StateFile(path).load().adapters == {"late": "/b", "other": "/c"}, "what a restarted frontend reads"
