"""Turn a sharded (torch DCP) checkpoint directory, as ``trainer=fsdp`` writes it, into one full
``.ckpt`` file.

    python scripts/consolidate_checkpoint.py runs/x/checkpoints/last.ckpt full.ckpt

The export scripts read a sharded directory directly; this is for anything else that wants one file.
Exit 0 on success, 2 with one line on stderr when the directory is incomplete or unreadable.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sharded", help="the sharded checkpoint directory")
    ap.add_argument("out", help="the full .ckpt file to write (must not exist)")
    args = ap.parse_args(argv)
    from bnlit.checkpointing import consolidate  # after the arguments: --help answers without torch
    from bnlit.errors import CheckpointError
    try:
        out = consolidate(args.sharded, args.out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
