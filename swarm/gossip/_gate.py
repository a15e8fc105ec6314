"""Who may exchange, and which exchange may commit: the gate shared by averagers that take turns.

An exchange's data phase waits on the partner's network, so it runs without the exchange lock: a
slow or trickling partner must never make our own sync, or our training, wait for it (docs/gossip.md,
"Threads and locking"). The lock covers only what is local and short: taking an offer and
committing. What the lock used to guarantee by being held throughout, that an offer is
committed only if nothing was committed since it was taken, the gate guarantees with a generation:

* every offer is taken with the generation then current;
* before sending its ACK an exchange *reserves* the commit (:meth:`Turn.reserve`): refused if the
  generation moved (another exchange committed, or the owner invalidated its offers) or another
  exchange holds a reservation. Then it NACKs with :data:`NOT_COMMITTED_REASON`, and neither side
  commits, nor blames the other;
* a committed exchange moves the generation on; a reservation is released either way.

At most one served exchange is in flight (others get BUSY), and none while our own sync exchanges;
our own sync waits for a served exchange at most ``busy_patience_s``, then runs beside it, and
whichever reserves first commits.
"""

from __future__ import annotations

import threading

NOT_COMMITTED_REASON = "not committed here: another exchange committed first"
"""The NACK reason of an exchange the gate refused: no evidence against either side."""


class ExchangeGate:
    """The lock, the generation and the slots of one averager, or of several sharing them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Local critical sections only: offers and commits."""
        self.sync_lock = threading.Lock()
        """Our own syncs, one at a time (only our own threads wait on it)."""
        self._state = threading.Condition(threading.Lock())
        self._generation = 0
        self._reserved = False
        self._serving = 0
        self._syncing = 0

    def generation(self) -> int:
        with self._state:
            return self._generation

    def changed(self) -> None:
        """What offers are computed from changed outside an exchange (the owner invalidated them)."""
        with self._state:
            self._generation += 1

    def try_serve(self) -> bool:
        """Take the one slot for a served exchange; False (answer BUSY) if it or our own sync is busy."""
        with self._state:
            if self._serving or self._syncing:
                return False
            self._serving += 1
            return True

    def served(self) -> None:
        with self._state:
            self._serving -= 1
            self._state.notify_all()

    def begin_sync(self, patience_s: float) -> None:
        """Our own sync starts: wait up to ``patience_s`` for a served exchange to end, then go anyway."""
        with self._state:
            self._state.wait_for(lambda: not self._serving, timeout=patience_s)
            self._syncing += 1

    def end_sync(self) -> None:
        with self._state:
            self._syncing -= 1

    def _reserve(self, generation: int) -> str | None:
        with self._state:
            if self._reserved:
                return "another exchange is committing"
            if generation != self._generation:
                return "the tensors changed since this exchange began"
            self._reserved = True
            return None

    def _release(self, committed: bool) -> None:
        with self._state:
            self._reserved = False
            if committed:
                self._generation += 1


class Turn:
    """One exchange's claim to commit: the generation its offer was taken at, and its reservation."""

    def __init__(self, gate: ExchangeGate, generation: int) -> None:
        self._gate, self._generation = gate, generation
        self.reserved = False
        self.donation = False

    def as_donation(self) -> Turn:
        """The same turn for an exchange whose partner only takes our tensors over (a joiner's weight):
        it commits nothing here, so it reserves nothing and never moves the generation; an exchange
        of ours in flight beside it still commits. It still ends if our tensors changed under it."""
        turn = Turn(self._gate, self._generation)
        turn.donation = True
        return turn

    def reserve(self) -> str | None:
        """Reserve the commit; None if granted, else why not (then this exchange must not commit)."""
        if self.donation:
            return "the tensors changed since this exchange began" if self.stale() else None
        refusal = self._gate._reserve(self._generation)
        self.reserved = refusal is None
        return refusal

    def stale(self) -> bool:
        """Whether an exchange committed (or the tensors changed) since this turn's offer was taken:
        then it can no longer commit, and what the offer is computed from may be changing."""
        return self._gate.generation() != self._generation

    def release(self, committed: bool) -> None:
        """End the reservation (idempotent); ``committed`` moves the generation on."""
        if self.reserved:
            self.reserved = False
            self._gate._release(committed)
