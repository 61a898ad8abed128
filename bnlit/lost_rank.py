"""A rank that dies (SIGKILL, the OOM killer, a lost node) ends the job; it does not hang it.

How the survivors notice: every rank of an FSDP2 run blocks in a collective within one optimizer
step (FSDP's all-gathers and reduce-scatters, the arbiter's and the loss's all-reduces, the
asynchronous checkpoint writer's own gloo group). When a peer process is gone its TCP connections
are closed by the kernel, and gloo fails that collective at once with an error ("Connection closed
by peer", "Connection reset by peer"); a peer that hangs without dying is caught by the process
group's timeout instead (``trainer.strategy.timeout``; Lightning's default 30 minutes).

Which rank: :func:`record_peers` keeps every rank's host and pid (one ``all_gather_object`` when
the process group starts); :func:`lost_ranks` checks which of them on this host no longer run. A
rank on another host cannot be checked from here and is named as such.

Who reports: every survivor, itself. Lightning's launcher (``python -m bnlit.train`` with
``devices>1`` starts ranks 1.. as child processes) watches them from a thread of rank 0 and, up to
5 s after one exits non-zero, SIGKILLs every rank, rank 0 included -- a race with the survivors'
one line, which they print within a second of the failed collective. ``trainer=fsdp`` launches with
:class:`bnlit.fsdp.LostRankLauncher`, whose observer gives the survivors ``GRACE_S`` to report and
exit on their own and kills only what still runs after that (a rank hung outside any collective)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

PEERS: list[tuple[str, int]] = []  # (host, pid) by rank, set by record_peers
EXIT_CODE = 3  # a lost rank (2: a BnlitError, 128+N: a stop signal)

# what gloo (and the c10d store) say when a peer's connection is gone
LOST_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                   "socket closed", "timed out")


def record_peers() -> None:
    """Every rank, right after the process group starts (a collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (socket.gethostname(), os.getpid(), dist.get_rank()))
    PEERS[:] = [(h, pid) for h, pid, _ in out]


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, killed but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def lost_ranks() -> tuple[list[int], list[int]]:
    """``(gone, unknown)``: the ranks on this host whose process no longer runs, and the ranks on
    other hosts (not checkable from here)."""
    host = socket.gethostname()
    gone = [r for r, (h, pid) in enumerate(PEERS) if h == host and pid != os.getpid() and not process_running(pid)]
    unknown = [r for r, (h, _) in enumerate(PEERS) if h != host]
    return gone, unknown


def is_lost_peer_error(e: BaseException) -> bool:
    """Whether ``e``, or an exception it was raised from (a failed asynchronous checkpoint save is a
    ``CheckpointError`` raised from gloo's), is a collective that failed because a peer is gone.
    Only after :func:`record_peers` ran (a distributed run)."""
    import torch.distributed as dist

    from bnlit.errors import BnlitError

    seen = set()
    while e is not None and id(e) not in seen and PEERS:
        seen.add(id(e))
        if isinstance(e, dist.DistError) or (not isinstance(e, BnlitError)
                                             and any(w in str(e).lower() for w in LOST_PEER_WORDS)):
            return True
        e = e.__cause__ or e.__context__
    return False


def my_rank() -> int:
    mine = (socket.gethostname(), os.getpid())
    return PEERS.index(mine) if mine in PEERS else 0


def lost_rank_message(my_rank: int, run_dir: Path, newest: Path | None) -> str:
    """One line: which rank is gone, that this one stops, and where the run resumes."""
    gone, unknown = lost_ranks()
    if gone:
        who = ", ".join(f"rank {r} (pid {PEERS[r][1]} on {PEERS[r][0]})" for r in gone)
        what = f"{who} is gone (killed or crashed)"
    elif unknown:
        what = f"a rank on another host is gone or unreachable (ranks {unknown[0]}-{unknown[-1]} run elsewhere)"
    else:
        what = "a peer rank stopped answering"
    where = f"the newest complete checkpoint is {newest.name}" if newest is not None else "no complete checkpoint yet"
    return (f"rank {my_rank} stops: {what}, so the collective it waited on failed; {where}; "
            f"resume with ckpt_path=last hydra.run.dir={run_dir}")
