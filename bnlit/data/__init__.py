from __future__ import annotations

__all__ = ["BnDataModule", "Source"]


def __getattr__(name: str):
    # lazy, so worker processes of the data pipeline (spawned) do not import Lightning and torch
    if name == "BnDataModule":
        from bnlit.data.datamodule import BnDataModule

        return BnDataModule
    if name == "Source":
        from bnlit.data.sources import Source

        return Source
    raise AttributeError(f"module 'bnlit.data' has no attribute {name!r}")
