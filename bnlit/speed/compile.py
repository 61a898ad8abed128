"""``torch.compile`` the way torchtitan does it, and a watch that says when it compiles again.

:func:`compile_model` compiles each transformer ``Block`` on its own and the output head's loss on
its own (``module.compile: true``). The blocks are identical code, so Dynamo traces one and every
other block reuses its graph: a 28-layer model costs one block compile, not a 28-layer graph
(``docs/throughput.md`` has the first-step wall times, whole model against per block). Shapes are
static (``dynamic=False``): every forward of a run happens at one of two shapes-and-modes, the
training micro-batch with gradients and the same shape without (validation pads a short batch,
:mod:`bnlit.evaluation.multiple_choice` pads its rows; the gradient-flow parity probe runs the
training shape), so a new shape would only mean a recompile, never a faster graph.

:class:`CompileWatch` counts Dynamo's compiles in this process by *kind* (``train``: gradients
on; ``eval``: inference mode or ``no_grad``) and code (a block's ``forward``, the loss). The first
compile of each code in each kind is the warm-up; any later one is a recompile, which costs
compile time in the middle of a run and, past ``torch._dynamo.config.recompile_limit``, silently
falls back to eager. :meth:`CompileWatch.poll` returns the compiles since its last call, a recompile
with Dynamo's own reason (the guard that failed: "tensor 'x' size mismatch at index 0. expected 16,
actual 8"): :class:`bnlit.module.LMModule` logs each first compile with the step
(:func:`compile_line`) and warns about each recompile (:func:`recompile_warning`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

log = logging.getLogger("bnlit")


@functools.lru_cache(maxsize=None)
def compiled(fn: Callable, fullgraph: bool = False, backend: str = "inductor") -> Callable:
    """``torch.compile(fn)`` with static shapes, once per function: the module sets its loss at
    every ``configure_model`` (a validation before the fit, then the fit), and a second
    ``torch.compile`` of the same function would be a second cache entry, i.e. a recompile."""
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False, backend=backend)


def is_compiled(fn) -> bool:
    """Whether ``fn`` (a function or module) is a ``torch.compile`` wrapper or a module compiled in
    place (``nn.Module.compile``)."""
    return (getattr(fn, "_compiled_call_impl", None) is not None or hasattr(fn, "_torchdynamo_orig_callable")
            or isinstance(fn, torch._dynamo.eval_frame.OptimizedModule))


def compile_model(model: nn.Module, fullgraph: bool = False, per_block: bool = True, backend: str = "inductor") -> None:
    """Compile ``model`` (a :class:`bnlit.model.Transformer`) in place, parameter names unchanged.

    ``per_block`` (what ``module.compile: true`` does): each block of ``model.layers`` and the
    output head's loss ``model.loss_fn``, each its own graph; the embedding lookup, the final norm
    and the rest of ``forward`` stay eager (microseconds). ``per_block=False`` compiles the whole
    ``forward`` as one graph, the loss inside it (kept to measure against: ``scripts/bench_compile.py``).
    ``backend``: Inductor; tests pass ``eager`` or ``aot_eager`` to trace without code generation.
    """
    if not per_block:
        model.compile(fullgraph=fullgraph, dynamic=False, backend=backend)
        return
    for block in model.layers:
        block.compile(fullgraph=fullgraph, dynamic=False, backend=backend)
    compile_loss(model, fullgraph, backend)


def compile_loss(model: nn.Module, fullgraph: bool = False, backend: str = "inductor") -> None:
    """``model.loss_fn`` compiled on its own (the head's matmul, log-sum-exp and, for the chunked
    loss, its gradients): once per loss function, so setting it again reuses the graph."""
    fn = model.loss_fn
    if not is_compiled(fn):
        model.loss_fn = compiled(fn, fullgraph, backend)


def current_kind() -> str:
    """The kind of forward Dynamo compiles for now: ``train`` with gradients, else ``eval``
    (inference mode and ``no_grad`` alike: both are compiled graphs without autograd)."""
    return "train" if torch.is_grad_enabled() else "eval"


@dataclass(frozen=True)
class CompileEvent:
    compile_id: str  # Dynamo's "frame/count": "0/2" is frame 0's third compile
    code: str  # the compiled function, "forward (bnlit/model.py:141)"
    kind: str  # train or eval
    recompile: bool  # a later compile of a code already compiled for this kind
    reason: str | None  # Dynamo's guard failure that caused it (None for a first compile)
    seconds: float | None  # Dynamo's time for the forward frame (its backward compiles at first use)
    new_thread_count: bool = False  # a recompile at a torch thread count this code and kind never compiled at

    def describe(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"{self.code} [{self.kind}] compile {self.compile_id}{why}"


class CompileWatch:
    """Dynamo's compiles in this process since :meth:`start` (see the module docstring). Cheap:
    one callback per compile, nothing per step."""

    def __init__(self):
        self._events: list[CompileEvent] = []
        self._pending: list[tuple[str, str, int]] = []  # (compile id, kind, torch threads) not yet resolved
        self._seen: dict[tuple[str, str], set[int]] = {}  # (frame id, kind) compiled -> its thread counts
        self._callback = None
        self._reported = 0

    def start(self) -> CompileWatch:
        if self._callback is None:
            self._callback = torch._dynamo.callback_handler.register_end_callback(self._on_compile)
        return self

    def stop(self) -> None:
        if self._callback is not None:
            torch._dynamo.callback_handler.remove_end_callback(self._callback)
            self._callback = None

    def _on_compile(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger == CallbackTrigger.DYNAMO:  # not a lazily compiled backward
            self._pending.append((str(args.compile_id), current_kind(), torch.get_num_threads()))

    def _resolve(self) -> None:
        if not self._pending:
            return
        from torch._dynamo.utils import get_compilation_metrics

        # one entry per forward frame (a lazily compiled backward adds one with is_forward False)
        metrics = {str(m.compile_id): m for m in get_compilation_metrics() if m.is_forward is not False}
        for compile_id, kind, threads in self._pending:
            m = metrics.get(compile_id)
            frame = compile_id.split("/")[0]
            code = (f"{m.co_name} ({'/'.join(str(m.co_filename).split('/')[-2:])}:{m.co_firstlineno})" if m
                    else f"frame {frame}")
            counts = self._seen.setdefault((frame, kind), set())
            recompile, new_threads = bool(counts), bool(counts) and threads not in counts
            counts.add(threads)
            reason = m.recompile_reason if m else None
            self._events.append(CompileEvent(compile_id, code, kind, recompile, reason,
                                            m.entire_frame_compile_time_s if m else None, new_threads))
        self._pending.clear()

    @property
    def events(self) -> list[CompileEvent]:
        """Every compile so far, in order."""
        self._resolve()
        return list(self._events)

    def poll(self) -> list[CompileEvent]:
        """The compiles since the last poll, first compiles and recompiles alike (each reported
        once): the caller logs a first compile and warns about a recompile."""
        if not self._pending and self._reported == len(self._events):
            return []  # the common case, every training step: nothing compiled
        events = self.events
        new = events[self._reported:]
        self._reported = len(events)
        return new

    @property
    def recompiles(self) -> list[CompileEvent]:
        return [e for e in self.events if e.recompile]

    def summary(self) -> str:
        """``torch.compile: 4 graphs (train 2, eval 2), 0 recompiles`` for the log and the summary."""
        kinds = {}
        for e in self.events:
            if not e.recompile:
                kinds[e.kind] = kinds.get(e.kind, 0) + 1
        per_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: kv[0] != "train"))
        graphs, recompiles = len(self.events) - len(self.recompiles), len(self.recompiles)
        plural = lambda n: "" if n == 1 else "s"  # noqa: E731
        threads = sum(thread_count_recompile(e) for e in self.recompiles)
        for_threads = f" ({threads} for a new thread count)" if threads else ""
        loaded = self.cache_loads()
        from_cache = f" ({loaded} loaded from Inductor's cache)" if loaded else ""
        return (f"torch.compile: {graphs} graph{plural(graphs)} ({per_kind or 'none'}), "
                f"{recompiles} recompile{plural(recompiles)}{for_threads}, {self.seconds():.1f} s compiling{from_cache}")

    def cache_loads(self) -> int:
        """How many of this watch's compiles (first compiles and recompiles) were loaded whole from
        Inductor's on-disk caches (AOTAutograd's: the forward and, for training, its backward)
        rather than compiled: a warm cache, or a child that compiled them first
        (:mod:`bnlit.speed.compile_ahead`)."""
        from torch._dynamo.utils import get_compilation_metrics

        ids = {e.compile_id for e in self.events}
        return sum(1 for m in get_compilation_metrics()
                   if str(m.compile_id) in ids and m.is_forward is not False and (m.aotautograd_local_cache_hit_count or 0))

    def seconds(self) -> float:
        """Compile time of this watch's graphs, forward and backward, as Dynamo recorded it."""
        from torch._dynamo.utils import get_compilation_metrics

        ids = {e.compile_id for e in self.events}
        total = 0.0
        for m in get_compilation_metrics():
            if str(m.compile_id) in ids:
                total += (m.entire_frame_compile_time_s if m.is_forward is not False else (m.duration_us or 0) / 1e6) or 0.0
        return total


def compile_line(event: CompileEvent, step: int) -> str:
    """The log line of a first compile: ``torch.compile: compiled forward (bnlit/model.py:141)
    [train] compile 0/0 at step 0 (3.2 s)``; tests/speed/test_recompiles.py reads these lines back."""
    took = f" ({event.seconds:.1f} s)" if event.seconds is not None else ""
    return f"torch.compile: compiled {event.describe()} at step {step}{took}"


def thread_count_recompile(event: CompileEvent) -> bool:
    """A recompile at a torch thread count the code and kind never compiled at: Inductor's CPU code
    is built per count (Dynamo's guard ``GLOBAL_STATE changed: num_threads``; its reason may name
    another cached entry's guard, such as ``grad_mode``), and ``callbacks.threads`` changes the
    count with the load, so it is expected once per count (a count seen before reuses its graph)."""
    return event.recompile and event.new_thread_count


def recompile_warning(event: CompileEvent, step: int | None = None, limit: int | None = None) -> str:
    limit = torch._dynamo.config.recompile_limit if limit is None else limit
    at = f" at step {step}" if step is not None else ""
    return (f"torch.compile recompiled after warm-up{at}: {event.describe()}. Each recompile costs compile time "
            f"mid-run, and after {limit} of one function Dynamo falls back to eager without a word; a forward "
            "at a new shape or mode is the usual cause (bnlit pads evaluation to the training shape)")
