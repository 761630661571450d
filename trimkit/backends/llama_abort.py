"""An abortable decode on a llama.cpp context, for calibration's probes.

- :func:`abort_when`: llama.cpp asks a Python predicate while it computes and stops the decode
  when it says so (``llama_set_abort_callback``; ``llama_decode`` returns 2 and llama-cpp-python
  raises ``RuntimeError``). Installed for one block only: a Python call per graph node would slow
  every request.
- The notice llama.cpp logs at error level when a decode is stopped ("decode: removing memory
  module entries …", printed on stderr even with ``verbose=False``) is a planned event here, not
  an error: it is dropped, on the probing thread, for a decode :func:`abort_when` stopped. Every
  other message goes to the log callback that was installed before (llama-cpp-python's, or the
  application's), through :func:`quiet_planned_aborts`.

:meth:`~trimkit.backends.llama.LlamaBackend.measure_prefill_within` builds on it; the caller
holds the engine's lease.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import llama_cpp

__all__ = ["AbortState", "abort_when", "quiet_planned_aborts"]


class AbortState:
    """Whether :func:`abort_when`'s predicate stopped the decode."""

    fired: bool = False


#: what llama.cpp logs (at error level) when a decode is stopped and its batch's cells are dropped
ABORT_NOTICE = b"removing memory module entries"
# the AbortState of the abortable decode running on this thread, if any
_RUNNING = threading.local()
_FILTER_LOCK = threading.Lock()
# the installed filter and the callback it forwards to (kept referenced while llama.cpp holds them)
_FILTER: list[Any] = []


def quiet_planned_aborts() -> bool:
    """Install, once per process, a llama.cpp log callback that drops :data:`ABORT_NOTICE` when
    it comes from a decode :func:`abort_when` stopped on the logging thread, and forwards every
    other message to the callback installed before it (``llama_log_get``; none: stderr, as
    llama.cpp would). False when this llama-cpp-python cannot say which callback was installed
    (nothing is changed then). An application that sets its own callback later replaces it."""
    with _FILTER_LOCK:
        if _FILTER:
            return True
        try:
            previous = llama_cpp.llama_log_callback()
            previous_data = ctypes.c_void_p()
            llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(previous_data))
        except (AttributeError, TypeError, ValueError, OSError):
            return False

        def forward(level: int, text: bytes | None, _data: Any) -> None:
            state = getattr(_RUNNING, "state", None)
            if state is not None and state.fired and text and ABORT_NOTICE in text:
                return
            if previous:
                previous(level, text, previous_data)
            elif text:
                os.write(2, text)

        callback = llama_cpp.llama_log_callback(forward)
        llama_cpp.llama_log_set(callback, None)
        _FILTER.extend((callback, previous, previous_data))
        return True


@contextmanager
def abort_when(llm: Any, should_abort: Callable[[], bool]) -> Iterator[AbortState]:
    """Within the block llama.cpp stops a decode of ``llm`` as soon as ``should_abort()`` is true
    (``llama_decode`` returns 2, so ``Llama.eval`` raises ``RuntimeError``; ``.fired`` tells it
    from another failure). A predicate that raises counts as true."""
    state = AbortState()

    def check(_data: Any) -> bool:
        try:
            stop = bool(should_abort())
        except Exception:  # never let an exception cross into C: stop instead
            stop = True
        if stop:
            state.fired = True
        return stop

    callback = llama_cpp.ggml_abort_callback(check)
    quiet_planned_aborts()
    outer = getattr(_RUNNING, "state", None)
    _RUNNING.state = state
    llama_cpp.llama_set_abort_callback(llm._ctx.ctx, callback, None)
    try:
        yield state
    finally:
        llama_cpp.llama_set_abort_callback(llm._ctx.ctx, llama_cpp.ggml_abort_callback(), None)
        _RUNNING.state = outer
        del callback  # kept alive until llama.cpp no longer holds it
