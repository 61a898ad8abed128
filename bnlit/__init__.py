"""bnlit: Bangla-first language-model pretraining with PyTorch Lightning and Hydra."""

from pathlib import Path

from bnlit import moved

__version__ = "0.1.0"
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
moved.install()
