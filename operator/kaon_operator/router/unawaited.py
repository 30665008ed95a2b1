"""Tasks the router starts and nobody awaits (a background check, a pod's KV-event follower, a tokenizer
fetch): their failure is logged here, as a warning naming the task, when it happens.

Without this a failed unawaited task's exception is never retrieved, and asyncio says so at error level
("Task exception was never retrieved") whenever the garbage collector happens to take the task: late,
without saying which task, and as an error the tests that forbid error-level logs fail on (a race a busy
machine opens: the third CI rehearsal of 2026-11-29 failed on one, in front.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable


def log_failure(logger: logging.Logger, what: str) -> Callable[[asyncio.Future], None]:
    """A done callback: a failed task's exception is retrieved and logged as a warning; a cancelled or
    finished one says nothing."""
    def done(task: asyncio.Future) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieving it is what keeps asyncio from logging it at collection
        if exc is not None:
            logger.warning("%s failed: %r", what, exc)
    return done


def keep(tasks: set[asyncio.Task], task: asyncio.Task, logger: logging.Logger, what: str) -> asyncio.Task:
    """Hold `task` in `tasks` until it is done (the loop keeps only a weak reference to a running task),
    then drop it, its failure logged."""
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    task.add_done_callback(log_failure(logger, what))
    return task
