"""The soak's traffic on the simulated device: `concurrency` closed-loop ZMQ streams, every request checked against
the tokens the simulated device gives its prompt.

Each stream is a loop: draw a request (from the stream's own seeded generator, so its requests are the same
whatever the timing), send it through one of `clients` AsyncClients, read it to its end (or leave after a few
tokens, as planned), judge it, draw the next. So `concurrency` requests are live at every moment, as in a GPU
server's full batch, however fast the device goes. On the simulated device a request's tokens are fixed by its
prompt, whatever its sampling (gpu_worker/sim_runner.py: each token a hash of the last three of its context), so
every stream is checked against `expected_tokens` and no replay run is needed; one its client left early is
checked as a prefix. A client whose connection to the frontend breaks and comes back (the frontend was killed and
restarted) re-attaches its live requests where each stream was (docs/protocol.md §5.6): a token received twice or
missed shows as a stream not equal to its expected tokens.

The mix: prompts of 16-512 ids (30 % open with one of four shared 256-id prefixes: the prefix cache), 16 to
`max_tokens` new tokens; greedy, seeded and unseeded sampling (45/40/15 %); a fifth with penalties (fed ahead);
a fifth that stop at the model's EOS (the rest ignore it, so they make exactly max_tokens); a tenth whose client
leaves after a few tokens (the client sends an Abort).

An Outcome is ok (read to its end; `equal` says whether its tokens and finish are the expected ones), aborted (its
client left as planned, or a client_reset fault closed its client), error (the server's typed Error, or a finish
its client did not ask for, such as "abort") or lost (no final answer by the deadline, or the client failed
without one). Not a benchmark of its own: scripts/soak.py drives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass

from _bench_common import FIRST_PLAIN_TOKEN

SAMPLINGS = (("greedy", 0.45), ("seeded", 0.4), ("free", 0.15))
NUM_PREFIXES, PREFIX_LEN = 4, 256
_MASK = (1 << 64) - 1
_M1, _M2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15  # sim_runner's constants


@dataclass(slots=True)
class StreamSpec:
    """One request of a stream."""

    idx: int  # its place in the phase (the order requests were drawn in)
    stream: int
    prompt: list[int]
    max_tokens: int
    sampling: str  # "greedy" | "seeded" | "free"
    penalties: bool
    ignore_eos: bool
    abort_after: int | None  # its client leaves after this many tokens (None: reads to the end)

    def params(self):
        from metrale.ipc.sampling import SamplingParams

        p = dict(max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)
        if self.sampling == "greedy":
            p["temperature"] = 0.0
        else:
            p.update(temperature=0.8, top_p=0.95)
            if self.sampling == "seeded":
                p["seed"] = (self.idx * 7919) % 2**31
        if self.penalties:
            p.update(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2)
        return SamplingParams(**p)


@dataclass(slots=True)
class StreamOutcome:
    """What one request's client saw (times on time.monotonic)."""

    idx: int
    stream: int
    sampling: str
    planned_abort: bool
    sent_at: float
    first_at: float | None = None
    done_at: float | None = None
    tokens: int = 0
    finish: str | None = None
    status: str = "pending"  # "ok" | "aborted" | "error" | "lost"
    error: str = ""
    equal: bool | None = None  # its tokens (a prefix of them, for a client that left) equal the expected ones

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.sent_at


def expected_tokens(prompt: list[int], n: int, vocab: int, eos: tuple[int, ...] = (),
                    ignore_eos: bool = True) -> list[int]:
    """sim_runner.expected_tokens in plain Python integers (about 50x cheaper than its numpy one token at a time,
    which at a thousand streams would take a core); checked against it by `check_expected`."""
    context = [vocab, vocab, vocab, *prompt]
    length, out = len(prompt), []
    for _ in range(n):
        x = (context[-3] * _GOLDEN + context[-2] * _M1 + context[-1] * _M2 + length * _GOLDEN * _GOLDEN) & _MASK
        x = ((x ^ (x >> 30)) * _M1) & _MASK
        x = ((x ^ (x >> 27)) * _M2) & _MASK
        pick = (x ^ (x >> 31)) % vocab
        out.append(pick)
        context.append(pick)
        length += 1
        if not ignore_eos and pick in eos:
            break
    return out


def check_expected(vocab: int, eos: tuple[int, ...]) -> None:
    """This module's expected_tokens against the simulated device's own, on a few prompts (RuntimeError if not)."""
    from metrale.gpu_worker.sim_runner import expected_tokens as simulated

    rng = random.Random(5)
    for length in (1, 2, 3, 40):
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(length)]
        for ignore in (True, False):
            if expected_tokens(prompt, 300, vocab, eos, ignore) != simulated(prompt, 300, vocab, eos, ignore):
                raise RuntimeError("scripts/_soak_streams.expected_tokens no longer matches sim_runner's")


class Streams:
    """The closed-loop streams of one phase against one server (module docstring)."""

    def __init__(self, port: int, *, concurrency: int, clients: int, seed: int, vocab: int, eos: tuple[int, ...],
                 vocab_end: int, deadline_s: float, max_tokens: int, prompt_len: tuple[int, int]) -> None:
        self.port, self.concurrency, self.num_clients, self.seed = port, concurrency, clients, seed
        self.vocab, self.eos, self.vocab_end = vocab, eos, vocab_end
        self.deadline_s, self.max_tokens, self.prompt_len = deadline_s, max_tokens, prompt_len
        prefix_rng = random.Random(12345)
        self.prefixes = [[prefix_rng.randrange(FIRST_PLAIN_TOKEN, vocab_end) for _ in range(PREFIX_LEN)]
                         for _ in range(NUM_PREFIXES)]
        self.clients: list = []
        self.outcomes: list[StreamOutcome] = []
        self.live: dict[int, tuple[int, StreamOutcome]] = {}  # idx -> (client slot, outcome)
        self.tokens_by_second: dict[int, int] = {}  # whole seconds after start -> tokens received then
        self.start = 0.0
        self._drawn = 0
        self._watches: list[tuple[dict, set[int]]] = []  # (a fault's record, live idxs still to move on)

    def _client(self):
        from metrale import AsyncClient

        return AsyncClient(port=self.port, timeout=self.deadline_s)

    async def run(self, duration_s: float) -> list[StreamOutcome]:
        """Every stream until duration_s after the start (each finishes the request it is in); the outcomes."""
        self.clients = [self._client() for _ in range(self.num_clients)]
        try:
            await asyncio.gather(*(c.health() for c in self.clients))  # every DEALER connected before the clock
            self.start = time.monotonic()
            until = self.start + duration_s
            await asyncio.gather(*(self._stream(s, until) for s in range(self.concurrency)))
        finally:
            for c in self.clients:
                await c.close()
        return self.outcomes

    async def _stream(self, s: int, until: float) -> None:
        rng = random.Random(f"{self.seed}-{s}")
        while time.monotonic() < until:
            spec = self._draw(rng, s)
            self.outcomes.append(await self._one(spec))

    def _draw(self, rng: random.Random, stream: int) -> StreamSpec:
        idx, self._drawn = self._drawn, self._drawn + 1
        length = rng.randint(*self.prompt_len)
        prompt = [rng.randrange(FIRST_PLAIN_TOKEN, self.vocab_end) for _ in range(length)]
        if length > PREFIX_LEN and rng.random() < 0.3:
            prompt[:PREFIX_LEN] = rng.choice(self.prefixes)
        max_tokens = rng.randint(16, self.max_tokens)
        sampling = rng.choices([s for s, _ in SAMPLINGS], [w for _, w in SAMPLINGS])[0]
        abort_after = rng.randint(1, 8) if rng.random() < 0.1 else None
        return StreamSpec(idx, stream, prompt, max_tokens, sampling, penalties=rng.random() < 0.2,
                          ignore_eos=rng.random() >= 0.2, abort_after=abort_after)

    async def _one(self, spec: StreamSpec) -> StreamOutcome:
        """Send one request and read it as its client plans; never raises."""
        from metrale.frontend.client_protocol import ClientClosed, RequestError

        slot = spec.stream % self.num_clients
        out = StreamOutcome(spec.idx, spec.stream, spec.sampling, spec.abort_after is not None, time.monotonic())
        got: list[int] = []
        self.live[spec.idx] = (slot, out)
        try:
            async with asyncio.timeout(self.deadline_s):
                gen = self.clients[slot].generate(token_ids=spec.prompt, params=spec.params(),
                                                  request_id=f"soak-{spec.idx}")
                async with contextlib.aclosing(gen):
                    async for delta in gen:
                        if delta.token_ids:
                            self._arrived(spec.idx, out, len(delta.token_ids))
                            got += delta.token_ids
                        if delta.finish_reason is not None:
                            out.finish = delta.finish_reason
                        elif spec.abort_after is not None and len(got) >= spec.abort_after:
                            out.status = "aborted"
                            break
        except TimeoutError:
            out.status, out.error = "lost", f"no final answer within {self.deadline_s:.0f} s"
        except RequestError as e:
            out.status, out.error = "error", f"{e.code}: {e}"[:300]
        except ClientClosed as e:
            if out.status == "pending":  # not closed by a client_reset
                out.status, out.error = "lost", repr(e)
        except Exception as e:  # noqa: BLE001 - a soak judges every failure rather than dying of it
            out.status, out.error = "lost", repr(e)[:300]
        finally:
            self.live.pop(spec.idx, None)
            self._ended(spec.idx)
        out.done_at, out.tokens = time.monotonic(), len(got)
        self._judge(spec, out, got)
        return out

    def _judge(self, spec: StreamSpec, out: StreamOutcome, got: list[int]) -> None:
        """Its status from its finish, and whether its tokens are the ones the simulated device gives its prompt."""
        if out.status == "pending":
            if out.finish in ("length", "stop"):
                out.status = "ok"
            else:
                out.status, out.error = "error", f"finished with {out.finish!r}"
        if out.status not in ("ok", "aborted"):
            return
        want = expected_tokens(spec.prompt, spec.max_tokens, self.vocab, self.eos, spec.ignore_eos)
        if out.status == "aborted":
            out.equal = got == want[:len(got)]
            finish = out.finish
        else:
            finish = "stop" if not spec.ignore_eos and want and want[-1] in self.eos else "length"
            out.equal = got == want and out.finish == finish
        if not out.equal:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out.error = (f"{len(got)} tokens, expected {len(want)}; first difference at {at}; finish {out.finish!r}, "
                         f"expected {finish!r}; prompt {len(spec.prompt)} ids, {spec.sampling}, "
                         f"penalties {spec.penalties}, ignore_eos {spec.ignore_eos}")

    def _arrived(self, idx: int, out: StreamOutcome, n: int) -> None:
        now = time.monotonic()
        if out.first_at is None:
            out.first_at = now
        second = int(now - self.start)
        self.tokens_by_second[second] = self.tokens_by_second.get(second, 0) + n
        for record, waiting in self._watches:
            if idx in waiting:
                waiting.discard(idx)
                record["resumed_at"] = max(record.get("resumed_at", 0.0), now)

    def _ended(self, idx: int) -> None:
        for _, waiting in self._watches:
            waiting.discard(idx)

    def watch(self, record: dict) -> None:
        """From now, record["resumed_at"]: the latest time a stream live now received its next token (a stream
        that ends without one drops out): when the last of them moved on after a fault."""
        self._watches.append((record, set(self.live)))

    async def reset_clients(self, rng: random.Random, k: int) -> int:
        """A client_reset fault: close k clients at once, as crashed client processes would go (close() sends no
        Abort: the frontend must notice the dropped connections and abort their requests), and put fresh ones in
        their place. How many live requests they had (each counts as aborted by its client)."""
        slots = set(rng.sample(range(self.num_clients), min(k, self.num_clients)))
        cut = 0
        for slot, out in self.live.values():
            if slot in slots:
                out.status, out.error = "aborted", "client_reset"
                cut += 1
        for slot in slots:
            old, self.clients[slot] = self.clients[slot], self._client()
            await old.close()
        return cut
