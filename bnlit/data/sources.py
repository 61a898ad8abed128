"""Data sources: where text comes from, its language tag and mixture weight, read through HF
``datasets``. A source is a local file (``.txt``, ``.jsonl``/``.json``, ``.parquet``), the
embedded default corpus (``embedded:bn``, ``embedded:en``) or a hub dataset id."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bnlit.errors import DataError
from bnlit.preflight import check_exists, check_jsonl_file, check_text_file  # noqa: F401 (re-exported)
from bnlit.storage import storage_cause

_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HUB_HOST = "huggingface.co"


@dataclass
class Source:
    """One entry of ``data.sources``.

    Args:
        name: unique short name (used in shard and metric names).
        language: ISO 639-1 tag (``bn``, ``en``, ...); validation slices are carved per language.
        path: a local file, ``embedded:<lang>``, or None when ``hub_id`` is set.
        hub_id: a Hugging Face dataset id, read with ``datasets.load_dataset``.
        hub_config: the dataset config (subset) name, e.g. ``20231101.bn``.
        hub_data_dir: a folder of the hub dataset's repository, for datasets split by folder
            rather than config (``ai4bharat/sangraha``: ``verified/ben``).
        split: dataset split.
        text_field: column holding the text (JSONL/Parquet/hub).
        weight: mixture weight (relative; its unit is ``data.weight_unit``).
        sample_by: for ``.txt`` files: ``paragraph`` (blank-line separated documents) or ``line``.
        streaming: stream a hub dataset instead of downloading it whole.
        max_docs: read at most this many documents (None: all).
    """

    name: str
    language: str
    path: str | None = None
    hub_id: str | None = None
    hub_config: str | None = None
    hub_data_dir: str | None = None
    split: str = "train"
    text_field: str = "text"
    weight: float = 1.0
    sample_by: str = "paragraph"
    streaming: bool = False
    max_docs: int | None = None
    field: str = "data.sources"  # where this source came from, for error messages

    def __post_init__(self) -> None:
        if (self.path is None) == (self.hub_id is None):
            raise DataError(f"{self.field}: set exactly one of path or hub_id")
        if self.weight < 0:
            raise DataError(f"{self.field}.weight={self.weight}: weights must be >= 0")
        if self.sample_by not in ("paragraph", "line", "document"):
            raise DataError(f"{self.field}.sample_by={self.sample_by!r}: use paragraph, line or document")

    @property
    def is_embedded(self) -> bool:
        return self.path is not None and self.path.startswith("embedded:")

    def to_dict(self) -> dict:
        # hub_data_dir only when set, so fingerprints of sources without it stay as they were
        return {k: v for k, v in asdict(self).items() if k != "field" and not (k == "hub_data_dir" and v is None)}


@dataclass
class Piece:
    """One task's share of a source: contiguous slice ``index`` of ``of`` (rows of a local file or
    an in-memory hub dataset; whole data files of a streamed one), ``source_index`` its position
    in ``data.sources``."""

    source: Source
    path: Path | None
    source_index: int
    index: int = 0
    of: int = 1


def fingerprint(source: Source, resolved_path: Path | None) -> str:
    """Content hash of a local file, or the identity of a hub dataset; shards are rebuilt when it
    changes."""
    h = hashlib.sha256(repr(sorted(source.to_dict().items())).encode())
    if resolved_path is not None:
        with resolved_path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def iter_documents(source: Source, resolved_path: Path | None, cache_dir: str | None = None,
                   piece: int = 0, pieces: int = 1) -> Iterator[str]:
    """Yield the non-empty documents of ``source`` in a stable order; with ``pieces`` > 1 only
    those of contiguous slice ``piece`` (:class:`Piece`), so the slices in order are the whole
    source in order."""
    if pieces > 1 and source.max_docs is not None:
        raise DataError(f"{source.field}.max_docs={source.max_docs}: a capped source is read by one task")
    ds = open_dataset(source, resolved_path, cache_dir)
    if source.text_field not in (ds.column_names or [source.text_field]):
        raise DataError(f"{source.field}.text_field={source.text_field!r}: not a column of "
                        f"{source.path or source.hub_id}; columns are {ds.column_names}")
    ds = _slice(ds, piece, pieces)
    n = 0
    for i, row in enumerate(ds or (), 1):
        text = row[source.text_field]
        if text is not None and not isinstance(text, str):
            raise DataError(f"{source.field}: row {i} of {source.path or source.hub_id}: {source.text_field!r} is "
                            f"{type(text).__name__} ({str(text)[:40]}), not a string; fix that row or choose another text_field")
        if text and text.strip():
            yield text
            n += 1
            if source.max_docs is not None and n >= source.max_docs:
                return
    if n == 0 and pieces == 1:
        raise DataError(f"{source.field}: {source.path or source.hub_id} holds no text in "
                        f"field {source.text_field!r}; point it at a file with documents")


def _slice(ds, piece: int, pieces: int):
    """Contiguous slice ``piece`` of ``pieces``: rows of a map-style dataset, data files of a
    streamed one (None when it has fewer files than pieces and this slice gets none)."""
    if pieces == 1:
        return ds
    import datasets

    if isinstance(ds, datasets.Dataset):
        n = ds.num_rows
        return ds.select(range(n * piece // pieces, n * (piece + 1) // pieces))
    if ds.n_shards < pieces:  # a streamed dataset splits by file
        return ds if piece == 0 else None
    return ds.shard(num_shards=pieces, index=piece, contiguous=True)


def source_pieces(source: Source, resolved_path: Path | None, cache_dir: str | None, pieces: int) -> int:
    """How many slices ``source`` is read in: ``pieces``, or 1 for a capped source
    (``max_docs``: only one reader knows where the first N documents end) or a streamed one
    with a single data file."""
    if pieces == 1 or source.max_docs is not None:
        return 1
    if resolved_path is None and source.streaming:
        return max(1, min(pieces, open_dataset(source, resolved_path, cache_dir).n_shards))
    return pieces


def open_dataset(source: Source, resolved_path: Path | None, cache_dir: str | None = None):
    """``source`` as a ``datasets`` dataset (a streamed one for a streaming hub source); a bad
    file or an unreachable hub is one :class:`DataError` naming the field and the fix."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if resolved_path is not None:
            builder = _BUILDERS.get(resolved_path.suffix.lower())
            if builder is None:
                raise DataError(f"{source.field}.path: {resolved_path} has an unknown extension; "
                                f"use one of {sorted(_BUILDERS)}")
            field = f"{source.field}.path"
            if builder == "text":
                check_text_file(resolved_path, field)
            else:
                check_exists(resolved_path, field)
            kwargs = {"sample_by": source.sample_by} if builder == "text" else {}
            try:
                ds = datasets.load_dataset(builder, data_files=str(resolved_path), split="train",
                                           cache_dir=cache_dir, **kwargs)
            except Exception:
                if builder == "json":  # pyarrow names no line: find the bad one, with the fix
                    check_jsonl_file(resolved_path, field, source.text_field)
                raise
        else:
            ds = _load_hub(source, cache_dir)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; name the source and keep one line
        refused = storage_cause(e)
        if refused is not None:  # the storage, not the source: bnlit.train's one line names where
            raise OSError(refused.errno, refused.strerror, refused.filename or cache_dir) from e
        raise DataError(f"{source.field}: cannot read {source.path or source.hub_id}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return ds


def _load_hub(source: Source, cache_dir: str | None):
    import datasets

    what = f"{source.hub_id}" + (f" ({source.hub_config or source.hub_data_dir})" if source.hub_config or source.hub_data_dir else "")
    kwargs = {"data_dir": source.hub_data_dir} if source.hub_data_dir else {}
    if not hub_reachable():
        # a hub dataset already in the local cache still loads offline; otherwise fail fast
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        os.environ["HF_HUB_OFFLINE"] = "1"
        # both libraries read the variables once, at import: without these, load_dataset retries
        # the unreachable host for ~30 s before failing
        import huggingface_hub.constants

        datasets.config.HF_HUB_OFFLINE = True
        huggingface_hub.constants.HF_HUB_OFFLINE = True
        try:
            return datasets.load_dataset(source.hub_id, source.hub_config, split=source.split, **kwargs,
                                         cache_dir=cache_dir, streaming=source.streaming)
        except Exception:
            raise DataError(
                f"{source.field}: hub dataset {what} is not cached and {HUB_HOST} is unreachable; "
                f"pre-download it on a machine with network (`hf download --repo-type dataset "
                f"{source.hub_id}`) and set HF_HOME, or point {source.field}.path at local files"
            ) from None
    return datasets.load_dataset(source.hub_id, source.hub_config, split=source.split, **kwargs,
                                 cache_dir=cache_dir, streaming=source.streaming)
