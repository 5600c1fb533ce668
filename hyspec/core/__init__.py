"""The engine core: sequence slots, the one speculative round driver, and the scheduler
that runs many sequences per forward (continuous batching).

    slots.py      one sequence's whole decoding state, a pool of them, memory accounting
    request.py    what a caller asks for (Request) and what it gets back
    round.py      the round, written once: draft -> verify -> accept -> commit -> refresh
    scheduler.py  admit (prefill), run rounds over the active batch, retire, stream
    backend.py    the compute a round calls (ReferenceBackend: the model's own modules)
    state.py      a sequence's state as values: session turns, the prefix store, /save
    batch_bench.py  `hyspec bench --batch`: aggregate throughput, batch invariance, memory
"""

from hyspec.core.request import Request
from hyspec.core.scheduler import Scheduler
from hyspec.core.slots import SlotPool, slot_bytes

__all__ = ["Request", "Scheduler", "SlotPool", "slot_bytes"]
