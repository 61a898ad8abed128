"""A stop signal during ``python -m bnlit.train``'s imports is held, not lost.

The imports (torch, Lightning, Hydra, datasets) take seconds, and Python's own SIGINT handler raises
``KeyboardInterrupt`` wherever the interpreter is: inside a ``__del__`` or a weakref callback Python
prints "Exception ignored in" and goes on, and the run then trained to the end with exit code 0
(chaos.py, issue 27). ``bnlit.train`` calls :func:`hold` before its heavy imports; the handler only
remembers the signal. :func:`release` puts the earlier handlers back and gives the signal, which
``bnlit.train`` raises again once :class:`bnlit.interrupt.StopAtOnce` is in place: the run stops
with exit code 128+signal and one line, like a signal a moment later. No import here but
``signal``: this module is imported before everything else."""

from __future__ import annotations

import signal
from typing import Any

HELD = (signal.SIGINT, signal.SIGTERM)
_before: dict[int, Any] = {}
_pending: list[int] = []


def hold(signums: tuple[int, ...] = HELD) -> None:
    """Remember ``signums`` instead of acting on them until :func:`release`."""
    for s in signums:
        _before[s] = signal.signal(s, _remember)


def _remember(signum: int, frame: Any) -> None:
    _pending.append(signum)  # raising here could land in a __del__, where Python ignores it


def release() -> int | None:
    """Put back the handlers :func:`hold` replaced (where nothing replaced it since); the first
    signal that came meanwhile, or None."""
    for s, h in _before.items():
        if signal.getsignal(s) is _remember:
            signal.signal(s, h if h is not None else signal.SIG_DFL)
    _before.clear()
    first = _pending[0] if _pending else None
    _pending.clear()
    return first
