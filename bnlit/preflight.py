"""Preflight: the checks before any expensive work. Every config value whose range is knowable and every
local data file is checked within seconds, before corpus cleaning, tokenizer training or shard
building, so a bad value costs seconds rather than the minutes of a data build.

:func:`check_config` is the one entry point (``bnlit.train.train`` calls it first). Each
failure is a :class:`~bnlit.errors.ConfigError` or :class:`~bnlit.errors.DataError` of one line:
the field, the bad value and the fix. Nothing is written before it returns, so a refused run
leaves no partial cache entry. The data-file checks (:func:`check_data_file`) are also what the
data module applies to files it is handed directly.
"""

from __future__ import annotations

import codecs
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bnlit.errors import BnlitError, ConfigError, DataError

log = logging.getLogger("bnlit")

TEXT_SUFFIXES = (".txt", ".text")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES


def instantiate_checked(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, re-raising a constructor's own one-line
    :class:`~bnlit.errors.BnlitError` instead of Hydra's wrapper around it."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, BnlitError):
            raise e.__cause__ from None
        raise


# ---- values -----------------------------------------------------------------------------------
def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(cfg, key, default=default, throw_on_missing=False)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive_int(v: Any) -> bool:
    return _is_int(v) and v >= 1


def non_negative_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def positive(v: Any) -> bool:
    return _is_number(v) and v > 0


def non_negative(v: Any) -> bool:
    return _is_number(v) and v >= 0


def fraction(v: Any) -> bool:
    """In [0, 1)."""
    return _is_number(v) and 0 <= v < 1


def open_fraction(v: Any) -> bool:
    """In (0, 1)."""
    return _is_number(v) and 0 < v < 1


def closed_fraction(v: Any) -> bool:
    """In [0, 1]."""
    return _is_number(v) and 0 <= v <= 1


def steps_or_fraction(v: Any) -> bool:
    """An int >= 1 (batches or steps) or a float in (0, 1] (a fraction of an epoch)."""
    return positive_int(v) or (isinstance(v, float) and 0 < v <= 1)


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


# (key, check, what it must be, the fix). A key absent from the config is skipped: a config
# group that does not use it (a scheduler without decay_fraction) is not an error.
RULES: list[tuple[str, Callable[[Any], bool], str, str]] = [
    ("threads", lambda v: v == "auto" or positive_int(v), "auto or an integer >= 1",
     "auto uses the idle cores; e.g. threads=1 on a busy machine"),
    ("trainer.max_steps", positive_int, "an integer >= 1", "set it to the number of optimizer steps to train, e.g. 500"),
    ("trainer.accumulate_grad_batches", positive_int, "an integer >= 1", "use 1 for no gradient accumulation"),
    ("trainer.val_check_interval", steps_or_fraction, "an integer >= 1 (optimizer steps)",
     "validate every N steps with an N >= 1"),
    ("trainer.limit_val_batches", steps_or_fraction, "an integer >= 1 or a fraction in (0, 1]",
     "score at least one validation batch, e.g. 50"),
    ("trainer.log_every_n_steps", positive_int, "an integer >= 1", "e.g. 10"),
    ("trainer.gradient_clip_val", optional(non_negative), "a number >= 0 or null", "use null (or 0) for no clipping"),
    ("data.batch_size", positive_int, "an integer >= 1", "e.g. 32 windows per micro-batch"),
    ("data.seq_len", lambda v: _is_int(v) and v >= 2, "an integer >= 2",
     "a window needs at least 2 tokens to predict one from another; e.g. 128"),
    ("data.val_fraction", open_fraction, "a fraction in (0, 1)", "hold out a small share, e.g. 0.05"),
    ("data.num_workers", non_negative_int, "an integer >= 0", "use 0 to load in the main process"),
    ("data.num_proc", lambda v: v == "auto" or positive_int(v), "auto or an integer >= 1",
     "the processes that clean and tokenize, e.g. 2 (auto: this machine's cores)"),
    ("data.prefetch_factor", optional(positive_int), "an integer >= 1 or null", "use null for torch's default"),
    ("data.multiprocessing_context", lambda v: v in ("forkserver", "fork", "spawn"), "forkserver, fork or spawn",
     "use forkserver (fork starts faster but can inherit a lock another thread holds: docs/data.md)"),
    ("optimizer.lr", positive, "a finite number > 0", "e.g. 1e-2 for the tiny preset"),
    ("optimizer.weight_decay", non_negative, "a number >= 0", "e.g. 0.1, or 0 for none"),
    ("optimizer.eps", positive, "a number > 0", "e.g. 1e-8"),
    ("scheduler.warmup_fraction", fraction, "a fraction in [0, 1)", "e.g. 0.05 (5% of max_steps)"),
    ("scheduler.min_lr_ratio", closed_fraction, "a fraction in [0, 1]", "e.g. 0.1 (the final LR is 10% of the peak)"),
    ("scheduler.decay_fraction", closed_fraction, "a fraction in [0, 1]", "e.g. 0.2"),
    ("module.sdpa_backend", lambda v: v in ("auto", "flash", "efficient", "math", "cudnn"),
     "one of auto, flash, efficient, math, cudnn", "use auto unless you are pinning a CUDA kernel"),
    ("tokenizer.model_type", lambda v: v in ("bpe", "unigram"), "bpe or unigram", "use bpe"),
    ("tokenizer.character_coverage", lambda v: _is_number(v) and 0 < v <= 1, "a fraction in (0, 1]", "e.g. 0.9999"),
]


def _rule_error(key: str, value: Any, must: str, fix: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: must be {must}; {fix}")


def check_values(cfg: DictConfig) -> None:
    missing = object()
    for key, check, must, fix in RULES:
        value = _get(cfg, key, missing)
        if value is missing:
            continue
        if not check(value):
            raise _rule_error(key, value, must, fix)
    betas = _get(cfg, "optimizer.betas")
    if betas is not None and not (len(betas) == 2 and all(fraction(b) for b in betas)):
        raise ConfigError(f"optimizer.betas={betas}: must be two numbers in [0, 1); e.g. [0.9, 0.95]")
    loss_impl = _get(cfg, "module.loss_impl")
    if loss_impl is not None:  # a bad name, or fused at a precision where torch's op is wrong
        from bnlit.loss import loss_fn  # here: the data-file checks serve tools that never import torch

        loss_fn(loss_impl, "cpu", _get(cfg, "trainer.precision"))


def check_steps(cfg: DictConfig) -> None:
    """The schedule and validation cadence against ``trainer.max_steps``."""
    max_steps = cfg.trainer.max_steps
    total = _get(cfg, "scheduler.total_steps")
    if total is not None:
        if not positive_int(total):
            raise _rule_error("scheduler.total_steps", total, "an integer >= 1", "leave it at ${trainer.max_steps}")
        if total < max_steps:
            raise ConfigError(f"scheduler.total_steps={total} < trainer.max_steps={max_steps}: the LR would sit at "
                              "its floor for the last steps; leave scheduler.total_steps at ${trainer.max_steps}")
        if total > max_steps:
            log.warning("scheduler.total_steps=%d > trainer.max_steps=%d: the LR schedule stops at %.0f%% of its "
                        "decay (fine for a run you will resume with more steps)", total, max_steps,
                        100 * max_steps / total)
    interval = _get(cfg, "trainer.val_check_interval")
    if _is_int(interval) and interval > max_steps:
        log.warning("trainer.val_check_interval=%d > trainer.max_steps=%d: validation runs once, at the end of "
                    "training (step %d)", interval, max_steps, max_steps)


def check_model(cfg: DictConfig) -> None:
    """The model preset's own checks (``ModelConfig.__post_init__``: n_head divides dim, ...), the
    context length against the preset, and a vocabulary large enough for the tokenizer."""
    from bnlit.tokenizer import MIN_VOCAB_SIZE

    model = instantiate_checked(cfg.model.config)  # a dataclass: no weights are allocated
    seq_len = _get(cfg, "data.seq_len")
    if seq_len is not None and seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len} exceeds model.config.max_seq_len={model.max_seq_len} "
                          f"of preset {model.name}; lower data.seq_len or raise max_seq_len")
    if not _get(cfg, "tokenizer.path"):
        # the tokenizer's size follows model.config.vocab_size unless tokenizer.vocab_size is set
        follows = "tokenizer" not in cfg or OmegaConf.is_interpolation(cfg.tokenizer, "vocab_size")
        field, size = ("model.config.vocab_size", model.vocab_size) if follows else \
            ("tokenizer.vocab_size", _get(cfg, "tokenizer.vocab_size"))
        if not follows and _is_int(size) and size > model.vocab_size:
            raise ConfigError(f"tokenizer.vocab_size={size} > model.config.vocab_size={model.vocab_size}: its token ids "
                              "would not fit the embedding; set model.config.vocab_size instead (the tokenizer follows it)")
        if _is_int(size) and size < MIN_VOCAB_SIZE:
            raise ConfigError(f"{field}={size}: a trained tokenizer needs at least {MIN_VOCAB_SIZE} tokens (4 special, "
                              f"256 byte fallback, the required characters); raise it to at least {MIN_VOCAB_SIZE}, "
                              "e.g. 8192")


PROFILE_HINT = "rehearse this profile on CPU with debug=rehearsal, or train on CPU with trainer=cpu hardware=cpu"


def check_hardware(cfg: DictConfig) -> None:
    """The accelerator, precision and device count against this machine, before any work."""
    import typing

    import torch
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT

    from bnlit.speed.threads import available_cpus

    accelerator = str(_get(cfg, "trainer.accelerator", "auto"))
    devices, precision = _get(cfg, "trainer.devices"), _get(cfg, "trainer.precision")
    if accelerator in ("gpu", "cuda"):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not found:
            build = "a CPU-only torch build" if torch.version.cuda is None else "no CUDA device visible"
            raise ConfigError(f"trainer.accelerator={accelerator}: this machine has no GPU ({build}); {PROFILE_HINT}")
        if _is_int(devices) and devices > found:
            raise ConfigError(f"trainer.devices={devices}: this machine has {found} GPU(s); "
                              f"use trainer.devices={found} or fewer")
    allowed = [str(v) for arg in typing.get_args(_PRECISION_INPUT) for v in typing.get_args(arg)]
    if precision is not None and str(precision) not in allowed:
        raise ConfigError(f"trainer.precision={precision!r}: not a precision Lightning knows; use one of "
                          "32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true")
    cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if cpu and str(precision) in ("16-mixed", "16", "16-true"):
        raise ConfigError(f"trainer.precision={precision}: float16 autocast has no CPU support in Lightning; "
                          "use bf16-mixed or 32-true on CPU")
    cores = available_cpus()
    if cpu and _is_int(devices) and devices > cores:
        log.warning("trainer.devices=%d on %d CPU core(s): %d processes time-slice the cores, so expect each step "
                    "to take at least %.1fx as long as with trainer.devices=%d (the same work per process on fewer "
                    "cores each), plus the switching; fine to rehearse a %d-rank layout, slow to train", devices,
                    cores, devices, devices / cores, cores, devices)


def check_optimizer(cfg: DictConfig) -> None:
    """Muon orthogonalises whole matrices: FSDP's sharded parameters would each be a slice."""
    optimizer, strategy = str(_get(cfg, "optimizer._target_", "")), _get(cfg, "trainer.strategy")
    sharded = isinstance(strategy, Mapping) and str(strategy.get("_target_", "")).endswith("FSDP2Strategy")
    if optimizer.endswith("MuonAdamW") and sharded:
        raise ConfigError(f"optimizer._target_={optimizer}: Muon needs whole matrices and trainer.strategy "
                          f"{strategy['_target_']} shards them; use optimizer=adamw")


def check_cache_dir(cfg: DictConfig) -> None:
    """Tokenizers and shards are written under ``paths.cache_dir``."""
    from bnlit.command_line import check_writable

    cache = _get(cfg, "paths.cache_dir")
    if cache:
        check_writable(Path(cache).expanduser(), "paths.cache_dir")


def check_disk_space(cfg: DictConfig) -> None:
    """The checkpoint directory's filesystem holds the run's first checkpoint (the step file and,
    with ``save_last``, ``last.ckpt``; sized from the model: :func:`bnlit.storage.check_free_space`).
    A run without a ``ModelCheckpoint`` writes none and is not checked."""
    from bnlit.speed.flops import param_counts
    from bnlit.storage import check_free_space

    try:
        mc = _get(cfg, "callbacks.model_checkpoint")
        if not isinstance(mc, Mapping) or not str(mc.get("_target_", "")).endswith("ModelCheckpoint"):
            return
        checkpoint_dir = mc.get("dirpath") or _get(cfg, "paths.checkpoint_dir")
    except OmegaConfBaseException:  # ${hydra:...} outside a Hydra app: no run dir to check
        return
    if not checkpoint_dir:
        return
    save_last = mc.get("save_last")
    files = 1 + (1 if save_last and save_last != "link" else 0)
    n_params = param_counts(instantiate_checked(cfg.model.config))["n_params"]
    need = check_free_space(checkpoint_dir, n_params, files, _get(cfg, "trainer.precision", "32-true"),
                            str(_get(cfg, "optimizer._target_", "AdamW")))
    log.debug("checkpoints: the first needs at least %d bytes under %s", need, checkpoint_dir)


# ---- data files -------------------------------------------------------------------------------
def check_exists(path: Path, field: str) -> None:
    """The file exists, is a regular file, is readable and is not empty."""
    if path.is_dir():
        raise DataError(f"{field}: {path} is a directory, not a file; point it at one "
                        f"{'/'.join(DATA_SUFFIXES)} file inside it")
    if not path.exists():
        raise DataError(f"{field}: file {path} does not exist; fix the path")
    if not os.access(path, os.R_OK):
        raise DataError(f"{field}: file {path} is not readable (permission denied); "
                        f"`chmod a+r {path}` or copy it somewhere readable")
    if path.stat().st_size == 0:
        raise DataError(f"{field}: file {path} is empty; point it at a file with text")


def _utf8_error(path: Path, field: str, where: str) -> DataError:
    return DataError(f"{field}: file {path} is not valid UTF-8 ({where}); "
                     "re-encode it, e.g. `iconv -f <encoding> -t utf-8`")


def check_text_file(path: Path, field: str) -> None:
    """A ``.txt`` file: exists, UTF-8 (reporting the byte offset), not whitespace only."""
    check_exists(path, field)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, has_text = 0, False
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise _utf8_error(path, field, f"byte {offset + e.start}") from None
            has_text = has_text or bool(text.strip())
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"{field}: file {path} ends inside a UTF-8 sequence (truncated?); re-encode it") from None
    if not has_text:
        raise DataError(f"{field}: file {path} holds only whitespace; point it at a file with text")


def _type_name(v: Any) -> str:
    return {int: "a number", float: "a number", bool: "a boolean", list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def _json_reason(e: json.JSONDecodeError) -> str:
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def check_jsonl_file(path: Path, field: str, text_field: str = "text") -> None:
    """A ``.jsonl`` (or line-delimited ``.json``) file: every non-blank line is a JSON object,
    its ``text_field`` is a string or null, and at least one is non-blank. Errors name the file
    and the 1-based line. A ``.json`` file holding one array is checked element by element."""
    check_exists(path, field)
    with path.open("rb") as f:
        head = f.read(64).lstrip()
    if path.suffix.lower() == ".json" and head.startswith(b"["):
        try:
            rows = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _utf8_error(path, field, f"byte {e.start}") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{field}: {path}:{e.lineno}: malformed JSON ({_json_reason(e)}); "
                            "fix that line or convert the file to JSON Lines, one object a line") from None
        _check_rows(((i + 1, r) for i, r in enumerate(rows)), path, field, text_field, "element")
        return

    def rows():
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _utf8_error(path, field, f"line {lineno}, column {e.start + 1}") from None
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    raise DataError(f"{field}: {path}:{lineno}: malformed JSON ({_json_reason(e)}); "
                                    "fix or delete that line (JSON Lines: one object a line)") from None

    _check_rows(rows(), path, field, text_field, "line")


def _check_rows(rows, path: Path, field: str, text_field: str, unit: str) -> None:
    has_text = has_field = False
    for n, row in rows:
        where = f"{path}:{n}" if unit == "line" else f"{path} element {n}"
        if not isinstance(row, dict):
            raise DataError(f"{field}: {where}: {_type_name(row)}, not a JSON object; write one "
                            f'{{"{text_field}": "..."}} object per {unit}')
        if text_field not in row:
            continue
        has_field = True
        text = row[text_field]
        if text is not None and not isinstance(text, str):
            raise DataError(f'{field}: {where}: "{text_field}" is {_type_name(text)} ({json.dumps(text)[:40]}), '
                            f"not a string; quote it or drop that {unit}")
        has_text = has_text or bool(text and text.strip())
    if not has_field:
        raise DataError(f"{field.removesuffix('.path')}.text_field={text_field!r}: no {unit} of {path} has that "
                        "key; set text_field to the key that holds the text")
    if not has_text:
        raise DataError(f'{field}: every "{text_field}" in {path} is empty or whitespace; point it at a file with text')


def check_parquet_file(path: Path, field: str, text_field: str = "text") -> None:
    """A ``.parquet`` file: readable by pyarrow, with a string column ``text_field``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_exists(path, field)
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{field}: {path} is not a readable Parquet file ({str(e).splitlines()[0]}); "
                        "rewrite it with pyarrow or pandas `to_parquet`") from None
    if text_field not in schema.names:
        raise DataError(f"{field.removesuffix('.path')}.text_field={text_field!r}: not a column of {path}; "
                        f"columns are {schema.names}")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{field}: column {text_field!r} of {path} is {kind}, not a string; "
                        "cast it to string or choose another text_field")


def check_data_file(path: str | os.PathLike, field: str, text_field: str = "text") -> None:
    """Exists, is a readable file, and is a well-formed file of its kind (by extension)."""
    path = Path(path).expanduser()
    check_exists(path, field)
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        check_text_file(path, field)
    elif suffix in JSON_SUFFIXES:
        check_jsonl_file(path, field, text_field)
    elif suffix in PARQUET_SUFFIXES:
        check_parquet_file(path, field, text_field)
    else:
        raise DataError(f"{field}: {path} has an unknown extension; use one of {list(DATA_SUFFIXES)}")


def check_data(cfg: DictConfig) -> None:
    """Sources (names, weights) and every local file they and the decontamination sets name."""
    sources = _get(cfg, "data.sources") or []
    if not sources:
        raise ConfigError("data.sources is empty; list at least one source")
    weights = []
    for i, s in enumerate(sources):
        field = f"data.sources[{i}]"
        if not isinstance(s, Mapping):
            raise ConfigError(f"{field}={s!r}: must be a mapping with name, language and path or hub_id")
        weight = s.get("weight", 1.0)
        if not non_negative(weight):
            raise ConfigError(f"{field}.weight={weight!r}: must be a number >= 0; e.g. 0.8")
        weights.append(weight)
        path = s.get("path")
        if path and not str(path).startswith("embedded:"):
            check_data_file(path, f"{field}.path", s.get("text_field", "text"))
    if sum(weights) <= 0:
        raise ConfigError(f"data.sources: weights {weights} sum to 0; give at least one source a weight > 0")
    for i, item in enumerate(_get(cfg, "data.clean.decontam.eval_files") or []):
        spec = {"path": item} if isinstance(item, str) else dict(item)
        check_data_file(spec["path"], f"data.clean.decontam.eval_files[{i}].path", spec.get("text_field", "text"))
    tok_path = _get(cfg, "tokenizer.path")
    if tok_path:
        check_exists(Path(tok_path).expanduser(), "tokenizer.path")


# ---- the entry point --------------------------------------------------------------------------
def check_config(cfg: DictConfig) -> None:
    """Every check that needs no data build, cheapest first; raises on the first failure."""
    check_values(cfg)
    check_steps(cfg)
    check_model(cfg)
    check_hardware(cfg)
    check_optimizer(cfg)
    check_data(cfg)
    check_cache_dir(cfg)
    check_disk_space(cfg)
