"""An event loop (uvloop) on its own daemon thread, and the ways other threads hand it work.

Threads: the loop, its tasks and the set of tracked tasks belong to the loop's thread (a
transport names it "cgad-net-<end of its peer id>"). Other threads only ``call`` a coroutine and
wait for its result, or ``submit`` one to run in the background; both go through the loop's
thread-safe entry points, so nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch
import uvloop

__all__ = ["EventLoopThread", "side_worker"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def side_worker(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One thread for work beside training (encoding, decoding, snapshot packing), with one
    torch thread: its kernels are memory-bound, and a second OpenMP team beside the trainer's
    makes both spin on the same cores (3x slower measured on a busy machine; a lone `small`
    daemon trained at 0.65x its bare loop with them, development runs; docs/SCALE.md).

    ``torch.set_num_threads`` also sets the count threads take that have not run a parallel op
    yet: the creating thread (the trainer's, in a daemon) fixes its own first, and threads
    started later run torch on one thread unless they set their own.

    Args:
        name: the thread's name prefix.
    """
    torch.get_num_threads()  # fixes the calling thread's OpenMP team before the worker's call
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=torch.set_num_threads, initargs=(1,)
    )


class EventLoopThread:
    """Starts a loop on a daemon thread named ``name`` and runs it until ``stop``."""

    def __init__(self, name: str) -> None:
        self.loop = uvloop.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """From another thread: run ``coroutine`` on the loop and return its result (or raise its
        exception); after ``timeout`` seconds it is cancelled and ``TimeoutError`` raised."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # nobody waits for it any more
            raise

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """From any thread: run ``coroutine`` as a tracked background task."""
        self.loop.call_soon_threadsafe(self.spawn, coroutine)

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """On the loop's thread: run ``coroutine`` as a tracked task; its failure is logged."""
        task = self.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    async def cancel_tasks(self) -> None:
        """On the loop: cancel every tracked task and wait until they have all ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def running(self) -> bool:
        return self.loop.is_running()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop, wait up to ``timeout`` seconds for its thread, and close the loop once
        it has stopped."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.loop.is_running():
            self.loop.close()
