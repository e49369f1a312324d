"""AsyncClients share one zmq context: closing one client closes its socket only, the others keep working."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from metrale.frontend.async_client import AsyncClient, shared_context
from metrale.ipc.messages import ClientMessage, Health, HealthQuery

WAIT_S = 10.0


async def answer_health(router: zmq.asyncio.Socket, n: int) -> None:
    """A stand-in server: answer n health queries, each with healthy=True."""
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    for _ in range(n):
        identity, frame = await router.recv_multipart()
        msg = decoder.decode(frame)
        assert isinstance(msg, HealthQuery)
        await router.send_multipart([identity, msgspec.msgpack.encode(Health(id=msg.id, healthy=True))])


def run_with_server(body, queries: int) -> None:
    """Run body(address) on a fresh event loop beside a stand-in server bound to a free port."""

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            port = router.bind_to_random_port("tcp://127.0.0.1")
            server = asyncio.ensure_future(answer_health(router, queries))
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
