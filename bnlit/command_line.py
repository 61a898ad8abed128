"""The command line of ``python -m bnlit.train``, checked before Hydra composes, makes a directory
or writes a file; each failure is one :class:`~bnlit.errors.ConfigError` line.

- **No silent override.** Hydra adds any ``+key=value`` to the config, and nothing reads a key that
  no config group or schema defines (``+learning_rate=1e-3`` trains at the default learning rate).
  :func:`check_overrides` refuses an override (with or without ``+``) of a key that is neither in
  the config composed from the chosen groups nor accepted by the ``_target_`` of the node it goes
  into (``+trainer.profiler=simple`` is a ``lightning.Trainer`` argument), nor a documented
  free-form field (:data:`FREE_FORM`), and names the closest known key. Hydra's own message for an
  unknown key without ``+`` is five lines and suggests the ``+`` that would then be silent.
- **A group option that does not exist** (``model=tinyy``): one line with the options.
- **An output directory that cannot be written**: one line naming it, instead of the traceback of
  Hydra's ``mkdir``.

:func:`check_command_line` also notes which directories of the run dir's path exist already, so a
run refused later removes only what it made (:func:`bnlit.run_dir.remove_if_new`).
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from bnlit.errors import ConfigError

# Documented free-form fields (docs "Configuration"): a new callback or logger under these takes
# any name, and its keys are those of its own _target_; a multiple-choice task is any name.
NEW_TARGET_NODES = ("callbacks", "logger")
FREE_FORM = ("callbacks.multiple_choice.tasks",)
# a list of records with their own schema: data.sources.<i>.<field> is a field of Source
RECORD_LISTS = {"data.sources": "bnlit.data.sources.Source"}
# other names for a key that difflib would not find from the spelling alone
SYNONYMS = {"learning_rate": "lr", "steps": "max_steps", "epochs": "max_steps", "context_length": "seq_len",
            "block_size": "seq_len", "bs": "batch_size", "wd": "weight_decay"}
CFG_HINT = "python -m bnlit.train --cfg job lists every key"


def check_command_line(argv: Sequence[str], config_dir: str | os.PathLike, config_name: str = "train") -> None:
    """All checks of this module on ``argv`` (``sys.argv[1:]``); nothing to do for ``--help``,
    ``--cfg``, ``--info`` and the like, which only print."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(list(argv))
    if (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.experimental_rerun
            or args.config_path):
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(args.overrides))
    config_dir = Path(args.config_dir).absolute() if args.config_dir else Path(config_dir)
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name=config_name):
        loader = GlobalHydra.instance().config_loader()
        # one repository for every question: the loader's get_group_options builds one per call
        repo = getattr(loader, "repository", None)
        options = repo.get_group_options if repo is not None else loader.get_group_options
        groups, values = [], []
        for o in overrides:
            if options(o.key_or_group):
                groups.append(_group_line(o, options(o.key_or_group)))
            elif o.key_or_group == "hydra" or o.key_or_group.startswith("hydra."):
                if not o.is_sweep_override():
                    groups.append(o.input_line)
            else:
                values.append(o)
        try:
            cfg = compose(args.config_name or config_name, overrides=groups, return_hydra_config=True)
        except Exception as e:  # noqa: BLE001  (Hydra's composition errors have no common base class)
            raise composition_error(e) from None
    check_overrides(cfg, values)
    mode = OmegaConf.select(cfg, "hydra.mode", default=None)  # hparams_search=optuna sets MULTIRUN
    multirun = args.multirun or getattr(mode, "name", str(mode)) == "MULTIRUN"
    for o in values:  # the run dir may be built from task keys (paths.log_dir, task_name)
        if not (o.is_sweep_override() or o.is_delete()):
            try:
                with open_dict(cfg):
                    OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False)
            except Exception:  # noqa: BLE001  (Hydra reports a value it cannot apply itself)
                pass
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    out = Path(str(OmegaConf.select(cfg, key)))
    check_writable(out, key, " (or paths.log_dir for the default run dirs)")
    from bnlit.run_dir import note_existing

    note_existing(out)


# Hydra plugins the quick-start install leaves out: config group -> (module, what it is, the extra)
PLUGINS = {
    "hydra/sweeper/optuna": ("hydra_plugins.hydra_optuna_sweeper", "Hydra's Optuna sweeper", "sweeps"),
    "hydra/launcher/submitit": ("hydra_plugins.hydra_submitit_launcher", "Hydra's submitit launcher", "sweeps"),
}


def composition_error(e: Exception) -> ConfigError:
    """One line for a config Hydra cannot compose: the extra to install when a plugin is missing,
    else the first line of Hydra's message."""
    text = str(e)
    for group, (module, what, extra) in PLUGINS.items():
        if group in text and not _importable(module):
            return ConfigError(f"this command needs {what} ({group}), which is not installed; "
                               f"pip install -e '.[{extra}]'")
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    return ConfigError(f"{first} (HYDRA_FULL_ERROR=1 shows Hydra's whole message)")


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _group_line(o: Any, options: list[str]) -> str:
    """The override line of a group choice for the composition, its options checked."""
    chosen = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
    if o.is_delete():
        return o.input_line
    for choice in chosen:
        if choice is not None and str(choice) not in options:
            close = difflib.get_close_matches(str(choice), options, n=1)
            hint = f"did you mean {o.key_or_group}={close[0]}? " if close else ""
            raise ConfigError(f"{o.input_line}: {o.key_or_group} has no option {choice!r}; {hint}"
                              f"options: {', '.join(sorted(options))}")
    return f"{o.get_key_element()}={chosen[0]}" if o.is_sweep_override() else o.input_line


# -- keys -------------------------------------------------------------------------------------------

_MISSING = object()


def _node(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False, throw_on_resolution_failure=False)


def _exists(cfg: DictConfig, key: str) -> bool:
    """``key`` is in the config, also where its value is still ``???`` (``data=files`` paths)."""
    parent, _, leaf = key.rpartition(".")
    node = cfg if not parent else _node(cfg, parent)
    if isinstance(node, DictConfig):
        return leaf in node.keys()
    if isinstance(node, ListConfig):
        return leaf.isdigit() and int(leaf) < len(node)
    return False


def target_params(target: str) -> set[str] | None:
    """The keyword arguments a ``_target_`` accepts; ``None`` when it takes ``**kwargs`` or cannot
    be imported here (then any key is accepted and Hydra's instantiation has the last word)."""
    from hydra._internal.utils import _locate

    try:
        obj = _locate(target)
        sig = inspect.signature(obj)
    except Exception:  # noqa: BLE001  (an import error is reported when the target is built)
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {name for name, p in sig.parameters.items() if p.kind is not p.VAR_POSITIONAL}


def _targets_added(values: Sequence[Any]) -> dict[str, str]:
    """``{node: target}`` for each ``+node._target_=...`` on the command line."""
    out = {}
    for o in values:
        if o.key_or_group.endswith("._target_") and not o.is_delete() and not o.is_sweep_override():
            out[o.key_or_group.removesuffix("._target_")] = str(o.value())
    return out


def key_defined(cfg: DictConfig, key: str, added_targets: dict[str, str]) -> bool:
    """Whether a schema defines ``key`` although the composed config does not hold it."""
    parts = key.split(".")
    # the deepest node of the config that exists
    depth = max(i for i in range(len(parts) + 1) if i == 0 or _exists(cfg, ".".join(parts[:i])))
    parent, rest = ".".join(parts[:depth]), parts[depth:]
    node = cfg if depth == 0 else _node(cfg, parent)
    if parent in FREE_FORM:
        return True
    if parent in NEW_TARGET_NODES and rest:  # a new callback or logger, with its own _target_
        name = f"{parent}.{rest[0]}"
        if name not in added_targets:
            return False
        params = target_params(added_targets[name])
        return len(rest) == 1 or rest[1] == "_target_" or params is None or rest[1] in params
    for lst, record in RECORD_LISTS.items():
        if parent.startswith(lst + ".") and parent.count(".") == lst.count(".") + 1:
            return rest[0] in (target_params(record) or {rest[0]})
    if isinstance(node, DictConfig) and "_target_" in node:
        params = target_params(str(node._target_))
        return params is None or rest[0] in params
    return False


def known_keys(cfg: DictConfig) -> list[str]:
    """Every key path of the composed config (Hydra's own node left out), with the arguments the
    ``_target_`` of each node accepts."""
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, DictConfig):
            items = node.items_ex(resolve=False) if hasattr(node, "items_ex") else node.items()
            for k, v in items:
                path = f"{prefix}{k}"
                if path == "hydra":
                    continue
                out.append(path)
                walk(v, path + ".")
            target = node.get("_target_") if "_target_" in node else None
            record = next((r for lst, r in RECORD_LISTS.items()
                           if prefix.startswith(lst + ".") and prefix.count(".") == lst.count(".") + 2), None)
            for p in sorted(target_params(str(target or record)) or ()) if target or record else ():
                out.append(f"{prefix}{p}")
        elif isinstance(node, ListConfig):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")

    walk(cfg, "")
    return sorted(set(out))


def closest_key(key: str, known: Sequence[str]) -> str | None:
    """The known key closest to ``key``: the same last name (``lr`` -> ``optimizer.lr``, with
    :data:`SYNONYMS` first), else the closest spelling of the whole path or of its last name."""
    leaf = key.rsplit(".", 1)[-1]
    for name in (SYNONYMS.get(leaf), leaf):
        same = [k for k in known if k.rsplit(".", 1)[-1] == name]
        if name and same:
            return min(same, key=lambda k: (k.count("."), k))
    whole = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if whole:
        return whole[0]
    leaves = {}
    for k in known:
        leaves.setdefault(k.rsplit(".", 1)[-1], k)
    near = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[near[0]] if near else None


def check_overrides(cfg: DictConfig, overrides: Sequence[Any]) -> None:
    """Refuse the first override of a key that nothing defines (see the module docstring).
    ``cfg``: the config composed from the group choices; ``overrides``: Hydra's parsed overrides of
    keys (not groups); the keys Optuna will set (``hydra.sweeper.params``) are checked too."""
    added = _targets_added(overrides)
    lines = [(o.key_or_group, o.input_line, o) for o in overrides]
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    if isinstance(params, DictConfig):
        lines += [(str(k), f"hydra.sweeper.params.{k}", None) for k in params]
    known = None
    for key, line, o in lines:
        if o is not None and o.is_add() and _exists(cfg, key):
            raise ConfigError(f"{line}: {key} is already defined (value {OmegaConf.select(cfg, key)!r}); "
                              f"drop the + to override it: {line[1:]}")
        if _exists(cfg, key) or (o is not None and (o.is_add() or o.is_force_add()) and key_defined(cfg, key, added)):
            continue
        if o is not None and not o.is_delete() and key_defined(cfg, key, added):
            # a schema key the YAML does not list: Hydra would refuse it without +
            raise ConfigError(f"{line}: {key} is not in the config yet; add it with +{line}")
        known = known if known is not None else known_keys(cfg)
        close = closest_key(key, known)
        hint = f"did you mean {close}? " if close else ""
        what = "nothing to delete" if o is not None and o.is_delete() else "nothing would read it"
        raise ConfigError(f"{line}: no config group or schema defines {key}, so {what}; {hint}({CFG_HINT})")


# -- directories ------------------------------------------------------------------------------------

def check_writable(path: Path, field: str, fix: str = "") -> None:
    """``path`` is a directory this process can write in, or can be made: a directory made and
    removed again in its nearest existing ancestor is the proof (``os.access`` says yes to root on a
    read-only mount, and to anyone under ``/proc``)."""
    import tempfile

    path = path.absolute()
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise ConfigError(f"{field}={path}: {existing} is a file, not a directory; choose another {field}")
        os.rmdir(tempfile.mkdtemp(prefix=".bnlit-write-check-", dir=existing))
    except OSError as e:
        where = Path(e.filename).parent if e.filename else path  # exists() fails where a parent is not searchable
        place = "" if where == path else " (the nearest existing directory on its path)"
        raise ConfigError(f"{field}={path}: cannot write in {where}{place}: {e.strerror or e}; "
                          f"choose another {field}{fix}") from None
