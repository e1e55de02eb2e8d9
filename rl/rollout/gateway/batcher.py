"""`Batcher`: concurrent requests' completions sampled together, one engine call at a time.

Each completion to sample is queued with its prompt ids and `rl.rollout.torch_engine.Sampling`; a task on the
app's event loop runs one ``engine.generate`` at a time on a thread of its own (the loop keeps serving).
While a batch runs, arriving completions wait; when the engine is free, every one waiting (at most
``max_rows``) goes into the next batch at once. When the engine was idle, the first arrival opens a
gathering that lasts while more keep coming: it closes once none has arrived for a gap of ``window_s``,
or of `STRAGGLER_SHARE` of the last engine call's time when that is longer, once ``max_rows`` wait, or
at the latest after `MAX_GATHER_WINDOWS` windows or `MAX_GATHER_SHARE` of the last call's time. So a
burst of calls that takes longer than one window to arrive is still one batch, and waiting for
stragglers costs at most a fraction of what an extra engine call would. A window of 0 never waits.

A completion may have a listener: it is called on the event loop with each token id and log-prob as the
engine samples them (streaming). A batch that fails is retried one completion at a time for those that
got no token yet, so one bad completion fails alone. The policy version in use when a batch starts is
returned with each generation.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rl.rollout.torch_engine import Generation, Sampling

STRAGGLER_SHARE = 0.1  # a gathering bridges gaps up to this share of the last engine call's time
MAX_GATHER_WINDOWS = 20  # the longest gathering after an idle engine's first arrival, in windows,
MAX_GATHER_SHARE = 0.25  # or in shares of the last engine call's time, whichever is longer

Listener = Callable[[int, float], None]  # (token id, log-prob), on the event loop


@dataclass(eq=False)
class _Job:
    context: list[int]
    sampling: Sampling
    future: asyncio.Future
    listener: Listener | None = None
    delivered: int = 0  # tokens handed to the listener


class Batcher:
    def __init__(self, engine, window_s: float, max_rows: int, seed: int) -> None:
        if window_s < 0 or max_rows < 1:
            raise ValueError(f"the batcher needs window_s >= 0 and max_rows >= 1, got {window_s}, {max_rows}")
        self.engine = engine
        self.window_s = window_s
        self.max_rows = max_rows
        self.version = 0  # the policy version of the engine's weights
        self.batch_sizes: deque[int] = deque(maxlen=1000)  # rows of each recent engine call
        self.last_call_s = 0.0  # how long the last engine call took
        self.engine_s = 0.0  # all engine calls so far, in seconds (a runner counts its waves' share)
        self._generator = torch.Generator().manual_seed(seed)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gateway-engine")
        self._queue: asyncio.Queue[_Job] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start gathering (on the running event loop)."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    @property
    def waiting(self) -> int:
        """Completions queued for a batch that has not started yet."""
        return 0 if self._queue is None else self._queue.qsize()

    async def generate(
        self,
        contexts: list[list[int]],
        sampling: list[Sampling],
        listeners: list[Listener | None] | None = None,
    ) -> list[tuple[Generation, int]]:
        """(generation, policy version) of each context, sampled in the batches of the queue;
        ``listeners[i]`` (if any) gets context ``i``'s tokens as they are sampled."""
        if self._queue is None:
            raise RuntimeError("the batcher is not started")
        listeners = listeners or [None] * len(contexts)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in contexts]
        for context, params, future, listener in zip(contexts, sampling, futures, listeners, strict=True):
            self._queue.put_nowait(_Job(context, params, future, listener))
        return list(await asyncio.gather(*futures))

    def _take_waiting(self, jobs: list[_Job]) -> None:
        while len(jobs) < self.max_rows and not self._queue.empty():
            jobs.append(self._queue.get_nowait())

    async def _gather(self) -> list[_Job]:
        """The next batch: every job waiting, or, when none was, a gathering from the first arrival."""
        if not self._queue.empty():  # they arrived while the engine was busy: no reason to wait more
            jobs: list[_Job] = []
            self._take_waiting(jobs)
            return jobs
        jobs = [await self._queue.get()]
        self._take_waiting(jobs)
        if self.window_s == 0:
            return jobs
        loop = asyncio.get_running_loop()
        gap = max(self.window_s, STRAGGLER_SHARE * self.last_call_s)
        closes = loop.time() + max(MAX_GATHER_WINDOWS * self.window_s, MAX_GATHER_SHARE * self.last_call_s)
        while len(jobs) < self.max_rows:
            left = min(gap, closes - loop.time())
            if left <= 0:
                break
            try:
                jobs.append(await asyncio.wait_for(self._queue.get(), left))
            except TimeoutError:
                break
            self._take_waiting(jobs)
        return jobs

    def _call(self, jobs: list[_Job], loop: asyncio.AbstractEventLoop) -> tuple[list[Generation], int]:
        version, started = self.version, time.perf_counter()
        limit = max(job.sampling.max_new_tokens for job in jobs)
        contexts = [job.context for job in jobs]
        sampling = [job.sampling for job in jobs]

        def on_step(step: list[tuple[int, int, float]]) -> None:
            loop.call_soon_threadsafe(self._deliver, jobs, step)

        streaming = {"on_step": on_step} if any(job.listener for job in jobs) else {}
        try:
            return self.engine.generate(contexts, limit, self._generator, sampling, **streaming), version
        finally:
            self.last_call_s = time.perf_counter() - started
            self.engine_s += self.last_call_s

    @staticmethod
    def _deliver(jobs: list[_Job], step: list[tuple[int, int, float]]) -> None:
        for row, token, logprob in step:
            job = jobs[row]
            if job.listener is not None and not job.future.done():
                job.delivered += 1
                job.listener(token, logprob)

    async def _sample(self, jobs: list[_Job]) -> None:
        """Run one batch and settle its jobs' futures."""
        loop = asyncio.get_running_loop()
        self.batch_sizes.append(len(jobs))
        try:
            generations, version = await loop.run_in_executor(self._executor, self._call, jobs, loop)
        except Exception as exc:
            retry = len(jobs) > 1
            alone = [job for job in jobs if retry and job.delivered == 0 and not job.future.done()]
            for job in jobs:
                if job not in alone and not job.future.done():
                    job.future.set_exception(exc)
            for job in alone:  # find the completion at fault: each of the others succeeds on its own
                await self._sample([job])
            return
        for job, generation in zip(jobs, generations, strict=True):
            if not job.future.done():
                job.future.set_result((generation, version))

    async def _run(self) -> None:
        while True:
            await self._sample(await self._gather())
