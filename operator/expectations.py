"""What this process created and its watches have not shown yet.

A pass decides from the indexes, and the indexes come from watches that lag the writes: a pass
that runs before the watch shows the pods (or the children) the previous pass created sees
them missing and creates them again, and the apiserver answers 409 after running the whole
admission chain. In a start-up burst of 100 jobs that was 600 pod creates in vain for 800 pods.
Kubernetes' own controllers keep the same memory for the same reason (the ReplicaSet and Job
controllers' `ControllerExpectations`, pkg/controller/controller_utils.go): a create is
expected from the moment it is sent until the watch shows the object, and a create already
expected is not sent again.

An expectation also ends if the create fails (nothing will come) or meets a 409 (the object was
there already, and the watch may have shown it before the create was expected), and at the
latest after
`ttl_s`: a watch that restarted and relisted after the object came and went shows it never,
and the object must then be created again (the same five minutes the Kubernetes controllers
allow would hold a job's pod back that long; the watch lags by seconds).

Thread-safe: passes record and end expectations from the worker threads, the watch handlers
from the event loop (a pass reads the job's beside its snapshot of the indexes: `pending`).
Holds only names, never a decision: a pass that skips a create it expects is in the same place
as one whose create met a 409.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Job = tuple[str, str]            # (namespace, job name)
Object = tuple[str, str]         # (kind, name)

TTL_S = 30.0


class Expectations:
    """Per job: the objects whose create was sent and not yet seen, each until when."""

    def __init__(self, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._until: dict[Job, dict[Object, float]] = {}

    def pending(self, job: Job) -> frozenset[Object]:
        """What the job's creates are waiting for now. A pass takes this beside its snapshot
        of the indexes and skips those creates: an object the watch shows after the snapshot
        was taken is in neither, and would otherwise be created again."""
        now = self.clock()
        with self._lock:
            return frozenset(obj for obj, until in self._until.get(job, {}).items()
                             if until > now)

    def expect(self, job: Job, kind: str, name: str) -> bool:
        """Record a create about to be sent. False if one is expected already (then the caller
        does not send it)."""
        now = self.clock()
        with self._lock:
            objects = self._until.setdefault(job, {})
            if objects.get((kind, name), 0.0) > now:
                return False
            objects[kind, name] = now + self.ttl_s
            return True

    def seen(self, job: Job, kind: str, name: str) -> None:
        """The watch showed the object (or the create failed): nothing more to wait for."""
        with self._lock:
            objects = self._until.get(job)
            if objects is not None:
                objects.pop((kind, name), None)
                if not objects:
                    del self._until[job]

    def forget(self, job: Job) -> None:
        """Drop everything the job's creates await (a new job of the same name starts)."""
        with self._lock:
            self._until.pop(job, None)

    def expired(self) -> int:
        """Forget what has run out of time (the housekeeping loop calls this); how many."""
        now = self.clock()
        gone = 0
        with self._lock:
            for job, objects in list(self._until.items()):
                for obj in [obj for obj, until in objects.items() if until <= now]:
                    del objects[obj]
                    gone += 1
                if not objects:
                    del self._until[job]
        return gone

    def __len__(self) -> int:
        with self._lock:
            return sum(len(objects) for objects in self._until.values())
