"""A GGUF export (``bnlit.export.export_gguf``) run in llama.cpp through ``llama-cpp-python``
(the ``serve`` extra: ``pip install -e ".[serve]"``): its tokenizer, its logits and its greedy
generation, in the shapes bnlit's own model and tokenizer use, so the same scoring code
(:func:`bnlit.evaluation.heldout.evaluate_stream`) and the same comparisons run on both.

llama.cpp keeps its KV cache in float16 by default; :func:`load_gguf` asks for a float32 cache, so
an f32 GGUF's logits are bnlit's up to float32 rounding, and a quantized file's differences are
those of its weights alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bnlit.errors import CheckpointError
from bnlit.export import gguf_text
from bnlit.raw_spellings import canonical_ids
from bnlit.speed.threads import available_cpus, choose_threads, load_average

GGML_TYPE_F32 = 0  # ggml_type of the KV cache


def load_gguf(path: str | os.PathLike, n_ctx: int | None = None, vocab_only: bool = False,
              n_threads: int | None = None):
    """``llama_cpp.Llama`` on ``path`` with every position's logits kept (``logits_all``), a float32
    KV cache and llama.cpp's log lines off. ``n_ctx``: default the model's trained context;
    ``n_threads``: default the idle cores (:func:`bnlit.speed.threads.choose_threads`, ``auto``: a thread
    without a core of its own spins at every barrier)."""
    try:
        import llama_cpp
    except ImportError:
        raise CheckpointError('scoring a GGUF needs llama-cpp-python: pip install -e ".[serve]"') from None
    path = Path(path)
    if n_threads is None:
        n_threads = choose_threads("auto", available_cpus(), load_average())[0]
    if not path.is_file():
        raise CheckpointError(f"--gguf {path}: no such file; write one with scripts/export_gguf.py")
    if vocab_only:  # no weights, but llama.cpp still makes a context: a small one
        n_ctx = n_ctx or 16
    try:
        with plain_cpu_buffers():
            llm = llama_cpp.Llama(str(path), n_ctx=n_ctx or 0, n_batch=n_ctx or 512, logits_all=True,
                                  vocab_only=vocab_only, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
                                  n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    except ValueError as e:  # llama-cpp-python: "Failed to load model from file"
        raise CheckpointError(f"--gguf {path}: llama.cpp could not load it ({e})") from None
    return llm


@contextlib.contextmanager
def plain_cpu_buffers():
    """``llama_cpp.Llama`` built inside this block loads its weights without llama.cpp's extra
    buffer types (``use_extra_bufts``: the CPU backend's repacked weight layouts), which
    llama-cpp-python's constructor does not expose. With them, llama.cpp 0.3.36 (llama-cpp-python
    0.3.36, built from source here) crashed with a segmentation fault in ``libggml-cpu`` on the
    first evaluation of a q8_0 file on a CPU with AMX (``amx_int8``); f32, f16 and bf16 files ran,
    and so did q8_0 with them off. Scoring wants llama.cpp's arithmetic, not its fastest layout."""
    import llama_cpp.llama as llama_module

    low = llama_module.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        if hasattr(p, "use_extra_bufts"):  # older llama.cpp: no such field
            p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def spelling_aliases_of(path: str | os.PathLike) -> dict[int, int]:
    """``{raw-spelling token id: id of the piece it spells}`` of a GGUF export (``{}`` for a file
    written before the export added them, or by another tool)."""
    import gguf

    from bnlit.export import ALIAS_OF_KEY, ALIAS_START_KEY

    fields = gguf.GGUFReader(path).fields
    if ALIAS_OF_KEY not in fields:
        return {}
    start = int(fields[ALIAS_START_KEY].contents())
    return {start + i: int(of) for i, of in enumerate(fields[ALIAS_OF_KEY].contents())}


class LlamaCppLM:
    """A GGUF file in llama.cpp with bnlit's interfaces: ``encode``/``encode_batch``/``eos_id``
    like :class:`bnlit.tokenizer.Tokenizer`, ``lm(idx)`` -> logits ``(B, T, V)`` like
    :class:`bnlit.model.Transformer`, and :meth:`generate_greedy`."""

    def __init__(self, path: str | os.PathLike, n_ctx: int | None = None, n_threads: int | None = None,
                 vocab_only: bool = False):
        self.path = Path(path)
        self.llm = load_gguf(path, n_ctx=n_ctx, n_threads=n_threads, vocab_only=vocab_only)
        meta = self.llm.metadata
        self.eos_id = int(meta["tokenizer.ggml.eos_token_id"])
        self.remove_extra_whitespaces = meta.get("tokenizer.ggml.remove_extra_whitespaces", "false") == "true"
        self.n_ctx = self.llm.n_ctx()
        self.file_type = int(meta.get("general.file_type", -1))
        self.alias_of = spelling_aliases_of(self.path)

    def canonical(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with each raw-spelling token (:mod:`bnlit.raw_spellings`) replaced by the id of
        the piece it spells, the id bnlit gives the normalised text."""
        return canonical_ids(ids, self.alias_of)

    def encode(self, text: str) -> list[int]:
        """llama.cpp's ids for ``text`` after the documented pre-call (:func:`bnlit.export.gguf_text`)."""
        return self.encode_raw(gguf_text(text, self.remove_extra_whitespaces))

    def encode_raw(self, text: str) -> list[int]:
        """llama.cpp's ids for ``text`` as given, as its CLI, server and ollama tokenize a prompt."""
        raw = text.encode("utf-8")
        return self.llm.tokenize(raw, add_bos=False, special=False) if raw else []

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """llama.cpp's ``llama_detokenize`` (what its CLI and server print: the space prefix of the
        first piece removed, as SentencePiece does; llama-cpp-python's ``detokenize`` keeps it)."""
        import llama_cpp

        arr = (llama_cpp.llama_token * len(ids))(*ids)
        vocab = self.llm._model.vocab
        need = -llama_cpp.llama_detokenize(vocab, arr, len(ids), None, 0, False, False)
        buf = ctypes.create_string_buffer(max(need, 1))
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, False)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 ``(len(ids), V)``: the logits after each of ``ids``, from an empty cache."""
        if not 0 < len(ids) <= self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit llama.cpp's context of {self.n_ctx}")
        self.llm.reset()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[:len(ids)], dtype=np.float32)

    def __call__(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)`` of the windows ``idx``. ``mask``: a boolean document mask
        (:func:`bnlit.document_masking.document_mask`): each document of a window then runs from an
        empty cache, so it attends to itself only. Its RoPE positions restart at 0, which changes
        rounding only (attention scores depend on distances inside the document)."""
        rows = []
        for b, row in enumerate(idx.cpu().tolist()):
            if mask is None:
                rows.append(self.logits(row))
                continue
            same = mask[b, 0].diagonal(-1).cpu()  # may token i attend to token i - 1?
            starts = [0] + [i + 1 for i in torch.nonzero(~same).flatten().tolist()] + [len(row)]
            rows.append(np.concatenate([self.logits(row[a:z]) for a, z in zip(starts, starts[1:]) if z > a]))
        return torch.from_numpy(np.stack(rows))

    def generate_greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The next ``max_new_tokens`` tokens by llama.cpp's own sampler at temperature 0 (argmax)."""
        out = []
        for token in self.llm.generate(list(ids), top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == max_new_tokens:
                break
        return out

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> LlamaCppLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
