"""AsyncClient against a stand-in ROUTER.

Clients share one zmq context: closing one client closes its socket only, the others keep working. And the
client reads its socket through ZeroMQ's edge-triggered descriptor: no frame may be left unread, whether many
arrive under one wake-up of the descriptor or they interleave with the client's own sends (a send can consume
the descriptor's edge).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from metrale.frontend.async_client import AsyncClient, shared_context
from metrale.frontend.client_protocol import ClientClosed
from metrale.ipc.messages import Abort, ClientMessage, Delta, Generate, Health, HealthQuery

WAIT_S = 10.0
BURST = 500


async def answer_health(router: zmq.asyncio.Socket, n: int) -> None:
    """A stand-in server: answer n health queries, each with healthy=True."""
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    for _ in range(n):
        identity, frame = await router.recv_multipart()
        msg = decoder.decode(frame)
        assert isinstance(msg, HealthQuery)
        await router.send_multipart([identity, msgspec.msgpack.encode(Health(id=msg.id, healthy=True))])


def run_with_server(body, queries: int = 0, serve=None) -> None:
    """Run body(address) on a fresh event loop beside a stand-in server bound to a free port: serve(router),
    or one answering `queries` health queries."""

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            port = router.bind_to_random_port("tcp://127.0.0.1")
            server = asyncio.ensure_future(serve(router) if serve else answer_health(router, queries))
            await asyncio.wait_for(body(f"tcp://127.0.0.1:{port}"), WAIT_S)
            await asyncio.wait_for(server, WAIT_S)
        finally:
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_clients_share_one_context_and_closing_one_spares_the_others():
    async def body(address: str) -> None:
        a = AsyncClient(address=address, timeout=WAIT_S)
        b = AsyncClient(address=address, timeout=WAIT_S)
        assert a._sock.context is b._sock.context is shared_context()
        assert (await a.health()).healthy
        await a.close()
        assert a._sock.closed and not shared_context().closed
        assert (await b.health()).healthy  # b's socket and the context still work
        await b.close()
        async with AsyncClient(address=address, timeout=WAIT_S) as c:  # and a client made afterwards
            assert (await c.health()).healthy

    run_with_server(body, queries=3)


def test_many_clients_leave_no_open_socket():
    """Fifty clients on two event loops, each closed: every socket they opened is closed."""
    sockets = []

    async def body(address: str) -> None:
        clients = [AsyncClient(address=address, timeout=WAIT_S) for _ in range(25)]
        sockets.extend(c._sock for c in clients)
        answers = await asyncio.gather(*(c.health() for c in clients))
        assert all(h.healthy for h in answers)
        await asyncio.gather(*(c.close() for c in clients))

    run_with_server(body, queries=25)
    run_with_server(body, queries=25)  # a second asyncio.run: the shared context serves a new loop too
    assert len(sockets) == 50 and all(s.closed for s in sockets)
    assert not shared_context().closed


def test_a_terminated_shared_context_is_replaced():
    """Should anything terminate the shared context, the next client gets a fresh one."""
    old = shared_context()
    old.term()
    fresh = shared_context()
    assert fresh is not old and not fresh.closed

    async def body(address: str) -> None:
        async with AsyncClient(address=address, timeout=WAIT_S) as c:
            assert (await c.health()).healthy

    run_with_server(body, queries=1)


def _delta(request_id: str, i: int, final: bool = False) -> bytes:
    return msgspec.msgpack.encode(Delta(id=request_id, token_ids=[i], finish_reason="length" if final else None))


async def burst_then_interleave(router: zmq.asyncio.Socket) -> None:
    """Request "a": BURST deltas at once, but its final one only after request "b" arrives; "b": three deltas."""
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    identity, frame = await router.recv_multipart()
    assert isinstance(decoder.decode(frame), Generate)
    for i in range(BURST):
        await router.send_multipart([identity, _delta("a", i)])
    identity, frame = await router.recv_multipart()
    msg = decoder.decode(frame)
    assert isinstance(msg, Generate) and msg.id == "b"
    await router.send_multipart([identity, _delta("a", BURST, final=True)])
    for i in range(3):
        await router.send_multipart([identity, _delta("b", i, final=i == 2)])


async def stream_tokens(client: AsyncClient, request_id: str, started: asyncio.Event | None = None) -> list[int]:
    """Every token of one request, in order; sets started on its first delta."""
    tokens = []
    async for delta in client.generate(token_ids=[1, 2, 3], request_id=request_id):
        tokens.extend(delta.token_ids)
        if started is not None:
            started.set()
    return tokens


def test_a_burst_and_interleaved_sends_lose_no_frame():
    async def body(address: str) -> None:
        async with AsyncClient(address=address, timeout=WAIT_S) as client:
            started = asyncio.Event()
            a = asyncio.ensure_future(stream_tokens(client, "a", started))
            await asyncio.wait_for(started.wait(), WAIT_S)
            b = await asyncio.wait_for(stream_tokens(client, "b"), WAIT_S)
            assert await asyncio.wait_for(a, WAIT_S) == list(range(BURST + 1))
            assert b == [0, 1, 2]

    run_with_server(body, serve=burst_then_interleave)


def test_an_abort_before_any_request_is_sent_and_a_closed_client_refuses_to_send():
    got = []
    arrived = asyncio.Event()  # made outside a loop: bound to asyncio.run's loop on first use (3.10+)

    async def take_one(router: zmq.asyncio.Socket) -> None:
        _, frame = await router.recv_multipart()
        got.append(msgspec.msgpack.Decoder(ClientMessage).decode(frame))
        arrived.set()

    async def body(address: str) -> None:
        client = AsyncClient(address=address, timeout=WAIT_S)
        await client.abort("never-started")
        await asyncio.wait_for(arrived.wait(), WAIT_S)  # closing first would drop the queued frame (linger 0)
        await client.close()
        with pytest.raises(ClientClosed):
            await client.abort("after-close")

    run_with_server(body, serve=take_one)
    assert len(got) == 1 and isinstance(got[0], Abort) and got[0].id == "never-started"
