"""Used tf.data iterators are destroyed off the training loop.

Destroying a tf.data iterator that has produced elements, with autotuning on (tf.data's
default), joins the iterator's autotuning thread, and that join often lasts until the thread's
current sleep ends; the sleep doubles from 10 ms to 60 s while the iterator lives (TensorFlow
2.21, `RootDataset::Iterator::~Iterator`, `Model::OptimizeLoop`; BUILD_NOTES, "Upstream
bugs"). No CPU is used: 0.5-0.6 s after epochs of 0.6 s and 1.7-10 s after epochs of 8-16 s,
at about one epoch start in five in a 3-worker cluster (never with autotuning off); up to
41 s for an iterator destroyed a minute after its use. Keras drops an epoch's iterator at the
next epoch's first step, so the wait lands on the training loop, and across workers every
worker waits for the one that pays it, in the step's all-reduce.

An `IteratorKeeper` holds the iterators of our strategies' distributed datasets and lets go
of each once nothing else refers to it (it looks every `POLL_S`), on a thread of its own: the
destruction and its wait happen there (TensorFlow releases the GIL while it destroys a tensor
handle: canary `tests/test_upstream_iterators.py -k releases_the_gil`), and one long wait does
not delay the next iterator's. At exit the keeper lets go of everything it holds and waits at most
`EXIT_TIMEOUT_S` for the destructions.
"""

import atexit
import logging
import sys
import threading
import time
from typing import Any, List, Optional

logger = logging.getLogger(__name__)

# How often the keeper looks for iterators nothing else refers to: how long an iterator's
# buffers (shuffle, prefetch) may outlive their use; a look costs microseconds.
POLL_S = 0.2
# The longest wait at exit for the destructions: the autotuning thread sleeps up to 60 s
# (`kOptimizationPeriodMaxMs`, TensorFlow 2.21) once its iterator has lived that long.
EXIT_TIMEOUT_S = 90.0
# `sys.getrefcount(self._held[i])` of an iterator only the keeper refers to: the list's
# reference and the call's argument.
_ONLY_HELD_HERE = 2


class IteratorKeeper:
    """Holds iterators and destroys each off the caller's thread once nothing else refers to it.

    Args:
        poll_s: seconds between two looks for iterators to let go of (default `POLL_S`).

    A thread of the keeper looks while it holds something; each iterator let go of is
    destroyed on a thread of its own, so that one long wait does not delay the others (an
    iterator's wait grows the longer it lives).
    """

    def __init__(self, poll_s: float = POLL_S):
        if not poll_s > 0:
            raise ValueError(f"`poll_s` must be a positive number of seconds. Received: {poll_s!r}.")
        self._poll_s = poll_s
        self._held: List[Any] = []
        self._destroying: List[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def hold(self, iterator) -> None:
        """Holds `iterator` until nothing else refers to it, then destroys it off this thread.

        After `close`, does nothing: the iterator is destroyed wherever its last reference goes.
        """
        with self._lock:
            if self._stop.is_set():
                return
            self._held.append(iterator)
            if self._thread is None:
                self._thread = threading.Thread(target=self._look, daemon=True,
                                                name="tf_hetbatch-iterator-release")
                self._thread.start()

    @property
    def num_held(self) -> int:
        """How many iterators the keeper holds now, not counting those being destroyed."""
        with self._lock:
            return len(self._held)

    def close(self, timeout: float = EXIT_TIMEOUT_S) -> bool:
        """Lets go of every iterator held and waits at most `timeout` s for the destructions.

        Returns:
            True if every destruction ended within `timeout` (a thread left inside
            TensorFlow's destructor at interpreter exit aborts the process).
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            looking = self._thread
        if looking is not None:
            looking.join(timeout)
        with self._lock:
            self._destroy(self._held)
            destroying = list(self._destroying)
        for thread in destroying:
            thread.join(max(deadline - time.monotonic(), 0.0))
        if any(thread.is_alive() for thread in destroying):
            logger.warning("Used tf.data iterators were still being destroyed after %.0f s; "
                           "going on without waiting for them.", timeout)
            return False
        return True

    def _look(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                kept, unreferenced = [], []
                for i in range(len(self._held)):
                    only_here = sys.getrefcount(self._held[i]) <= _ONLY_HELD_HERE
                    (unreferenced if only_here else kept).append(self._held[i])
                self._held = kept
                self._destroy(unreferenced)
                if not self._held:  # decided under the lock, so `hold` starts a new thread
                    self._thread = None
                    return
        with self._lock:
            self._thread = None

    def _destroy(self, iterators: List[Any]) -> None:
        """Empties `iterators`, each into a thread of its own that drops it (under the lock)."""
        while iterators:
            last_reference = [iterators.pop()]
            thread = threading.Thread(target=self._drop, args=(last_reference,), daemon=True,
                                      name="tf_hetbatch-iterator-destroy")
            self._destroying.append(thread)
            thread.start()

    def _drop(self, last_reference: List[Any]) -> None:
        last_reference.clear()  # the destruction, and its wait, run here
        with self._lock:
            self._destroying.remove(threading.current_thread())


_keeper: Optional[IteratorKeeper] = None
_keeper_lock = threading.Lock()


def hold(iterator) -> None:
    """Hands `iterator` to this process's keeper (made, with its exit hook, on first use)."""
    global _keeper
    with _keeper_lock:
        if _keeper is None:
            _keeper = IteratorKeeper()
            atexit.register(_keeper.close)
        keeper = _keeper
    keeper.hold(iterator)
