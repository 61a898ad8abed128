"""Storage that refuses a write: a full disk (``ENOSPC``), a quota (``EDQUOT``) or the process's
file-size limit (``EFBIG``, ``ulimit -f``). One home for what bnlit does about it:

- :func:`replacing`: write-then-rename for the files a run or the cache keeps (the embedded corpus,
  the tokenizer, the metrics log, reports). A refused write leaves the previous file, or none, and
  no temporary file, and the error names the file it was writing (a refused ``write()`` alone does
  not), so the one-line message can say where.
- :data:`STORAGE_ERRORS` and :func:`storage_message`: the line ``bnlit.train`` prints for such an
  error: what refused, the path, and what frees it.
- :func:`check_free_space`: before any expensive work, a run whose checkpoint directory's
  filesystem cannot hold its first checkpoint (estimated from the model's size) is refused with the
  numbers. The cache's needs are not checked: what a data build writes depends on what cleaning
  keeps and, for hub sources, on a download whose size is unknown before it starts (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from bnlit.errors import CheckpointError
from bnlit.lost_rank import process_running

# the write errors that mean the storage, not bnlit, refused: what it is, and what frees it
STORAGE_ERRORS = {
    errno.ENOSPC: ("no space left on device", "free space under"),
    errno.EDQUOT: ("disk quota exceeded", "free space in your quota under"),
    errno.EFBIG: ("file too large for this process's file-size limit (ulimit -f)", "raise the limit or move"),
}


def is_storage_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in STORAGE_ERRORS


def storage_cause(e: BaseException) -> OSError | None:
    """The storage refusal under ``e`` (itself, or its cause or context, e.g. under the
    ``DatasetGenerationError`` that ``datasets`` raises when its Arrow writer hits a full disk)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if is_storage_error(e):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def storage_message(e: OSError, cache_dir: Any, output_dir: Any) -> str:
    """One line for a refused write: what refused, the file, and where to free space or move to."""
    what, fix = STORAGE_ERRORS.get(e.errno, STORAGE_ERRORS[errno.ENOSPC])
    where = f" writing {e.filename}" if e.filename else ""
    return (f"{what}{where}; {fix} paths.cache_dir={cache_dir} or paths.output_dir={output_dir} and rerun "
            "(shards, tokenizers and checkpoints are written to a temporary name and renamed, so earlier "
            "ones are intact)")


def tmp_path(path: Path) -> Path:
    """The temporary name a file is written under before it is renamed to ``path``."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files (:func:`tmp_path`) in and below ``directory`` whose writer
    is no longer running on this host: the debris of a killed process. Used on a run dir, which one
    run owns; a cache shared between hosts is left alone (a writer on another host is not seen)."""
    gone = []
    for p in Path(directory).rglob(".*.tmp*"):
        m = re.fullmatch(r"\..+\.tmp(\d+)", p.name)
        if m and p.is_file() and not process_running(int(m.group(1))):
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """``with replacing(path, "w") as f: f.write(...)``: the data goes to a temporary file beside
    ``path`` that replaces ``path`` only once it is complete. On any error the temporary file is
    removed; an ``OSError`` that names no file is raised again naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and not e.filename:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with replacing(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    with replacing(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


# ---- free space before a run ----------------------------------------------------------------------
# bytes per parameter of the weights by Lightning precision (a "-true" precision stores them in it)
WEIGHT_BYTES = {"bf16-true": 2, "16-true": 2, "64-true": 8, "64": 8, "transformer-engine": 2}
# optimizer state tensors per parameter, each of the weights' dtype, by optimizer class name
# (MuonAdamW: at least Muon's one momentum; AdamW's two on the embeddings and norms)
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "SGD": 1, "Adafactor": 1, "MuonAdamW": 1}


def checkpoint_bytes(n_params: int, precision: Any = "32-true", optimizer: str = "AdamW") -> int:
    """A lower bound on one training checkpoint's size: the weights and the optimizer's state
    (AdamW: two moments per parameter, in the weights' dtype), without the small extras (tokenizer,
    RNG states, loop counters; about 65 kB on the tiny preset's 2.0 MB). fp32 AdamW: 12 bytes per
    parameter."""
    weight = WEIGHT_BYTES.get(str(precision), 4)
    states = OPTIMIZER_STATES.get(optimizer.rsplit(".", 1)[-1], 2)
    return n_params * weight * (1 + states)


def existing_ancestor(path: Path) -> Path:
    """``path`` or the nearest directory above it that exists (where it will be made)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def check_free_space(checkpoint_dir: str | os.PathLike, n_params: int, files: int, precision: Any = "32-true",
                     optimizer: str = "AdamW") -> int:
    """Refuse (:class:`~bnlit.errors.CheckpointError`) when this process's file-size limit is below
    one checkpoint, or the filesystem of ``checkpoint_dir`` has less free space than ``files``
    checkpoints of the model need (the first save writes the step file and,
    with ``save_last``, ``last.ckpt``); return the bytes needed."""
    one = checkpoint_bytes(n_params, precision, optimizer)
    need = one * files
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < one:
        raise CheckpointError(
            f"this process's file-size limit (ulimit -f) is {human_bytes(limit)}, but one checkpoint file needs at "
            f"least {human_bytes(one)} ({n_params:,} parameters x {one // n_params} bytes, weights and "
            f"{optimizer.rsplit('.', 1)[-1]} state); raise the limit (ulimit -f unlimited) or train a smaller model")
    where = existing_ancestor(Path(checkpoint_dir))
    free = shutil.disk_usage(where).free
    if free < need:
        what = f"{files} checkpoint files" if files > 1 else "1 checkpoint file"
        raise CheckpointError(
            f"paths.checkpoint_dir={checkpoint_dir}: {human_bytes(free)} free on its filesystem ({where}), but the "
            f"first checkpoint needs at least {human_bytes(need)} ({what} of {human_bytes(one)}: {n_params:,} "
            f"parameters x {need // files // n_params} bytes, weights and {optimizer.rsplit('.', 1)[-1]} state); "
            "free space there or point paths.checkpoint_dir (or paths.output_dir) at a larger disk")
    return need
