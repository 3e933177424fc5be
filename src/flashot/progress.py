"""Progress display for long solves (``verbose=True``).

Uses ``tqdm`` when it is installed (``pip install flashot[progress]``), else a
plain line printer on stderr (at most a few lines per second).  The display is
updated only when the loop reads the error (every ``inner_iterations`` steps),
so it adds no device synchronisation of its own.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "make_progress"]


class Progress:
    """No-op progress (``verbose=False``)."""

    active = False

    def update(self, it: int, eps: float, err: float | None) -> None:
        pass

    def close(self, it: int, eps: float, err: float | None, status: str = "") -> None:
        pass


class _TqdmProgress(Progress):
    active = True

    def __init__(self, total: int, desc: str, file: TextIO):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, file=file, leave=True, dynamic_ncols=True)
        self.n = 0

    def update(self, it: int, eps: float, err: float | None) -> None:
        self.bar.update(it - self.n)
        self.n = it
        post = {"eps": f"{eps:.3g}"}
        if err is not None:
            post["err"] = f"{err:.3e}"
        self.bar.set_postfix(post, refresh=False)

    def close(self, it: int, eps: float, err: float | None, status: str = "") -> None:
        self.update(it, eps, err)
        if status:
            self.bar.set_description_str(f"{self.bar.desc} ({status})", refresh=False)
        self.bar.close()


class _LineProgress(Progress):
    active = True

    def __init__(self, total: int, desc: str, file: TextIO, min_interval: float = 0.5):
        self.total, self.desc, self.file = total, desc, file
        self.min_interval, self.last = min_interval, -float("inf")

    def _line(self, it: int, eps: float, err: float | None, status: str = "") -> None:
        e = "n/a" if err is None else f"{err:.3e}"
        tail = f" ({status})" if status else ""
        print(f"{self.desc}: iter {it}/{self.total}  eps={eps:.3g}  err={e}{tail}", file=self.file, flush=True)

    def update(self, it: int, eps: float, err: float | None) -> None:
        now = time.perf_counter()
        if now - self.last >= self.min_interval:
            self.last = now
            self._line(it, eps, err)

    def close(self, it: int, eps: float, err: float | None, status: str = "") -> None:
        self._line(it, eps, err, status)


def make_progress(verbose: bool, total: int, desc: str = "sinkhorn", file: TextIO | None = None) -> Progress:
    """A progress display for ``total`` iterations; a no-op unless ``verbose``."""
    if not verbose:
        return Progress()
    file = sys.stderr if file is None else file
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return _LineProgress(total, desc, file)
    return _TqdmProgress(total, desc, file)
