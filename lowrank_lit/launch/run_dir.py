"""Where a run writes: ``<run_root>/<experiment>/<run_id>/``.

* ``run_id`` is the SLURM job id (``<job>_<task>`` for array tasks) when the process runs under
  a SLURM batch job, so a requeued job lands in the same directory and resumes there; otherwise
  a timestamp plus a random suffix, and a directory that already exists is never reused.
* DDP workers started by Lightning's subprocess launcher inherit ``LOWRANK_RUN_DIR`` from the
  rank-0 process, so all ranks agree on one directory.
* A run directory is claimed before anything is written into it (:func:`claim_run_dir`): a claim file
  ``.lowrank-claim`` created atomically, naming the host and pid of the run. A second run started on a live
  run's directory is refused in one line naming that run; a claim left by a killed run (its pid gone on this
  host, or an earlier attempt of the same SLURM job) is taken over, so a resume is never blocked by it. The
  claim is removed when the run ends. Sweep trials and ``lowrank matrix`` cells are ``lowrank fit`` runs, so
  they take the same claim.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunDir", "RunDirError", "slurm_run_id", "new_run_id", "resolve_run_dir", "claim_run_dir", "release_claims",
           "newest_checkpoint", "check_run_root", "ENV_RUN_DIR", "CLAIM_FILE"]

ENV_RUN_DIR = "LOWRANK_RUN_DIR"
#: the file that claims a run directory for one live run (removed when the run ends)
CLAIM_FILE = ".lowrank-claim"
_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class RunDirError(ValueError):
    """A run directory that cannot be used: a bad name, a run root that is not a writable folder, or a directory
    claimed by a live run. The message is one line naming the argument."""


@dataclass(frozen=True)
class RunDir:
    """A resolved run directory.

    Attributes:
        path: the directory (created).
        experiment: experiment name, e.g. ``baseline/mlp_digits``.
        run_id: the run's id inside the experiment folder.
        resumed: True when the directory existed before (SLURM requeue or an explicit ``run_id``).
        created: the folders that creating it added.
    """

    path: Path
    experiment: str
    run_id: str
    resumed: bool
    #: the folders creating it added (the run directory, then its new parents): removed again by a run refused at
    #: setup, so a refused command leaves nothing behind
    created: tuple[Path, ...] = ()

    @property
    def wandb_id(self) -> str:
        """A W&B run id that is stable for the directory: ``<experiment>-<run_id>`` (safe characters)."""
        return re.sub(r"[^A-Za-z0-9_\-]", "-", f"{self.experiment}-{self.run_id}")[-120:]


def slurm_run_id() -> str | None:
    """The SLURM job id of a batch job (``<array_job>_<task>`` for arrays), else None.

    Interactive allocations (job name ``bash``/``interactive``, which Lightning's SLURM detection
    also skips) get None, so runs started by hand inside one do not share a directory.
    """
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else job


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxx`` (local time plus 4 random hex digits)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


#: the longest run id and experiment folder name: a file name has at most 255 bytes, and W&B ids and the files of the
#: run (``config.<n>.yaml``, ``.lowrank-claim.<pid>.<hex>``) need room beside it
MAX_NAME = 128


def _short(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:37]}... ({len(text)} characters)"


def _validate(experiment: str, run_id: str | None) -> None:
    long = next((p for p in experiment.split("/") if len(p) > MAX_NAME), None)
    if long is not None:
        raise RunDirError(f"--experiment={_short(experiment)!r}: a folder name of {len(long)} characters; allowed: "
                          f"at most {MAX_NAME} characters per '/'-separated part")
    if run_id is not None and len(run_id) > MAX_NAME:
        raise RunDirError(f"--run_id={_short(run_id)!r}; allowed: at most {MAX_NAME} characters")
    if not _EXPERIMENT_RE.match(experiment) or any(p in (".", "..") for p in experiment.split("/")):
        raise RunDirError(
            f"--experiment={experiment!r}; allowed: path segments of ASCII letters, digits, '_', '.', '-' joined by "
            "'/' (no spaces, no '..')"
        )
    if run_id is not None and (not _RUN_ID_RE.match(run_id) or run_id in (".", "..")):
        raise RunDirError(f"--run_id={run_id!r}; allowed: ASCII letters, digits, '_', '.', '-' (no '/', no spaces)")


def check_run_root(run_root: str | os.PathLike) -> None:
    """The run root is a folder this process may write (or can be created): else one line naming ``--run_root``."""
    root = Path(run_root)
    probe = root
    while not probe.exists() and probe != probe.parent:  # the nearest existing ancestor decides
        probe = probe.parent
    if not probe.is_dir():
        raise RunDirError(f"--run_root={os.fspath(run_root)!r}: {os.fspath(probe)!r} is a file, not a folder; "
                          "allowed: a folder (created if missing)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunDirError(f"--run_root={os.fspath(run_root)!r}: {os.fspath(probe)!r} is not writable by this user; "
                          "allowed: a folder you can write")


# --------------------------------------------------------------------------------------- claims
#: claim files this process holds: path of the claim -> its text
_HELD: dict[Path, str] = {}


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), None where unknown: a pid the
    kernel gave to a new process after the claiming one died does not pass for the claimer."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _claim_text() -> str:
    pid = os.getpid()
    info = {"host": socket.gethostname(), "pid": pid, "start": _proc_start(pid),
            "slurm_job": slurm_run_id(), "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
    return json.dumps(info, sort_keys=True) + "\n"


def _holder(text: str) -> dict | None:
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) and "host" in info and "pid" in info else None


def _is_stale(info: dict | None, age_s: float) -> bool:
    """Whether a claim was left by a run that is gone: its pid is dead (or reused) on this host, or it was an earlier
    attempt of this SLURM job (a requeued job resumes on any node). An unreadable claim is stale once it is older
    than a few seconds (a claim is written in one step, so this only happens after a crash of the filesystem)."""
    if info is None:
        return age_s > 5.0
    ours = slurm_run_id()
    if ours is not None and info.get("slurm_job") == ours:
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if int(info.get("slurm_restart") or 0) < restart or info.get("host") != socket.gethostname():
            return True
    if info.get("host") != socket.gethostname():
        return False
    pid = int(info["pid"])
    if not _pid_alive(pid):
        return True
    start = info.get("start")
    return start is not None and _proc_start(pid) not in (None, start)


def claim_run_dir(path: str | os.PathLike) -> None:
    """Claim the run directory ``path`` (it exists) for this process, before anything is written into it.

    The claim file is created with ``O_EXCL`` semantics (written aside, then hard-linked into place, so it is never
    seen half written). A stale claim (see :func:`_is_stale`) is moved aside and the claim retried.

    Raises:
        RunDirError: a live run holds the directory (the message names its host and pid).
    """
    path = Path(path)
    claim = path / CLAIM_FILE
    text = _claim_text()
    for _ in range(20):
        tmp = path / f"{CLAIM_FILE}.{os.getpid()}.{secrets.token_hex(3)}"
        tmp.write_text(text)
        try:
            os.link(tmp, claim)
            _HELD[claim] = text
            return
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        try:
            held = claim.read_text()
            age = time.time() - claim.stat().st_mtime
        except FileNotFoundError:  # released meanwhile: try again
            continue
        info = _holder(held)
        if not _is_stale(info, age):
            who = f"host {info['host']}, pid {info['pid']}" if info else "an unreadable claim"
            raise RunDirError(f"--run_id={path.name!r}: {path} is in use by a live run ({who}); wait for it to end, "
                              "or pick another --run_id")
        stale = path / f"{CLAIM_FILE}.stale.{secrets.token_hex(3)}"
        try:
            os.rename(claim, stale)
        except FileNotFoundError:
            continue
        if stale.read_text() != held:  # moved a claim another resumer took meanwhile: put it back, refuse
            os.rename(stale, claim)
            continue
        stale.unlink()
    raise RunDirError(f"--run_id={path.name!r}: could not claim {path} (another run keeps claiming it)")


def release_claims() -> None:
    """Remove the claim files this process holds (when a run ends, and at exit)."""
    for claim, text in list(_HELD.items()):
        try:
            if claim.read_text() == text:
                claim.unlink()
        except OSError:
            pass
        _HELD.pop(claim, None)


atexit.register(release_claims)


def resolve_run_dir(run_root: str | os.PathLike, experiment: str, run_id: str | None = None,
                    claim: bool = False) -> RunDir:
    """Pick and create the run directory.

    Args:
        run_root: folder holding all experiments, e.g. ``runs``.
        experiment: experiment name (may contain ``/``).
        run_id: reuse this id (resume an existing run). Default: the SLURM job id, else a fresh id.

        claim: claim the directory for this process (:func:`claim_run_dir`). Only the first process of a run
            claims: DDP workers and the other nodes of a multi-node job share rank zero's claim.

    Returns:
        The created (or re-entered) :class:`RunDir`.

    Raises:
        RunDirError: a bad experiment name or run id, a run root that is a file or not writable, or a directory a
            live run holds.
    """
    _validate(experiment, run_id)
    inherited = os.environ.get(ENV_RUN_DIR)
    if inherited and int(os.environ.get("LOCAL_RANK", "0") or 0) > 0:
        # a DDP worker spawned by rank 0: use rank 0's directory
        path = Path(inherited)
        path.mkdir(parents=True, exist_ok=True)
        return RunDir(path, experiment, path.name, resumed=True)
    check_run_root(run_root)
    base = Path(run_root) / experiment
    fixed = run_id or slurm_run_id()
    try:
        return _make(base, experiment, fixed, claim)
    except PermissionError as exc:
        raise RunDirError(f"--run_root={os.fspath(run_root)!r}: cannot create {exc.filename!r} ({exc.strerror}); "
                          "allowed: a folder you can write") from None


def _missing_parents(path: Path) -> list[Path]:
    """The folders from ``path`` up that do not exist yet (deepest first): what creating ``path`` adds."""
    out = []
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _make(base: Path, experiment: str, fixed: str | None, claim: bool) -> RunDir:
    if fixed is not None:
        path = base / fixed
        created = tuple(_missing_parents(path))
        path.mkdir(parents=True, exist_ok=True)
        if claim:
            claim_run_dir(path)
        resumed = any(p.name != CLAIM_FILE and not p.name.startswith(CLAIM_FILE + ".") for p in path.iterdir())
        return RunDir(path, experiment, fixed, resumed, created)
    parents = _missing_parents(base)
    base.mkdir(parents=True, exist_ok=True)
    while True:  # never reuse an existing directory for a new run
        rid = new_run_id()
        try:
            (base / rid).mkdir()
        except FileExistsError:
            continue
        if claim:
            claim_run_dir(base / rid)
        return RunDir(base / rid, experiment, rid, False, (base / rid, *parents))


def newest_checkpoint(paths: list[Path]) -> Path | None:
    """Of the existing, readable checkpoints in ``paths``: the one with the most optimizer steps (then the newest file)."""
    from lowrank_lit.checkpoint import checkpoint_step

    found = [(checkpoint_step(p), p.stat().st_mtime, p) for p in paths if p.is_file()]
    found = [f for f in found if f[0] >= 0]
    return max(found, key=lambda f: (f[0], f[1]))[2] if found else None
