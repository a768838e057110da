"""An ordered, bounded map over worker processes that can be stopped at any moment.

`multiprocessing.Pool` shares one result pipe and its lock among all workers; stopping it while a worker is
halfway through sending a large result (the shard builder's are ~0.5 MB, far above a pipe's buffer) can leave
``Pool.terminate`` waiting forever for that lock. Here each worker has its own task and result pipes, each
worker's results come back in the order of its tasks, and the caller hands results over in task order; no lock
is shared, and stopping is killing the processes.

The calling process works too: of ``workers``, ``workers - 1`` are spawned, and a task that finds every one of
them busy is computed by the caller. Sending a chunk of text and receiving its tokens costs about 2 ms per MB
each way; a task kept here costs nothing of it, and the caller's core, which would otherwise wait for results,
is used.

A worker is busy when it holds ``in_flight_per_worker`` tasks it has not answered yet; answers already received
but not yet handed over do not count. The caller also does serial work between results (the shard builder
packs, writes, hashes and fsyncs), and a worker must not run dry meanwhile: with 16 tasks of about 25 ms each
it has some 0.4 s of work in hand. Measured with the shard builder on a 99-file corpus of One-Billion-Word shape
(2 cores, a 779k-word vocabulary), 2 workers against 1: 1.36x when a worker counted as busy with 2 tasks,
received ones included; 1.67x, 1.72x and 1.74x in three runs with 16 unanswered ones.
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


class WorkerError(RuntimeError):
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
    # spawn, not fork: workers import only what they need, and no thread of this process is copied mid-operation.
    context = multiprocessing.get_context("spawn")
    processes, senders, receivers = [], [], []
    try:
        for _ in range(workers - 1):
            task_receiver, task_sender = context.Pipe(duplex=False)
            result_receiver, result_sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_serve,
                daemon=True,
                args=(task_receiver, result_sender, function, initializer, initargs, finalizer),
            )
            process.start()
            task_receiver.close()
            result_sender.close()
            processes.append(process)
            senders.append(task_sender)
            receivers.append(result_receiver)

        def died(worker: int) -> WorkerError:
            processes[worker].join(timeout=1)
            return WorkerError(
                f"worker process {processes[worker].pid} died without a result (exit code {processes[worker].exitcode})"
            )

        # A thread per worker takes its replies off the pipe as they come: a worker never waits for this
        # process to finish a task of its own before it can send a result and go on.
        replies = [queue.SimpleQueue() for _ in receivers]

        def collect(worker: int) -> None:
            while True:
                try:
                    replies[worker].put(receivers[worker].recv())
                except (EOFError, OSError):
                    replies[worker].put(None)
                    return

        for worker in range(len(receivers)):
            threading.Thread(target=collect, args=(worker,), daemon=True).start()

        # Pending results in task order: [worker, reply]; the reply of a spawned worker's task is None until
        # received (a worker answers its tasks in the order it got them, so the oldest pending task of worker w
        # is the one its next reply belongs to).
        pending: collections.deque[list] = collections.deque()
        queued = [0] * len(senders)

        def send(worker: int, task: Any) -> None:
            try:
                senders[worker].send(task)
            except (BrokenPipeError, ConnectionResetError):
                raise died(worker) from None
            queued[worker] += 1
            pending.append([worker, None])

        def compute_here(call: Callable[..., Any], *arguments: Any) -> None:
            try:
                pending.append([_LOCAL, ("result", call(*arguments))])
            except Exception as error:  # raised when its turn comes, like a worker's
                pending.append([_LOCAL, ("error", error)])

        def ready() -> bool:
            worker, reply = pending[0]
            return reply is not None or not replies[worker].empty()

        def take() -> Any:
            worker, reply = pending.popleft()
            if reply is None:
                reply = replies[worker].get()
                if reply is None:
                    raise died(worker)
                queued[worker] -= 1
            kind, value = reply
            if kind == "error":
                raise value
            return value

        def unanswered(worker: int) -> int:
            return queued[worker] - replies[worker].qsize()

        for task in tasks:
            worker = min(range(len(senders)), key=unanswered)
            if unanswered(worker) < in_flight_per_worker:
                send(worker, task)
            else:
                compute_here(function, task)
            while pending and (ready() or len(pending) > 2 * workers * in_flight_per_worker):
                yield take()
        if finalizer is not None:
            for worker in range(len(senders)):
                send(worker, _Finalize())
            compute_here(finalizer)
        while pending:
            yield take()
        for sender in senders:
            sender.send(None)
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join()
        for connection in senders + receivers:
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
