"""Compute lanes: blocking torch work runs off the event loop, one OS thread per lane.

A lane owns one dedicated thread and runs its calls there in order. One thread, not
a pool: torch's OpenMP runtime keeps a thread team per OS thread that has run a
parallel op, and two live teams on a small machine make every op wait on futexes
(measured: steps ~50% slower on 2 cores once a pool handed a lane's calls to a
second thread).

Cancellation never abandons a running call (the thread may hold tensors that the
next call needs): the awaiting task waits for the call to return. To keep Ctrl-C
fast, blocking code calls :func:`cancel_point` between micro-batches or decode
steps; once the awaiting task is cancelled, that raises inside the thread. A call
that completes anyway returns its result, and the cancellation is delivered at the
task's next await — so an applied optimizer step is never lost from the books.

The one exception is a deadline (corun/loop/deadlines.py, and each teardown step): inside
:func:`abandoning`, a cancelled call that has not returned ``grace_s`` later is
*abandoned* — a call stuck in a blocking C call (a hung collective, a wedged driver)
ignores cancel points. Its thread is left to it (recorded in :func:`abandoned_threads`,
so ``corun`` ends the process with ``os._exit`` rather than wait for it), the lane's
other calls move to a fresh thread, and the awaiting task's cancellation goes on.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import queue
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, cast

import anyio
import anyio.lowlevel
import anyio.to_thread
import sniffio

from corun.execution import cores, preload

T = TypeVar("T")
ComputeMode = Literal["thread", "inline"]

_lane_local = threading.local()
ABANDON_GRACE_S = 5.0  # longest wait, past a deadline, for a cancelled call to return
# Inside `abandoning(grace_s)`: how long a cancelled lane call may take to return.
_grace: contextvars.ContextVar[float | None] = contextvars.ContextVar("lane_grace", default=None)
_abandoned: list[threading.Thread] = []  # threads left to a call that never returned
_SIGNALS_KEPT = 8  # a lane's trio calls in flight with a signal of their own (2 fds each)


@contextmanager
def abandoning(grace_s: float) -> Iterator[None]:
    """Lane calls awaited here (in this task) that are cancelled and do not return
    within ``grace_s`` are abandoned: their awaiting task goes on with its cancellation.
    Nested, the shorter grace holds (an outer deadline's cancellation gets its own)."""
    outer = _grace.get()
    token = _grace.set(grace_s if outer is None else min(outer, grace_s))
    try:
        yield
    finally:
        _grace.reset(token)


def abandoned_threads() -> list[threading.Thread]:
    """Lane threads still stuck in an abandoned call (the process should not wait
    for them at exit)."""
    return [thread for thread in _abandoned if thread.is_alive()]


class LaneCancelled(BaseException):
    """Raised by :func:`cancel_point` in a lane call whose awaiting task was cancelled.

    A BaseException, like the cancellations of asyncio and trio, so that trainer
    code catching ``Exception`` does not swallow it.
    """


class LaneClosed(RuntimeError):
    """A call on a lane after :meth:`Lane.close`: the run that owned it has ended. A
    task left over from it (a host's, an engine's) is refused rather than given a
    fresh thread that nothing would ever close."""


def cancel_point() -> None:
    """Stop the current lane call here if its awaiting task has been cancelled.

    A no-op outside a threaded lane call (inline mode, plain scripts, tests that
    call trainer methods directly), so trainer code can call it unconditionally.
    Call it only where stopping leaves the trainer as it was before the call's
    effects (before the optimizer step).
    """
    call = getattr(_lane_local, "call", None)
    if call is not None and call.cancel_requested:
        raise LaneCancelled


def stop_requested() -> bool:
    """Whether the current lane call's awaiting task was cancelled (never raises)."""
    call = getattr(_lane_local, "call", None)
    return call is not None and call.cancel_requested


def in_lane_call() -> bool:
    """Whether this thread runs a lane call (so :func:`cancel_point` can stop it)."""
    return getattr(_lane_local, "call", None) is not None


class _TrioSignal:
    """How a lane's thread tells a trio task that its call returned: a byte on a socket
    pair whose reading end the task waits on. trio's I/O wait reschedules the task
    directly; ``run_sync_soon`` would first wake trio's entry-queue task, which then
    reschedules it (one more scheduler pass: ~30 µs per call on 2 cores).

    One per call in flight, reused: a lane keeps the pairs whose byte has been read."""

    __slots__ = ("reader", "writer")

    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)

    def send(self) -> None:
        """On the lane's thread: the call has returned."""
        try:
            self.writer.send(b"\0")
        except OSError:  # closed: the lane is gone, nobody waits
            pass

    async def received(self, trio: Any) -> None:
        """Wait (a cancellation point) for the byte, and take it."""
        while True:
            await trio.lowlevel.wait_readable(self.reader)
            try:
                if self.reader.recv(1):
                    return
            except BlockingIOError:  # woken without a byte: wait again
                pass

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


class _WokenFuture(asyncio.Future[None]):
    """The future a task awaits a lane call with on asyncio: its result wakes the task
    at once, in the loop callback that sets it, instead of one more pass of the loop
    later (a future schedules its callbacks with ``call_soon``: ~15 µs per call on 2
    cores). Only the awaiting task's wake-up is ever added; a cancellation still
    schedules it, as a plain future would."""

    _wake: tuple[Callable[[Any], object], contextvars.Context | None] | None = None

    def add_done_callback(
        self, fn: Callable[[Any], object], *, context: contextvars.Context | None = None
    ) -> None:
        self._wake = (fn, context)

    def wake(self) -> None:
        """On the loop: the call returned."""
        if self.done():
            return
        self.set_result(None)  # no callbacks of its own to schedule
        if self._wake is not None:
            fn, context = self._wake
            if context is None:
                fn(self)
            else:
                context.run(fn, self)

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg=msg):
            return False
        if self._wake is not None:
            fn, context = self._wake
            self.get_loop().call_soon(fn, self, context=context)
        return True


class _Call:
    """One blocking call: run on the lane's thread, awaited on the event loop.

    The hand-off back wakes the awaiting task directly: on asyncio one callback
    scheduled on the loop (``call_soon_threadsafe``) gives the task's future its
    result; on trio a :class:`_TrioSignal` (or, past a lane's pool of them,
    ``run_sync_soon`` and a reschedule). No events and no locks per call: a lane's hop
    costs about what the OS's wake-ups cost (``python -m benchmarks.overhead``)."""

    __slots__ = ("args", "cancel_requested", "done", "error", "fn", "result", "resume", "signal",
                 "trio", "waiter")  # fmt: skip

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], lane: Lane) -> None:
        self.fn, self.args = fn, args
        self.trio: Any = None  # the trio module on a trio loop
        self.signal: _TrioSignal | None = None
        if sniffio.current_async_library() == "trio":
            import trio  # imported already: its loop runs

            self.trio = trio
            self.signal = lane.take_signal()
            if self.signal is None:  # past the lane's pool: through trio's entry queue
                self.resume: Callable[[Callable[[], None]], object] = (
                    trio.lowlevel.current_trio_token().run_sync_soon
                )
        else:
            self.resume = asyncio.get_running_loop().call_soon_threadsafe
        self.cancel_requested = False  # set on the loop thread, read by the lane's thread
        self.done = False  # set on the loop thread once the call has returned
        self.result: Any = None
        self.error: BaseException | None = None
        self.waiter: Any = None  # the asyncio future or trio task waiting for it now

    def run(self, budget: cores.ThreadBudget | None) -> None:
        _lane_local.call = self
        try:
            if self.cancel_requested:  # cancelled while queued: never start it
                raise LaneCancelled()
            if budget is not None:
                budget.start_call()
            self.result = self.fn(*self.args)
        except BaseException as exc:  # handed to the awaiting task, which re-raises it
            self.error = exc
        finally:
            _lane_local.call = None
            if self.signal is not None:
                self.signal.send()
            else:
                try:
                    self.resume(self._returned)
                except RuntimeError:  # the event loop is gone (a hard exit): nobody waits
                    pass

    def _returned(self) -> None:
        """On the loop: the call has returned; wake its awaiting task, if it still waits."""
        self.done = True
        waiter, self.waiter = self.waiter, None
        if waiter is None:
            return
        if self.trio is not None:
            self.trio.lowlevel.reschedule(waiter)
        else:
            waiter.wake()

    async def returned(self, lane: Lane) -> None:
        """Wait (a cancellation point) until the call has returned."""
        if self.done:
            return
        if self.signal is not None:
            await self.signal.received(self.trio)
            self.done = True
            lane.give_back_signal(self.signal)
            return
        if self.trio is not None:
            lowlevel = self.trio.lowlevel
            self.waiter = lowlevel.current_task()

            def abort(_: Any) -> Any:
                self.waiter = None
                return lowlevel.Abort.SUCCEEDED

            await lowlevel.wait_task_rescheduled(abort)
            return
        self.waiter = future = _WokenFuture()
        try:
            await future
        finally:
            self.waiter = None


class Lane:
    """One stream of blocking calls, run in order on the lane's own thread (or inline)."""

    def __init__(
        self, name: str, mode: ComputeMode = "thread", torch_threads: int = 0, share: int = 1,
        adapt: bool = False,
    ) -> None:  # fmt: skip
        self.name = name
        self.mode = mode
        # torch's intra-op thread count is per OS thread: a fixed count for each lane,
        # or (0) the machine's cores over ``share`` (the lanes that may compute side by
        # side), or with ``adapt`` the free cores over it, re-read before each call
        # (corun/execution/cores.py).
        self.torch_threads = torch_threads
        self._budget = cores.ThreadBudget(share, adapt) if torch_threads == 0 else None
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running: _Call | None = None  # the call the lane's thread is in
        self.abandoned = 0  # calls given up on (see `abandoning`)
        self.closed = False  # by `close`: later calls raise LaneClosed
        self._signals: list[_TrioSignal] = []  # free ones (trio), at most _SIGNALS_KEPT
        self._signals_out = 0  # signals held by calls in flight

    @property
    def threads(self) -> int | None:
        """The torch threads each call uses (None: following the free cores)."""
        if self._budget is None:
            return self.torch_threads
        return None if self._budget.adapt else self._budget.fixed

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.closed:
            raise LaneClosed(f"lane {self.name!r} was closed: its run has ended")
        if self.mode == "inline":
            # Lowest overhead; the event loop is blocked for the call's duration.
            if self._budget is not None:
                self._budget.start_call()
            return fn(*args)
        # A caller cancelled already never starts a call: once queued, the lane's thread
        # may start it before the loop delivers the cancellation (on trio the wait's own
        # epoll registration hands it the GIL).
        await anyio.lowlevel.checkpoint_if_cancelled()
        call = _Call(fn, args, self)
        self._start()
        self._calls.put(call)
        try:
            await call.returned(self)
        except anyio.get_cancelled_exc_class():
            call.cancel_requested = True
            grace = _grace.get()
            with anyio.CancelScope(shield=True) as waiting:
                if grace is not None:
                    waiting.deadline = anyio.current_time() + grace
                await call.returned(self)
            if not call.done:  # past its grace: a running call is left to its thread,
                if self._running is call:  # a queued one never starts (cancel requested)
                    self._abandon()
                raise
            if call.error is None:
                return cast(T, call.result)  # completed: the cancellation comes at the next await
            if isinstance(call.error, LaneCancelled):
                raise
        if call.error is not None:
            raise call.error
        return cast(T, call.result)

    def take_signal(self) -> _TrioSignal | None:
        """A signal for a trio call: a free one, a new one, or (with many calls in
        flight on this lane) None, and the call goes through ``run_sync_soon``."""
        if self._signals:
            self._signals_out += 1
            return self._signals.pop()
        if self._signals_out >= _SIGNALS_KEPT:
            return None
        self._signals_out += 1
        return _TrioSignal()

    def give_back_signal(self, signal: _TrioSignal) -> None:
        """A call's signal whose byte was read. One a call never returned from (left to
        its thread) is never given back: that thread may still write to it."""
        self._signals_out -= 1
        self._signals.append(signal)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, args=(self._calls,), name=f"corun-lane-{self.name}",
                daemon=True,
            )  # fmt: skip
            self._thread.start()

    def _serve(self, calls: queue.SimpleQueue[_Call | None]) -> None:
        preload.preload()  # before set-up imports them, holding the GIL (preload.py)
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
        while (call := calls.get()) is not None:
            if calls is self._calls:
                self._running = call
            call.run(self._budget)
            if self._running is call:
                self._running = None

    def _abandon(self) -> None:
        """Leave the thread to its running call (stuck); later calls get a fresh one."""
        stuck, old = self._thread, self._calls
        if stuck is None:
            return
        self.abandoned += 1
        _abandoned.append(stuck)
        self._calls, self._thread, self._running = queue.SimpleQueue(), None, None
        moved = False
        while True:  # calls queued behind the stuck one run on the fresh thread
            try:
                waiting = old.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                self._calls.put(waiting)
                moved = True
        old.put(None)  # should the stuck call ever return, its thread ends
        if moved:
            self._start()

    def close(self, timeout: float = 10.0) -> None:
        """End the lane's thread after the calls already queued, and wait for it.

        Waiting matters at process exit: a thread still unwinding torch's per-thread
        state while the interpreter shuts down aborts the process ("terminate called
        without an active exception"). By the time a run closes its lanes every call
        has returned, so the wait is short; a thread still in a call after ``timeout``
        is left to it (in :func:`abandoned_threads`).
        """
        self.closed = True
        if self._thread is not None:
            self._calls.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
                if self._thread.is_alive():  # stuck in a call: not waited on at exit
                    _abandoned.append(self._thread)
            self._thread = None
        while self._signals:
            self._signals.pop().close()


async def call_hook(lane: Lane, hook: Callable[..., Any], *args: Any) -> Any:
    """Await an async hook on the loop; run a plain one on ``lane``."""
    if inspect.iscoroutinefunction(hook):
        return await hook(*args)
    result = await lane.run(hook, *args)
    if inspect.isawaitable(result):
        return await _await(result)
    return result


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def blocking_io(mode: ComputeMode, fn: Callable[..., T], *args: Any) -> T:
    """File I/O off the event loop (a worker thread), or inline in inline compute mode,
    which uses no threads at all (and so also runs under a virtual clock)."""
    if mode == "inline":
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)
