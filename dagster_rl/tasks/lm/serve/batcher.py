"""The batcher of `dagster-rl serve`: concurrent completion requests run in batches of one group
(one adapter, one set of sampling settings) on one thread, each answered with its own result."""

import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from dagster_rl.tasks.lm.serve.protocol import CompletionRequest, CompletionResult


class BatchCancelled(Exception):
    """Every request of a running batch was cancelled (their clients went away): it stops generating."""


@dataclass(eq=False)
class _Pending:
    request: CompletionRequest
    future: Future = field(default_factory=Future)  # the result, or the error, of this request
    cancelled: bool = False  # its client went away


class Batcher:
    """Collects concurrent requests and runs them in batches, on one thread: each batch is the
    pending requests of one group (the oldest request's), at most `max_batch` of them, oldest first.

    A request whose client goes away (`cancel`) is dropped while it waits, and a running batch stops
    between two tokens once all of its requests are cancelled (`run_batch` gets `cancelled`, a
    function that says so). Every request submitted gets its result or an error: the loop catches
    every failure of a batch and hands it to that batch's requests."""

    def __init__(
        self, run_batch: Callable[[list[CompletionRequest], Callable[[], bool]], list[CompletionResult]], max_batch: int = 64
    ):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.run_batch, self.max_batch = run_batch, max_batch
        self._pending: list[_Pending] = []
        self._cv = threading.Condition()
        self._closed = False
        self.batches = 0  # batches run (tests, benches)
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, request: CompletionRequest) -> _Pending:
        """Queue a request; its `future` holds the result (wait on it, or cancel it with `cancel`)."""
        item = _Pending(request)
        with self._cv:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._pending.append(item)
            self._cv.notify()
        return item

    def complete(self, request: CompletionRequest, timeout_s: float | None = None) -> CompletionResult:
        """Submit and wait (a caller on a thread)."""
        return self.submit(request).future.result(timeout_s)

    def cancel(self, item: _Pending) -> None:
        """The request's client went away: drop it if it waits; a running batch of only such requests stops."""
        with self._cv:
            item.cancelled = True
            waiting = any(p is item for p in self._pending)
            if waiting:
                self._pending = [p for p in self._pending if p is not item]
        if waiting:
            item.future.cancel()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            dropped, self._pending = self._pending, []
            self._cv.notify_all()
        for item in dropped:
            item.future.set_exception(RuntimeError("the server is shutting down"))

    def _next_batch(self) -> list[_Pending] | None:
        with self._cv:
            while not self._pending and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            group = self._pending[0].request.group
            batch: list[_Pending] = []
            rest: list[_Pending] = []
            for p in self._pending:
                (batch if p.request.group == group and len(batch) < self.max_batch else rest).append(p)
            self._pending = rest
            return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            self.batches += 1
            try:
                results = self.run_batch([p.request for p in batch], partial(_all_cancelled, batch))
                if len(results) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} requests gave {len(results)} results")
                for item, result in zip(batch, results, strict=True):
                    _settle(item.future, result=result)
            except BaseException as e:  # every request of the batch gets the error
                for item in batch:
                    _settle(item.future, error=e)


def _all_cancelled(batch: list[_Pending]) -> bool:
    return all(p.cancelled for p in batch)


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless it is already set (a request cancelled while it waited)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
