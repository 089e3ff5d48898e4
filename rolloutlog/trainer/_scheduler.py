"""When a trainer checkpoints: on a timer, on SIGUSR1 (and go on), on SIGTERM (and stop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

from rolloutlog.errors import CheckpointInProgress, StaleController
from rolloutlog.trainer._async_client import AsyncTrainerClient
from rolloutlog.trainer._types import CheckpointInfo

__all__ = ["CheckpointScheduler"]

logger = logging.getLogger("rolloutlog.trainer")


class CheckpointScheduler:
    """Takes the checkpoints of one run for a trainer that holds its controller epoch.

    - every ``checkpoint_every_s`` seconds (counted from the end of the previous checkpoint);
    - on ``SIGUSR1``: a checkpoint, and training goes on;
    - on ``SIGTERM``: a last checkpoint, then ``stop_requested`` is set for the training loop.

    ``install_signal_handlers()`` binds the signals to the running loop (``stop()`` unbinds them).
    A checkpoint refused because another is pending is skipped; a stale controller epoch (someone
    took over) stops the schedule and sets ``stop_requested`` — this trainer is fenced.
    """

    def __init__(
        self,
        client: AsyncTrainerClient,
        run: str,
        *,
        checkpoint_every_s: float | None = None,
        deadline_s: float | None = None,
        controller_epoch: int | None = None,
        on_checkpoint: Callable[[CheckpointInfo], Any] | None = None,
    ) -> None:
        if checkpoint_every_s is not None and not checkpoint_every_s > 0:
            raise ValueError("checkpoint_every_s must be positive")
        self.client = client
        self.run = run
        self.checkpoint_every_s = checkpoint_every_s
        self.deadline_s = deadline_s
        self.controller_epoch = controller_epoch
        self.on_checkpoint = on_checkpoint
        self.stop_requested = asyncio.Event()
        self.last: CheckpointInfo | None = None
        self.taken: list[CheckpointInfo] = []
        self.errors: list[BaseException] = []
        self.fenced = False
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._signals: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.checkpoint_every_s is not None and self._timer is None:
            self._timer = asyncio.create_task(self._every(self.checkpoint_every_s))

    async def stop(self) -> None:
        """Stop the timer, unbind the signals, let a checkpoint in flight finish."""
        self.remove_signal_handlers()
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- checkpoints -----------------------------------------------------------------------

    async def checkpoint_now(self, trigger: str = "request") -> CheckpointInfo | None:
        """Take a checkpoint now (one at a time); None when one was already pending."""
        async with self._lock:
            try:
                info = await self.client.checkpoint(
                    self.run,
                    controller_epoch=self.controller_epoch,
                    deadline_s=self.deadline_s,
                    trigger=trigger,
                )
            except CheckpointInProgress as e:
                logger.warning("checkpoint skipped: %s", e.message, extra={"run": self.run})
                return None
            except StaleController as e:
                self.fenced = True
                self.errors.append(e)
                self.stop_requested.set()
                logger.error("controller fenced: %s", e.message, extra={"run": self.run})
                raise
            self.last = info
            self.taken.append(info)
        if self.on_checkpoint is not None:
            result = self.on_checkpoint(info)
            if asyncio.iscoroutine(result):
                await result
        return info

    async def _every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.checkpoint_now("timer")
            except StaleController:
                return
            except Exception as e:  # keep the schedule going; the trainer sees ``errors``
                self.errors.append(e)
                logger.exception("timed checkpoint failed", extra={"run": self.run})

    # -- signals ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGUSR1: checkpoint and go on. SIGTERM: checkpoint, then set ``stop_requested``."""
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        loop.add_signal_handler(signal.SIGUSR1, self._spawn, "sigusr1", False)
        loop.add_signal_handler(signal.SIGTERM, self._spawn, "sigterm", True)
        self._signals = [signal.SIGUSR1, signal.SIGTERM]

    def remove_signal_handlers(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for signum in self._signals:
                self._loop.remove_signal_handler(signum)
        self._signals = []

    def _spawn(self, trigger: str, then_stop: bool) -> None:
        task = asyncio.ensure_future(self._signalled(trigger, then_stop))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _signalled(self, trigger: str, then_stop: bool) -> None:
        try:
            await self.checkpoint_now(trigger)
        except Exception as e:  # a signal has no caller to raise to: keep it for the trainer
            self.errors.append(e)
            logger.exception("checkpoint on %s failed", trigger, extra={"run": self.run})
        finally:
            if then_stop:
                self.stop_requested.set()

    async def wait_for_stop(self) -> None:
        """Until SIGTERM's checkpoint is done (or the controller was fenced)."""
        await self.stop_requested.wait()
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
