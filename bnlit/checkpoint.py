"""Reading bnlit checkpoints outside the Trainer: for evaluation, generation, export and resume.

A bnlit checkpoint is a Lightning checkpoint with two additions: ``model_config`` (the
:class:`~bnlit.model.ModelConfig` fields, added by ``LMModule.on_save_checkpoint``) and the data
module's state (the tokenizer's bytes), which Lightning stores under the data module class's
``__qualname__`` (``BnDataModule``). The module holds the transformer as ``self.model``, so its
weights are the ``model.``-prefixed entries of ``state_dict``.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from bnlit.errors import CheckpointError
from bnlit.evaluation import empty_transformer
from bnlit.model import ModelConfig, Transformer
from bnlit.tokenizer import Tokenizer

DATAMODULE_KEY = "BnDataModule"  # BnDataModule.__qualname__: where Lightning puts its state_dict()
MODEL_PREFIX = "model."


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a bnlit/Lightning checkpoint on the CPU with ``weights_only=True``.

    Raises:
        CheckpointError: one line naming the file and the fix, when the file is missing,
            truncated or corrupt, or is not a bnlit checkpoint (no ``state_dict``/``model_config``).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; pass the last.ckpt or step*.ckpt "
                              "of a bnlit.train run (paths.checkpoint_dir)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({reason[:120]}); "
                              "use an earlier step*.ckpt or retrain") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "model_config" not in ckpt:
        have = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"checkpoint {path} is not a bnlit training checkpoint (no state_dict/"
                              f"model_config; has {have}); pass a last.ckpt or step*.ckpt written by bnlit.train")
    return ckpt


def model_state(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The transformer's weights: the ``model.``-prefixed entries of the Lightning ``state_dict``,
    with the prefix (and ``torch.compile``'s ``_orig_mod.``, if any) removed."""
    out = {}
    for k, v in ckpt["state_dict"].items():
        if k.startswith(MODEL_PREFIX):
            out[k[len(MODEL_PREFIX):].replace("_orig_mod.", "")] = v
    return out


def checkpoint_tokenizer(ckpt: dict[str, Any], path: str | os.PathLike = "<checkpoint>") -> Tokenizer:
    state = ckpt.get(DATAMODULE_KEY) or {}
    model_bytes = state.get("tokenizer_model")
    if not model_bytes:
        raise CheckpointError(f"checkpoint {path} carries no tokenizer ({DATAMODULE_KEY}.tokenizer_model); "
                              "it was not written by a bnlit.train run with BnDataModule")
    return Tokenizer(bytes(model_bytes))


def load_model(path: str | os.PathLike) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """Rebuild the trained transformer (eval mode, fp32, CPU), its tokenizer and the raw checkpoint."""
    ckpt = read_checkpoint(path)
    try:
        cfg = ModelConfig(**ckpt["model_config"])
    except TypeError as e:
        raise CheckpointError(f"checkpoint {path}: model_config does not match this bnlit's ModelConfig ({e}); "
                              "use the bnlit version that wrote it") from None
    model = empty_transformer(cfg)  # no init drawn: every weight comes from the file
    state = model_state(ckpt)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path}: weights do not fit model_config {cfg.name} "
                              f"(missing {missing[:4]}, unexpected {unexpected[:4]}); the file is not from this model")
    tokenizer = checkpoint_tokenizer(ckpt, path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"checkpoint {path}: tokenizer has {tokenizer.vocab_size} tokens but the model "
                              f"only {cfg.vocab_size}; the checkpoint's tokenizer and model disagree")
    model.float().eval()
    return model, tokenizer, ckpt
