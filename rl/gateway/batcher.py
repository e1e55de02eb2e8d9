"""`Batcher`: concurrent requests' completions sampled together, one engine call at a time.

Each completion to sample is queued with its prompt ids and `rl.generation.Sampling`; a task on the
app's event loop takes the first one waiting, gathers more for up to ``batch_window_s`` (at most
``max_batch_rows``), and runs one ``engine.generate`` for all of them on a thread of its own (the loop
keeps serving). The policy version in use when a batch starts is returned with each generation.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rl.generation import Generation, Sampling


@dataclass
class _Job:
    context: list[int]
    sampling: Sampling
    future: asyncio.Future


class Batcher:
    def __init__(self, engine, window_s: float, max_rows: int, seed: int) -> None:
        self.engine = engine
        self.window_s = window_s
        self.max_rows = max_rows
        self.version = 0  # the policy version of the engine's weights
        self.batch_sizes: deque[int] = deque(maxlen=1000)  # rows of each recent engine call
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

    async def generate(
        self, contexts: list[list[int]], sampling: list[Sampling]
    ) -> list[tuple[Generation, int]]:
        """(generation, policy version) of each context, sampled in the batches of the queue."""
        if self._queue is None:
            raise RuntimeError("the batcher is not started")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in contexts]
        for context, params, future in zip(contexts, sampling, futures, strict=True):
            self._queue.put_nowait(_Job(context, params, future))
        return list(await asyncio.gather(*futures))

    async def _gather(self) -> list[_Job]:
        jobs = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        while len(jobs) < self.max_rows:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                jobs.append(await asyncio.wait_for(self._queue.get(), left))
            except TimeoutError:
                break
        return jobs

    def _call(self, jobs: list[_Job]) -> tuple[list[Generation], int]:
        version = self.version
        limit = max(job.sampling.max_new_tokens for job in jobs)
        contexts = [job.context for job in jobs]
        generations = self.engine.generate(contexts, limit, self._generator, [j.sampling for j in jobs])
        return generations, version

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._gather()
            self.batch_sizes.append(len(jobs))
            try:
                generations, version = await loop.run_in_executor(self._executor, self._call, jobs)
            except Exception as exc:  # the requests of this batch fail; the batcher goes on
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            for job, generation in zip(jobs, generations, strict=True):
                if not job.future.done():
                    job.future.set_result((generation, version))
