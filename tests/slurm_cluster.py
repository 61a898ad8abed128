"""A real one-node SLURM cluster on localhost for the ``slurm`` tests (Debian ``slurm-wlm`` and
``munge``): a minimal ``slurm.conf`` (2 CPUs, 8 GB declared (requests are checked, not enforced:
no cgroups), no accounting, state under a temporary
directory, free ports), ``munged`` (reused when one already answers), ``slurmctld`` and ``slurmd``
started as root, ready when ``sinfo`` shows the node idle. Client commands (``sbatch``, ``squeue``,
``scontrol``, submitit) find it through ``SLURM_CONF``.

``python tests/slurm_cluster.py`` starts one and prints how to use it, for debugging by hand."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol")

CONF = """\
ClusterName=bnlit
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again cred_expire + 1 s after the requeue (SLURM's default: 120 s)
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
LaunchParameters=use_interactive_step
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=600
KillWait=30
JobRequeue=1
SchedulerParameters=bf_interval=1
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class ClusterError(RuntimeError):
    pass


def missing_commands() -> list[str]:
    return [c for c in DAEMONS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``with SlurmCluster(root) as c:`` a running cluster; ``c.env`` carries ``SLURM_CONF``."""

    def __init__(self, root: Path, cpus: int = 2):
        self.root, self.cpus = Path(root), cpus
        self.conf = self.root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self._procs: list[subprocess.Popen] = []
        self._munged = False

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
        return out

    def start(self, timeout: float = 90) -> SlurmCluster:
        if os.geteuid() != 0:
            raise ClusterError("the SLURM daemons of the test cluster run as root")
        if missing := missing_commands():
            raise ClusterError(f"missing {missing}: apt-get install -y slurm-wlm munge")
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(CONF.format(host=self.host, root=self.root, cpus=self.cpus,
                                         ctld_port=_free_port(), slurmd_port=_free_port()))
        self._start_munge()
        self._spawn(_exe("slurmctld"), "-D", "-i", "-f", str(self.conf))
        self._spawn(_exe("slurmd"), "-D", "-N", self.host, "-f", str(self.conf))
        self.wait_idle(timeout)
        return self

    def _start_munge(self) -> None:
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return  # a munged already answers on the default socket
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
            shutil.chown(key, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _exe("munged")], check=True, capture_output=True)
        self._munged = True
        for _ in range(50):
            if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise ClusterError("munged does not answer on /run/munge/munge.socket.2")

    def _spawn(self, *cmd: str) -> None:
        log = open(self.root / f"{Path(cmd[0]).name}.out", "w")
        self._procs.append(subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True))

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise ClusterError(f"{p.args[0]} exited {p.returncode}; see {self.root}: {self.logs()[-1500:]}")
            out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=10)
            state = out.stdout.strip()
            if out.returncode == 0 and state.startswith("idle"):
                return
            time.sleep(0.5)
        raise ClusterError(f"node not idle after {timeout:.0f}s (sinfo: {state!r}); {self.logs()[-1500:]}")

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")))

    def stop(self) -> None:
        if self._procs:  # nothing to cancel (and maybe no scancel) when no daemon started
            try:
                self.run("scancel", "--full", "-u", "root", check=False)
            except (OSError, subprocess.SubprocessError):
                pass
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        if self._munged:
            subprocess.run([_exe("munged"), "--stop"], capture_output=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_job(self, job_id: str, timeout: float = 600) -> str:
        """Poll until the job leaves the queue; return its final state (``COMPLETED``, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("scontrol", "show", "job", job_id, "-o", check=False)
            fields = dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)
            state = fields.get("JobState", "")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
                return state
            time.sleep(1)
        raise ClusterError(f"job {job_id} still running after {timeout:.0f}s")


if __name__ == "__main__":
    import tempfile

    c = SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-")))
    c.start()
    print(f"export SLURM_CONF={c.conf}\n(state and logs in {c.root}; Ctrl-C stops the cluster)")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
