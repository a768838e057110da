"""An ordered, bounded map over worker processes that can be stopped at any moment.

`multiprocessing.Pool` shares one result pipe and its lock among all workers; stopping it while a worker is
halfway through sending a large result (the shard builder's are far above a pipe's buffer) can leave
``Pool.terminate`` waiting forever for that lock. Here each worker has its own task and result pipes, each
worker's results come back in the order of its tasks, and the caller hands results over in task order; no lock
is shared, and stopping is killing the processes.

The calling process works too: of ``workers``, ``workers - 1`` are spawned, and a task that finds every one of
them busy is computed by the caller. Sending a chunk of text and receiving its tokens costs time each way; a task
kept here costs nothing of it, and the caller's core, which would otherwise wait for results, is used.

A worker is busy when it holds ``in_flight_per_worker`` tasks it has not answered yet; answers already received
but not yet handed over do not count. The caller also does serial work between results (the shard builder
packs, writes, hashes and fsyncs), and a worker must not run dry meanwhile: with 16 unanswered tasks it has
work in hand for that time. Counting a worker busy with 2 tasks, received ones included, gave 2 workers a
markedly smaller speed-up over 1 (benchmarks/build_shards.py measures 2 workers against 1).
"""

from __future__ import annotations

import collections
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from txl_dist.exit_status import CommandFailure


class WorkerError(CommandFailure):
    """A worker process that died without a result (killed, out of memory, crashed)."""


class _Finalize:
    """The message that asks a worker for ``finalizer()`` after its last task."""


_LOCAL = -1  # the caller's own "worker" id in the queue of pending results


def ordered_map(
    function: Callable[[Any], Any],
    tasks: Iterable,
    workers: int,
    initializer: Callable,
    initargs: tuple = (),
    in_flight_per_worker: int = 16,
    finalizer: Callable[[], Any] | None = None,
    local_initargs: tuple | None = None,
) -> Iterator:
    """``map(function, tasks)`` over ``workers`` processes, this one included; results come in task order.

    ``workers - 1`` processes are spawned; each holds at most ``in_flight_per_worker`` unanswered tasks, and a
    task that finds all of them full is computed here. Results wait here until all earlier ones are handed over (at most
    about ``2 * workers * in_flight_per_worker`` of them), so memory does not grow with the number of tasks.
    ``initializer(*initargs)`` runs once in each spawned worker (load a tokenizer there) and
    ``initializer(*local_initargs)`` (default: ``initargs``) here. An exception raised by ``function`` is raised
    here, in the order of its task. Closing the iterator early (an error, Ctrl-C) kills the workers.

    With a ``finalizer``, every process calls it once after the last task, and its ``workers`` results follow
    the tasks' results: a worker can accumulate over its tasks (count words) and hand over the total once,
    instead of one large result per task.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    initializer(*(initargs if local_initargs is None else local_initargs))
    if workers == 1:
        yield from map(function, tasks)
        if finalizer is not None:
            yield finalizer()
        return
    pool = _Pool(function, initializer, initargs, finalizer)
    try:
        pool.start(workers - 1)
        waiting_limit = 2 * workers * in_flight_per_worker
        for task in tasks:
            worker = min(range(pool.size), key=pool.unanswered)
            if pool.unanswered(worker) < in_flight_per_worker:
                pool.send(worker, task)
            else:
                pool.compute_here(function, task)
            while pool.pending and (pool.ready() or len(pool.pending) > waiting_limit):
                yield pool.take()
        if finalizer is not None:
            for worker in range(pool.size):
                pool.send(worker, _Finalize())
            pool.compute_here(finalizer)
        while pool.pending:
            yield pool.take()
        pool.stop()
    finally:
        pool.close()


class _Pool:
    """The spawned workers of one `ordered_map`, each with its own task and result pipes, and the results pending
    in task order."""

    def __init__(self, function: Callable, initializer: Callable, initargs: tuple, finalizer: Callable[[], Any] | None):
        self._worker_args = (function, initializer, initargs, finalizer)
        self.processes: list = []
        self.senders: list[Connection] = []
        self.receivers: list[Connection] = []
        self.replies: list[queue.SimpleQueue] = []
        self.queued: list[int] = []
        # Pending results in task order: [worker, reply]; the reply of a spawned worker's task is None until
        # received (a worker answers its tasks in the order it got them, so the oldest pending task of worker w
        # is the one its next reply belongs to).
        self.pending: collections.deque[list] = collections.deque()

    @property
    def size(self) -> int:
        return len(self.senders)

    def start(self, count: int) -> None:
        # spawn, not fork: workers import only what they need, and no thread of this process is copied mid-operation.
        context = multiprocessing.get_context("spawn")
        for _ in range(count):
            task_receiver, task_sender = context.Pipe(duplex=False)
            result_receiver, result_sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_serve, daemon=True, args=(task_receiver, result_sender, *self._worker_args)
            )
            process.start()
            task_receiver.close()
            result_sender.close()
            self.processes.append(process)
            self.senders.append(task_sender)
            self.receivers.append(result_receiver)
        # A thread per worker takes its replies off the pipe as they come: a worker never waits for this
        # process to finish a task of its own before it can send a result and go on.
        self.replies = [queue.SimpleQueue() for _ in self.receivers]
        self.queued = [0] * len(self.senders)
        for worker in range(len(self.receivers)):
            threading.Thread(target=self._collect, args=(worker,), daemon=True).start()

    def _collect(self, worker: int) -> None:
        while True:
            try:
                self.replies[worker].put(self.receivers[worker].recv())
            except (EOFError, OSError):
                self.replies[worker].put(None)
                return

    def _died(self, worker: int) -> WorkerError:
        process = self.processes[worker]
        process.join(timeout=1)
        return WorkerError(f"worker process {process.pid} died without a result (exit code {process.exitcode})")

    def send(self, worker: int, task: Any) -> None:
        try:
            self.senders[worker].send(task)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(worker) from None
        self.queued[worker] += 1
        self.pending.append([worker, None])

    def compute_here(self, call: Callable[..., Any], *arguments: Any) -> None:
        try:
            self.pending.append([_LOCAL, ("result", call(*arguments))])
        except Exception as error:  # raised when its turn comes, like a worker's
            self.pending.append([_LOCAL, ("error", error)])

    def ready(self) -> bool:
        worker, reply = self.pending[0]
        return reply is not None or not self.replies[worker].empty()

    def take(self) -> Any:
        worker, reply = self.pending.popleft()
        if reply is None:
            reply = self.replies[worker].get()
            if reply is None:
                raise self._died(worker)
            self.queued[worker] -= 1
        kind, value = reply
        if kind == "error":
            raise value
        return value

    def unanswered(self, worker: int) -> int:
        return self.queued[worker] - self.replies[worker].qsize()

    def stop(self) -> None:
        """Ask every worker to end, and wait for it."""
        for sender in self.senders:
            sender.send(None)
        for process in self.processes:
            process.join()

    def close(self) -> None:
        """Kill the workers still running and close the pipes."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join()
        for connection in self.senders + self.receivers:
            connection.close()


def _serve(
    tasks: Connection,
    results: Connection,
    function: Callable,
    initializer: Callable,
    initargs: tuple,
    finalizer: Callable[[], Any] | None = None,
) -> None:
    """A worker: run ``function`` on each task (``finalizer`` on a `_Finalize`) until ``None``, sending
    ("result", value) or ("error", exc)."""
    # Ctrl-C reaches the whole process group; the parent decides, and stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A thread keeps the task pipe drained, so the parent never waits on a send while this process waits for
    # the parent to take a result.
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        while True:
            try:
                task = tasks.recv()
            except EOFError:
                task = None
            inbox.put(task)
            if task is None:
                return

    threading.Thread(target=receive, daemon=True).start()
    try:
        initializer(*initargs)
        failure = None
    except Exception as error:  # the answer to every task, so that the parent raises it in order
        failure = error
    while (task := inbox.get()) is not None:
        if failure is not None:
            reply = ("error", failure)
        else:
            try:
                reply = ("result", finalizer() if isinstance(task, _Finalize) else function(task))
            except Exception as error:
                reply = ("error", error)
        _send(results, reply)


def _send(results: Connection, reply: tuple[str, Any]) -> None:
    try:
        results.send(reply)
    except (pickle.PicklingError, TypeError, AttributeError) as error:  # pickling fails before anything is sent
        results.send(("error", RuntimeError(f"{reply[1]!r} (could not be sent from the worker: {error})")))
