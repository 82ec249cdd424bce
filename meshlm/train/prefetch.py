"""Batches fetched in a background thread while the current step computes.

`Prefetcher` wraps any BatchSource and is one itself: `step` and `state_dict()` describe the batches handed
out, never the one fetched ahead, so a checkpoint's data position is the same as without prefetching and a
resumed run sees the same batches. One fetch is in flight at a time, in order, so the source is never used
by two threads at once and the batch stream is unchanged. An error raised by the source surfaces in the
`next_batch` call that would have returned that batch.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from meshlm.train.parts import Batch, BatchSource


class Prefetcher:
    """Fetches batch k+1 while step k runs; stops fetching once `limit` batches were handed out. `pin` puts
    fetched batches in page-locked memory so the copy to a GPU can be asynchronous."""

    def __init__(self, source: BatchSource, limit: int, pin: bool = False) -> None:
        self.source, self.limit, self.pin = source, limit, pin
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshlm-prefetch")
        self._ahead: tuple[tuple[int, int], Future[Batch]] | None = None
        self._state = copy.deepcopy(source.state_dict())
        self.step = source.step

    def _fetch(self, dp_rank: int, dp: int) -> Batch:
        x, y = self.source.next_batch(dp_rank, dp)
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def next_batch(self, dp_rank: int, dp: int) -> Batch:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (dp_rank, dp):
            batch = ahead[1].result()
        else:
            self._discard(ahead)
            batch = self._fetch(dp_rank, dp)
        self._state, self.step = copy.deepcopy(self.source.state_dict()), self.source.step
        if self.step < self.limit:
            self._ahead = ((dp_rank, dp), self._pool.submit(self._fetch, dp_rank, dp))
        return batch

    def _discard(self, ahead: tuple[tuple[int, int], Future[Batch]] | None) -> None:
        """Drop a fetch made ahead (for another dp split, or before a reload) and put the source back to the
        position it had before that fetch."""
        if ahead is not None:
            ahead[1].exception()  # wait: the source must be idle before it is rewound
            self.source.load_state_dict(copy.deepcopy(self._state))

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].exception()
        self.source.load_state_dict(state)
        self._state, self.step = copy.deepcopy(self.source.state_dict()), self.source.step

    def close(self) -> None:
        """Wait for a fetch in flight (its batch is dropped) and stop the thread."""
        self._pool.shutdown(wait=True)
