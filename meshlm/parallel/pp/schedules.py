"""Pipeline schedules as explicit lists of actions per rank: pure functions of (p, m, v), no torch.

A schedule is `list[list[Action]]`; entry r is everything pp rank r does in one training step, in order.
Rank r holds v chunks; chunk c is model stage c·p + r (Megatron's interleaved assignment), so activations
flow r → r+1 and wrap from rank p-1 back to rank 0 between chunks.

Compute actions are F (forward) and B (backward) of one micro-batch on one chunk; the zero-bubble schedule
splits B into B (the input gradient, which the previous stage waits for) and W (the weight gradient, which
nobody waits for, so it can fill the bubble). Communication actions
name the neighbour and the message; consecutive sends and receives are issued together as one
`batch_isend_irecv`. The executor's semantics, which `simulate` replays, are:
  * a send is asynchronous; it completes once the receiver has posted the matching receive;
  * a receive is posted one compute ahead of the compute that needs it and waited just before that compute;
  * between two ranks, messages match in order, so a receiver posts its receives in the sender's send order;
  * WAIT_F / WAIT_B wait for a send to complete, which frees its buffer. It is placed right after the first
    compute that knows (through a chain of messages) that the receiver has used the data, so it never
    stalls; sends nobody answers are waited at the end of the step.
`simulate` times every compute with unit (or given) costs, which yields the text timeline, the bubble
fraction and the peak number of in-flight activations, and proves the schedule deadlock-free.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")
COMPUTE = ("F", "B", "W")
SENDS = ("SEND_F", "SEND_B")
RECVS = ("RECV_F", "RECV_B")
WAITS = ("WAIT_F", "WAIT_B")


class ScheduleError(ValueError):
    """A schedule that would compute the wrong thing or deadlock, phrased as one line."""


@dataclass(frozen=True)
class Action:
    """One step of one rank: compute F/B of `micro` on local `chunk`, or move its activation/gradient.

    SEND_F sends the output of F(chunk, micro) to `peer`; RECV_F receives the input of F(chunk, micro)
    from `peer`; SEND_B / RECV_B do the same for the gradient flowing backwards; WAIT_F / WAIT_B wait
    until that SEND_F / SEND_B has completed.
    """

    kind: str
    chunk: int
    micro: int
    peer: int = -1

    def label(self, v: int = 1) -> str:
        """Short name: 'F3', or 'F3.1' (micro 3, chunk 1) when a rank holds several chunks; 'SEND_F3->1'."""
        name = f"{self.kind}{self.micro}" + (f".{self.chunk}" if v > 1 else "")
        if self.kind in SENDS + WAITS:
            return f"{name}->{self.peer}"
        return f"{name}<-{self.peer}" if self.kind in RECVS else name


Schedule = list[list[Action]]


# ---- compute orders --------------------------------------------------------------------------------
def gpipe_order(p: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards: simple, but every rank holds all m activations at the peak."""
    return [[Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)] for _ in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    """1F1B: rank r runs p-r-1 warm-up forwards, then alternates one forward / one backward, then drains.

    Same bubble as GPipe, but a micro-batch's activations are freed p-r steps after they were made, so rank r
    holds at most p-r of them instead of m.
    """
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [Action("F", 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [Action("F", 0, warmup + i), Action("B", 0, i)]
        ops += [Action("B", 0, i) for i in range(m - warmup, m)]
        orders.append(ops)
    return orders


def interleaved_order(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: each rank cycles its v chunks in groups of p micro-batches.

    Forward step k runs chunk (k // p) % v on micro-batch (k // (p·v))·p + k % p; backward steps visit the
    chunks in reverse. Each chunk is 1/v of a stage, so the fill and drain shrink v-fold. Needs m % p == 0.
    """
    if v == 1:
        return one_f_one_b_order(p, m)
    if m % p:
        raise ScheduleError(f"interleaved schedule needs micro-batches ({m}) divisible by pp ({p})")
    total = m * v

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Action:
        return Action("F", (k // p) % v, micro(k))

    def backward(k: int) -> Action:
        return Action("B", v - 1 - (k // p) % v, micro(k))

    orders = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        ops = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [forward(warmup + k), backward(k)]
        ops += [backward(k) for k in range(total - warmup, total)]
        orders.append(ops)
    return orders


def zero_bubble_h1_order(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B's F/B order with each backward split
    into B (input gradient, sent on at once) and W (weight gradient), the W's deferred into the time a rank
    would otherwise wait.

    Built by list scheduling at unit costs: a rank free at time t runs its next F/B if that one's input has
    arrived, else the oldest deferred W. A micro-batch's activations live until its W, so a rank runs no
    new F while it already holds p of them (1F1B's peak, on its first rank) and a W is waiting: the same peak
    memory as 1F1B. The bubble falls from 1F1B's (p-1)(F+B+W) to (p-1)(F+B-W) per rank, a third of it when
    the three cost the same (tests/parallel/test_pipeline.py checks (p-1)/(3m+p-1) for every allowed p and m).
    """
    fb = one_f_one_b_order(p, m)
    nxt, busy = [0] * p, [0] * p
    deferred: list[list[int]] = [[] for _ in range(p)]
    finished: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro) -> time its result exists
    held = [0] * p  # micro-batches whose F ran and W did not
    orders: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(nxt[r] < len(fb[r]) or deferred[r] for r in range(p)):
        for r in range(p):
            if busy[r] > t:
                continue
            a = fb[r][nxt[r]] if nxt[r] < len(fb[r]) else None
            source = None if a is None else ("F", r - 1, a.micro) if a.kind == "F" else ("B", r + 1, a.micro)
            ready = a is not None and (source[1] in (-1, p) or finished.get(source, t + 1) <= t)
            if ready and not (a.kind == "F" and held[r] >= p and deferred[r]):
                nxt[r] += 1
                held[r] += a.kind == "F"
                if a.kind == "B":
                    deferred[r].append(a.micro)
            elif deferred[r]:
                a = Action("W", 0, deferred[r].pop(0))
                held[r] -= 1
            else:
                continue
            orders[r].append(a)
            finished[(a.kind, r, a.micro)] = busy[r] = t + 1
        t += 1
    return orders


def compute_order(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    if name == "gpipe":
        orders = gpipe_order(p, m)
    elif name == "1f1b":
        orders = one_f_one_b_order(p, m)
    elif name == "interleaved":
        orders = interleaved_order(p, m, v)
    elif name == "zb1":
        orders = zero_bubble_h1_order(p, m)
    else:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if v > 1 and name != "interleaved":
        raise ScheduleError(f"virtual stages (v={v}) need the interleaved schedule, not {name!r}")
    return orders


# ---- communication ---------------------------------------------------------------------------------
def _stage(rank: int, chunk: int, p: int) -> int:
    return chunk * p + rank


def _message(a: Action, rank: int, p: int) -> tuple[str, int, int]:
    """The message a send/recv carries, named by (direction, consuming stage, micro-batch)."""
    stage = _stage(rank, a.chunk, p)
    if a.kind == "SEND_F":
        return ("F", stage + 1, a.micro)
    if a.kind == "SEND_B":
        return ("B", stage - 1, a.micro)
    return (a.kind[-1], stage, a.micro)


def add_communication(orders: list[list[Action]], p: int, v: int) -> Schedule:
    """Insert sends right after each producing compute and receives one compute ahead of each consumer.

    Receives from one sender are posted in that sender's send order (messages between two ranks match in
    order); a receive whose consumer comes early pulls the receives queued before it forward with it.
    """
    n_stages = p * v
    sends_after: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(p)]
    stream: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)  # (src, dst) -> messages
    for r, ops in enumerate(orders):
        for i, a in enumerate(ops):
            stage = _stage(r, a.chunk, p)
            if a.kind == "F" and stage < n_stages - 1:
                send = Action("SEND_F", a.chunk, a.micro, (r + 1) % p)
            elif a.kind == "B" and stage > 0:
                send = Action("SEND_B", a.chunk, a.micro, (r - 1) % p)
            else:
                continue
            sends_after[r][i].append(send)
            stream[(r, send.peer)].append(_message(send, r, p))

    recvs_before: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(p)]
    for (src, dst), messages in stream.items():
        consumer = {(a.kind, _stage(dst, a.chunk, p), a.micro): i for i, a in enumerate(orders[dst])}
        slot = len(orders[dst])
        posted = []
        for kind, stage, micro in reversed(messages):
            slot = min(slot, max(0, consumer[(kind, stage, micro)] - 1))
            posted.append((slot, Action("RECV_" + kind, (stage - dst) // p, micro, src)))
        for slot, recv in reversed(posted):
            recvs_before[dst][slot].append(recv)

    schedule = []
    for r, ops in enumerate(orders):
        out: list[Action] = []
        for i, a in enumerate(ops):
            out += (sends_after[r][i - 1] if i else []) + recvs_before[r][i] + [a]
        out += sends_after[r][len(ops) - 1] if ops else []
        schedule.append(out)
    return schedule


def add_send_waits(schedule: Schedule, p: int, v: int) -> Schedule:
    """Wait for each send right after the first compute that knows its receiver has consumed the data.

    Knowledge travels with messages (vector clocks from `simulate`): e.g. the gradient of micro-batch k
    proves that the activation of micro-batch k arrived. Waiting there never blocks, and frees the send
    buffer (a stage output, an input gradient) long before the end of the step.
    """
    known = simulate(schedule, p, v).known
    consumer = [{(a.kind, a.chunk, a.micro): i for i, a in enumerate(ops) if a.kind in COMPUTE} for ops in schedule]
    out = []
    for r, ops in enumerate(schedule):
        pending: list[tuple[Action, int]] = []  # (send, index of the receiver's compute that uses it)
        new: list[Action] = []
        for i, a in enumerate(ops):
            new.append(a)
            if a.kind in SENDS:
                kind, stage, micro = _message(a, r, p)
                pending.append((a, consumer[a.peer][(kind, (stage - a.peer) // p, micro)]))
            elif a.kind in COMPUTE:
                new += [_wait_for(send) for send, j in pending if known[r][i][send.peer] > j]
                pending = [(send, j) for send, j in pending if known[r][i][send.peer] <= j]
        out.append(new + [_wait_for(send) for send, _ in pending])
    return out


def _wait_for(send: Action) -> Action:
    return Action("WAIT_" + send.kind[-1], send.chunk, send.micro, send.peer)


def build_schedule(name: str, p: int, m: int, v: int = 1, forward_only: bool = False) -> Schedule:
    """The full per-rank action lists of schedule `name`; `forward_only` keeps the forward half (eval)."""
    orders = compute_order(name, p, m, v)
    if forward_only:
        orders = [[a for a in ops if a.kind == "F"] for ops in orders]
    if name == "zb1" and v > 1:
        raise ScheduleError(f"virtual stages (v={v}) need the interleaved schedule, not 'zb1'")
    schedule = add_send_waits(add_communication(orders, p, v), p, v)
    validate(schedule, p, m, v, forward_only)
    return schedule


# ---- checking and simulating -------------------------------------------------------------------------
def validate(schedule: Schedule, p: int, m: int, v: int, forward_only: bool = False) -> None:
    """Raise ScheduleError unless every rank computes each (chunk, micro) F once and B once after it, every
    needed input is received before use from the right neighbour, sends match receives in order, and every
    send is waited for exactly once, after it."""
    n_stages = p * v
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} ranks, expected {p}")
    streams: dict[tuple[int, int, str], list[tuple[str, int, int]]] = defaultdict(list)
    for r, ops in enumerate(schedule):
        done: set[tuple[str, int, int]] = set()
        received: set[tuple[str, int, int]] = set()
        unwaited: set[Action] = set()
        for a in ops:
            if not (0 <= a.chunk < v and 0 <= a.micro < m):
                raise ScheduleError(f"rank {r}: {a} is outside {v} chunks × {m} micro-batches")
            stage = _stage(r, a.chunk, p)
            key = (a.kind, a.chunk, a.micro)
            if a.kind in COMPUTE:
                if key in done:
                    raise ScheduleError(f"rank {r}: {a.label(v)} on chunk {a.chunk} runs twice")
                if a.kind == "B" and ("F", a.chunk, a.micro) not in done:
                    raise ScheduleError(f"rank {r}: B{a.micro} on chunk {a.chunk} runs before its forward")
                if a.kind == "W" and ("B", a.chunk, a.micro) not in done:
                    raise ScheduleError(f"rank {r}: W{a.micro} on chunk {a.chunk} runs before its backward")
                needs = (a.kind == "F" and stage > 0) or (a.kind == "B" and stage < n_stages - 1)
                if needs and ("RECV_" + a.kind, a.chunk, a.micro) not in received:
                    raise ScheduleError(f"rank {r}: {a.label(v)} on chunk {a.chunk} runs before its input is received")
                done.add(key)
            elif a.kind in SENDS:
                if (a.kind[-1], a.chunk, a.micro) not in done:
                    raise ScheduleError(f"rank {r}: {a.kind} micro {a.micro} chunk {a.chunk} before it is computed")
                expected = (r + 1) % p if a.kind == "SEND_F" else (r - 1) % p
                if a.peer != expected:
                    raise ScheduleError(f"rank {r}: {a.kind} micro {a.micro} goes to rank {a.peer}, not {expected}")
                streams[(r, a.peer, "send")].append(_message(a, r, p))
                unwaited.add(a)
            elif a.kind in WAITS:
                send = Action("SEND_" + a.kind[-1], a.chunk, a.micro, a.peer)
                if send not in unwaited:
                    raise ScheduleError(f"rank {r}: {a.label(v)} waits for a send that is not pending")
                unwaited.remove(send)
            elif a.kind in RECVS:
                expected = (r - 1) % p if a.kind == "RECV_F" else (r + 1) % p
                if a.peer != expected:
                    raise ScheduleError(f"rank {r}: {a.kind} micro {a.micro} comes from rank {a.peer}, not {expected}")
                received.add(key)
                streams[(a.peer, r, "recv")].append(_message(a, r, p))
            else:
                raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r}")
        if unwaited:
            raise ScheduleError(f"rank {r}: {sorted(w.label(v) for w in unwaited)} are never waited for")
        kinds = ("F",) if forward_only else ("F", "B", "W") if _splits_backward(ops) else ("F", "B")
        missing = [(k, c, i) for k in kinds for c in range(v) for i in range(m) if (k, c, i) not in done]
        if missing:
            k, c, i = missing[0]
            raise ScheduleError(f"rank {r}: {k}{i} on chunk {c} never runs ({len(missing)} computes missing)")
    for src in range(p):
        for dst in range(p):
            sent, got = streams[(src, dst, "send")], streams[(src, dst, "recv")]
            if sent != got:
                raise ScheduleError(
                    f"rank {src} → rank {dst}: sends {sent} do not match receives {got} in order "
                    "(each message is (direction, receiving stage, micro-batch))"
                )


def _splits_backward(ops: list[Action]) -> bool:
    """Whether this rank's weight gradients are a pass of their own (W), so activations live until it."""
    return any(a.kind == "W" for a in ops)


@dataclass
class Timeline:
    """When each compute ran in a simulated step: spans[r] = [(start, end, action)], plus summary numbers.

    known[r][i][q] is how many of rank q's actions rank r knows have run once its action i has run
    (a vector clock: messages carry their sender's knowledge).
    """

    p: int
    v: int
    spans: list[list[tuple[float, float, Action]]]
    peak_in_flight: list[int]
    known: list[list[list[int]]]

    @property
    def total(self) -> float:
        return max((s[-1][1] for s in self.spans if s), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time between the step's start and the last rank's finish."""
        busy = sum(end - start for spans in self.spans for start, end, _ in spans)
        return 1.0 - busy / (self.p * self.total) if self.total else 0.0


UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


def simulate(schedule: Schedule, p: int, v: int, costs: dict[str, float] | None = None) -> Timeline:
    """Replay the schedule with the executor's semantics and fixed compute costs (unit by default).

    Ranks advance independently; a compute starts when the rank is free and its received input has been
    sent, a WAIT ends when the receiver has posted the matching receive. If no rank can advance before all
    are done, the schedule deadlocks: raise ScheduleError.
    """
    costs = costs or UNIT_COSTS
    n_stages = p * v
    frees = ["W" if _splits_backward(ops) else "B" for ops in schedule]  # the pass after which activations go
    idx, clock = [0] * p, [0.0] * p
    known_now = [[0] * p for _ in range(p)]
    known: list[list[list[int]]] = [[] for _ in range(p)]
    sent: dict[tuple[int, int], list[tuple[float, list[int]]]] = defaultdict(list)  # (src, dst) -> (time, clock)
    posted_at: dict[tuple[int, int], list[float]] = defaultdict(list)  # (src, dst) -> receive post times
    posted: list[dict[tuple[str, int, int], tuple[int, int]]] = [{} for _ in range(p)]  # -> (src, index)
    send_index: list[dict[tuple[str, int, int], int]] = [{} for _ in range(p)]
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
    in_flight, peak = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while idx[r] < len(schedule[r]):
                a = schedule[r][idx[r]]
                key = (a.kind[-1], a.chunk, a.micro)
                known_now[r][r] = idx[r] + 1
                if a.kind in SENDS:
                    send_index[r][key] = len(sent[(r, a.peer)])
                    sent[(r, a.peer)].append((clock[r], list(known_now[r])))
                elif a.kind in RECVS:
                    posted[r][key] = (a.peer, len(posted_at[(a.peer, r)]))
                    posted_at[(a.peer, r)].append(clock[r])
                elif a.kind in WAITS:
                    k = send_index[r][key]
                    if len(posted_at[(r, a.peer)]) <= k:
                        break
                    clock[r] = max(clock[r], posted_at[(r, a.peer)][k])
                else:
                    start = clock[r]
                    stage = _stage(r, a.chunk, p)
                    if (a.kind == "F" and stage > 0) or (a.kind == "B" and stage < n_stages - 1):
                        src, k = posted[r][key]
                        if len(sent[(src, r)]) <= k:
                            break
                        sent_time, sender_knows = sent[(src, r)][k]
                        start = max(start, sent_time)
                        known_now[r] = [max(a, b) for a, b in zip(known_now[r], sender_knows, strict=True)]
                    clock[r] = start + costs[a.kind]
                    spans[r].append((start, clock[r], a))
                    in_flight[r] += 1 if a.kind == "F" else -1 if a.kind == frees[r] else 0
                    peak[r] = max(peak[r], in_flight[r])
                known[r].append(list(known_now[r]))
                idx[r] += 1
                progress = True
    stuck = [r for r in range(p) if idx[r] < len(schedule[r])]
    if stuck:
        where = ", ".join(f"rank {r} at {schedule[r][idx[r]].label(v)}" for r in stuck)
        raise ScheduleError(f"schedule deadlocks: {where} wait for messages that are never sent or received")
    return Timeline(p, v, spans, peak, known)


def theoretical_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """(p-1)/(m+p-1) for GPipe and 1F1B; interleaving shrinks fill and drain v-fold: (p-1)/(v·m+p-1).
    ZB-H1 at equal F, B and W costs idles (p-1) units per rank beside 3m of work: (p-1)/(3m+p-1)."""
    if name == "zb1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / ((v if name == "interleaved" else 1) * m + p - 1)


def format_timeline(timeline: Timeline) -> str:
    """One row per rank, one column per time unit: 'F3' forward of micro-batch 3, '.' idle (a bubble)."""
    unit = min(end - start for spans in timeline.spans for start, end, _ in spans)
    cols = round(timeline.total / unit)
    width = max(len(a.label(timeline.v)) for spans in timeline.spans for _, _, a in spans) + 1
    rows = []
    for r, spans in enumerate(timeline.spans):
        cells = ["." for _ in range(cols)]
        for start, end, a in spans:
            first = round(start / unit)
            cells[first] = a.label(timeline.v)
            for t in range(first + 1, round(end / unit)):
                cells[t] = "~"
        rows.append(f"rank {r} |" + "".join(c.rjust(width) for c in cells))
    return "\n".join(rows)


def main() -> None:
    """`python -m meshlm.parallel.pp.schedules interleaved 4 8 2`: timeline, bubble and every rank's action list."""
    import sys

    name, p, m, v = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1
    schedule = build_schedule(name, p, m, v)
    timeline = simulate(schedule, p, v)
    print(format_timeline(timeline))
    print(
        f"bubble {timeline.bubble_fraction:.4f} (theory {theoretical_bubble(name, p, m, v):.4f}), "
        f"peak in-flight micro-batches per rank {timeline.peak_in_flight}"
    )
    for r, ops in enumerate(schedule):
        print(f"rank {r}: " + " ".join(a.label(v) for a in ops))


if __name__ == "__main__":
    main()
