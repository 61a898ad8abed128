from bnlit.data.datamodule import BnDataModule
from bnlit.data.sources import Source

__all__ = ["BnDataModule", "Source"]
