"""Progress lines while a run works: each slow step (an engine starting, a model loading, a capture,
a speculative run, the float64 calibration) as it begins, with the run's elapsed time, and a heartbeat
naming what is still awaited when a step goes quiet for longer than `heartbeat_s`. A real engine
start takes minutes; without these a run looks hung.

Two formats: `lines` (`[difftest] starting sglang (...)  (t+12.3s)`, the run's elapsed time last so a
line starts with what it says) and `json`, one object per line:
  {"event": "step", "elapsed_s": 12.3, "message": "starting sglang (...)"}
  {"event": "waiting", "elapsed_s": 42.3, "waited_s": 30.0, "message": "starting sglang (...)"}
`event` is "step" when a step begins and "waiting" for a heartbeat (the step named is still awaited,
`waited_s` since it began); `elapsed_s` counts from the run's start.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FORMATS = ("lines", "json", "off")
HEARTBEAT_S = 15.0


@dataclass
class Progress:
    """A `progress` hook for run.pool.Options: call it with a step's line; `idle()` when nothing is
    awaited (between a run's items), `close()` at the end. `write` gets whole lines, no newline."""

    format: str
    write: Callable[[str], None]
    heartbeat_s: float = HEARTBEAT_S
    _start: float = field(default_factory=time.monotonic)
    _step: str | None = None
    _step_start: float = 0.0
    _last_line: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"progress format {self.format!r}: expected one of {', '.join(FORMATS)}")

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._step, self._step_start, self._last_line = message, now, now
            self._emit("step", now, message)
        if self._thread is None and self.heartbeat_s > 0:
            # a daemon thread: a heartbeat must never keep a finished or interrupted run alive
            self._thread = threading.Thread(target=self._beat, name="difftest-progress", daemon=True)
            self._thread.start()

    def idle(self) -> None:
        """Nothing is awaited now: no heartbeat until the next step."""
        with self._lock:
            self._step = None

    def close(self) -> None:
        self._stop.set()
        self.idle()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            now = time.monotonic()
            with self._lock:
                if self._step is not None and now - self._last_line >= self.heartbeat_s:
                    self._last_line = now
                    self._emit("waiting", now, self._step)

    def _emit(self, event: str, now: float, message: str) -> None:
        elapsed = now - self._start
        waited = now - self._step_start
        if self.format == "off":
            return
        if self.format == "json":
            record: dict[str, object] = {"event": event, "elapsed_s": round(elapsed, 1), "message": message}
            if event == "waiting":
                record["waited_s"] = round(waited, 1)
            line = json.dumps(record)
        elif event == "waiting":
            line = f"[difftest] still waiting ({waited:.0f}s): {message}  (t+{elapsed:.1f}s)"
        else:
            line = f"[difftest] {message}  (t+{elapsed:.1f}s)"
        try:
            self.write(line)
        except (OSError, ValueError):  # the terminal went away (a closed pipe): the run goes on without it
            pass
