"""Progress of the long waits (layer timing, the search) on stderr: k of n, the elapsed time and an
ETA. A tqdm bar on a terminal; plain lines, at most one every `every_s`, when stderr is not a
terminal or the command prints JSON (`plain(True)`), so logs stay readable."""
from __future__ import annotations

import sys
import time

_PLAIN = False


def plain(on: bool = True) -> None:
    """Plain lines from now on, also on a terminal (`--json`)."""
    global _PLAIN
    _PLAIN = on


def clock(s: float) -> str:
    """Seconds as m:ss."""
    s = int(round(s))
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """`total` steps of `desc`; `update(note=...)` after each. A context manager."""

    def __init__(self, total: int, desc: str, unit: str = "step", stream=None, every_s: float = 2.0):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.t0, self.last = 0, time.monotonic(), -float("inf")
        self.bar = None
        if not _PLAIN and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True, leave=False)

    def line(self, note: str = "") -> str:
        """'desc: k/n units, 0:12 elapsed, ETA 0:30[, note]'."""
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta_text = clock(eta) if self.done else "?"
        return (f"{self.desc}: {self.done}/{self.total} {self.unit}s, {clock(elapsed)} elapsed, ETA {eta_text}"
                + (f", {note}" if note else ""))

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done >= self.total:
            print(self.line(note), file=self.stream, flush=True)
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Progress", "clock", "plain"]
