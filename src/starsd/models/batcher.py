"""One pass for the passes that a target's streams ask for at about the same time (both engines).

Each stream of a target server is driven by a thread of its own (star/target_server.py); when it
needs a pass it submits a Job and waits. The Batcher's thread gathers the jobs and hands them to its
engine's `run` together: one llama_decode (models/llamacpp.py), or one forward pass over rows of
different lengths (models/target.py). Each job learns its share of the pass's time (`ms`): what a
draft costs its stream when others share the pass (spec_decode/decode.py reads it as seq.pass_ms).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import dataclass, field


@dataclass
class Job:
    """A stream's share of a pass; its engine says what it holds and its `size` (rows of the pass)."""

    done: threading.Event = field(default_factory=threading.Event)
    ms: float = 0.0  # its share of the pass's time, once done
    error: BaseException | None = None

    @property
    def size(self) -> int:
        raise NotImplementedError


class Batcher:
    """Gathers the jobs a target's streams submit into one pass, on a thread of its own.

    A pass starts as soon as every open stream has asked for one, or GATHER_S after the first ask,
    whichever comes first: a stream that is waiting for its draft, or sending its tokens, does not
    hold the others back for longer than that. Jobs go in the order asked, as many as `capacity`
    rows hold (the first always). A pass that fails is tried again for each job alone, so that
    only the stream whose rows the engine refuses hears of it.

    The thread ends when its engine is closed (`close`: at once, jobs still waiting get an error) or
    dropped: it holds the engine weakly (`run` is a bound method of it), looks every IDLE_S whether
    it is still there, and ends without it, so that the engine's memory goes with it."""

    GATHER_S = 0.004
    IDLE_S = 1.0  # how often an idle thread looks whether its engine is still there

    def __init__(self, run, capacity: int, name: str):
        self.run = weakref.WeakMethod(run)  # runs a list of jobs as one pass, under the engine's lock
        self.capacity = capacity  # rows one pass takes
        self.cond = threading.Condition()
        self.waiting: list[Job] = []
        self.open = 0  # streams that will ask for passes (started, not ended)
        self.asked = 0  # jobs submitted, in all
        self.passes = 0  # passes run for them
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Wait until `job` is done (its results and share of the pass set), or raise its error."""
        with self.cond:
            if self.closed:
                raise RuntimeError("the target engine was closed")
            self.waiting.append(job)
            self.asked += 1
            self.cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error

    def opened(self, n: int) -> None:
        with self.cond:
            self.open += n
            self.cond.notify_all()

    def close(self) -> None:
        """End the thread (after the pass it may be running); jobs still waiting fail."""
        with self.cond:
            self.closed = True
            for job in self.waiting:
                job.error = RuntimeError("the target engine was closed")
                job.done.set()
            self.waiting.clear()
            self.cond.notify_all()
        # not from the thread itself (its engine's last reference may drop there), nor at the
        # interpreter's exit (an engine's __del__ then; a daemon thread no longer runs to end)
        if threading.current_thread() is not self.thread and not sys.is_finalizing():
            self.thread.join()

    def _take(self) -> list[Job] | None:
        """The jobs of the next pass; None once the engine is closed or gone."""
        with self.cond:
            while not self.waiting:
                if self.closed or self.run() is None:
                    return None
                self.cond.wait(self.IDLE_S)
            until = time.monotonic() + self.GATHER_S
            while len(self.waiting) < self.open and (left := until - time.monotonic()) > 0:
                self.cond.wait(left)
            if self.closed:
                return None
            taken: list[Job] = []
            rows = 0
            while self.waiting and (not taken or rows + self.waiting[0].size <= self.capacity):
                taken.append(self.waiting.pop(0))
                rows += taken[-1].size
            self.passes += 1
            return taken

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            self._pass(taken)
            for job in taken:
                job.done.set()

    def _pass(self, taken: list[Job]) -> None:
        """Run the jobs as one pass (the engine is held only while it runs)."""
        run = self.run()
        if run is None:  # (a stream submits only through its engine, which it holds)
            for job in taken:
                job.error = RuntimeError("the target engine was closed")
            return
        try:
            run(taken)
        except BaseException as e:  # one stream's rows must not fail the others': each alone
            for job in taken:
                try:
                    if len(taken) > 1:
                        run([job])
                    else:
                        job.error = e
                except BaseException as alone:
                    job.error = alone
