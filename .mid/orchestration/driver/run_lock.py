"""One writer per run directory: the lease a start takes before it reads or writes anything of its run.

The lease is a file, `run.lock`, created exclusively (a hard link to a private file that already holds the record:
link() fails when the name exists, atomically on a local filesystem and on NFS; O_EXCL where there are no hard
links) and holding JSON that names its holder: host, pid, the pid's start time, the
boot and pid namespace it runs in, when it started, and a heartbeat time the holder rewrites every heartbeat_s
(temp file + rename, so a reader never sees half a record). A second start reads the record and refuses (exit 2 through
ConfigError) unless the holder is gone:

- on the same host (same host name, boot and pid namespace): the pid no longer runs, or runs another program
  (its start time differs: the pid was reused), or is a zombie. A SIGKILLed driver frees the run at once;
- anywhere else: its heartbeat is older than stale_after_s (stale_misses missed heartbeats). A lost node frees the
  run after that long. This compares the holder's clock with ours: hosts must keep their clocks within a few seconds
  of each other (NTP), as any shared-filesystem lease does.

Taking over a stale lease is serialized by a second exclusive file, `run.lock.takeover`, so that of two starts that
both found the same stale holder only one replaces it (the other then finds the new, live holder and refuses). A
takeover file left by a start killed in between is itself stale after stale_after_s.

docs/reliability.md says how the same lease maps onto an object store (conditional create, conditional replace).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestration.config import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
TAKEOVER_SUFFIX = ".takeover"
HEARTBEAT_S = 10.0
STALE_MISSES = 3  # a holder whose heartbeat is this many intervals old is gone (a lost node)


class RunLocked(ConfigError):
    """Another live start holds the run: the message names it (host, pid, start time) and what to do."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run, as its lease file records it."""

    host: str
    pid: int
    pid_start: str | None  # the pid's start time in clock ticks since boot (/proc/<pid>/stat field 22): pid reuse
    boot_id: str | None  # /proc/sys/kernel/random/boot_id: a reboot ends every holder of the host
    pid_namespace: int | None  # inode of /proc/self/ns/pid: two containers with one host name are two hosts
    started: float  # when it took the lease (its clock)
    heartbeat: float  # when it last rewrote the lease (its clock)
    token: str  # unique to one taking of the lease: a release or heartbeat touches only its own

    def describe(self, now: float) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"host {self.host}, pid {self.pid}, started {started} (last heartbeat "
                f"{max(0.0, now - self.heartbeat):.0f} s ago)")


def read_proc_text(path: str) -> str | None:
    """A small file's text (/proc entries), None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def process_start_ticks(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in ticks since boot); None without /proc or when it does not run."""
    stat = read_proc_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def process_state(pid: int) -> str | None:
    stat = read_proc_text(f"/proc/{pid}/stat")
    return stat[stat.rfind(")") + 2:].split()[0] if stat else None


def pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def this_host() -> dict:
    """The identity fields of a Holder for this process."""
    boot = read_proc_text("/proc/sys/kernel/random/boot_id")
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start_ticks(os.getpid()),
            "boot_id": boot.strip() if boot else None, "pid_namespace": pid_namespace()}


def pid_running(pid: int, start_ticks: str | None) -> bool:
    """Whether `pid` runs and is the process that recorded `start_ticks` (a zombie does not run)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it runs, as another user
    if process_state(pid) in ("Z", "X"):
        return False
    now_ticks = process_start_ticks(pid)
    return start_ticks is None or now_ticks is None or now_ticks == start_ticks


def why_gone(holder: Holder, now: float, here: dict, stale_after_s: float,
             running: Callable[[int, str | None], bool] = pid_running) -> str | None:
    """Why the holder no longer holds the run (None: it does). Pure but for `running` (the pid check)."""
    same_machine = (holder.host == here["host"] and holder.pid_namespace == here["pid_namespace"])
    if same_machine and holder.boot_id and here["boot_id"] and holder.boot_id != here["boot_id"]:
        return "its host rebooted since"
    if same_machine and not running(holder.pid, holder.pid_start):
        return f"pid {holder.pid} no longer runs on {holder.host}"
    age = now - holder.heartbeat
    if age > stale_after_s:
        return f"its heartbeat is {age:.0f} s old (stale after {stale_after_s:.0f} s)"
    return None


def read_holder(path: Path) -> Holder | None:
    """The lease's record; None when the file is gone. A record that cannot be parsed is returned as a holder with
    heartbeat 0 (stale by age): the create and the rename write whole records, so only a damaged file gets here."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return Holder(host="?", pid=-1, pid_start=None, boot_id=None, pid_namespace=None, started=0.0,
                      heartbeat=0.0, token="unreadable")


def _create_exclusive(path: Path, text: str) -> bool:
    """Create `path` holding `text` unless it exists; atomic with its content (a reader sees the whole record or no
    file): the record is written to a private file first and hard-linked to `path` (link() fails if `path` exists,
    also on NFS, where it is the classic exclusive create). Where the filesystem has no hard links: O_EXCL."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        pass  # no hard links here
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


class RunLock:
    """The lease of one run directory, held from acquire() to release() with a heartbeat thread."""

    def __init__(self, run_path: Path, heartbeat_s: float = HEARTBEAT_S, stale_misses: int = STALE_MISSES):
        self.run_path = Path(run_path)
        self.path = self.run_path / LOCK_FILE
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = heartbeat_s * stale_misses
        self.holder: Holder | None = None
        self.lost = False  # set when the heartbeat found another holder in our lease
        self._created_run_path = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, started: float, token: str) -> Holder:
        return Holder(**this_host(), started=started, heartbeat=time.time(), token=token)

    def acquire(self) -> RunLock:
        """Take the lease or raise RunLocked; creates the run directory if it does not exist yet."""
        if not self.run_path.exists():
            try:
                self.run_path.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as exc:
                raise ConfigError(f"run_root: cannot create the run directory {self.run_path} ({exc}): point "
                                  "run_root at a directory") from None
            self._created_run_path = True
        try:
            self._take()
        except BaseException:
            self._drop_created_run_path()
            raise
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _take(self) -> None:
        mine = self._record(time.time(), uuid.uuid4().hex)
        for _ in range(3):  # a holder that released between our read and our create: try again
            holder = read_holder(self.path)  # read first: a refused start writes nothing, not even a temp file
            if holder is None:
                if _create_exclusive(self.path, json.dumps(asdict(mine))):
                    self.holder = mine
                    return
                continue
            now = time.time()
            reason = why_gone(holder, now, this_host(), self.stale_after_s)
            if reason is None:
                raise RunLocked(f"run_name: run directory {self.run_path} is being written by another start "
                                f"({holder.describe(now)}): wait for it to end or stop it, or choose another "
                                f"run_name (a holder on another host that died frees it after "
                                f"{self.stale_after_s:.0f} s without heartbeat; nothing was changed on disk)")
            if self._take_over(holder, reason, mine):
                return
        raise RunLocked(f"run_name: could not take the lease {self.path}: other starts of the same run keep taking "
                        "it; start one at a time (nothing was changed on disk)")

    def _take_over(self, stale: Holder, reason: str, mine: Holder) -> bool:
        """Replace a stale holder's lease by ours, one contender at a time. False: the lease changed meanwhile."""
        takeover = self.path.with_name(LOCK_FILE + TAKEOVER_SUFFIX)
        if not _create_exclusive(takeover, mine.token):
            try:
                age = time.time() - takeover.stat().st_mtime
            except FileNotFoundError:
                return False
            if age <= self.stale_after_s:
                raise RunLocked(f"run_name: another start is taking over run directory {self.run_path} right now "
                                f"({takeover} exists): start one at a time (nothing was changed on disk)")
            takeover.unlink(missing_ok=True)  # left by a start killed while taking over
            return False
        try:
            current = read_holder(self.path)
            if current is not None and current.token != stale.token:
                return False  # someone took it and released, or took it: decide again
            self.path.unlink(missing_ok=True)
            if not _create_exclusive(self.path, json.dumps(asdict(mine))):
                return False
            log.warning("Took over run directory %s from %s: %s", self.run_path, stale.describe(time.time()), reason)
            self.holder = mine
            return True
        finally:
            takeover.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.heartbeat()

    def heartbeat(self) -> None:
        """Rewrite the lease with a new heartbeat time, if it is still ours."""
        assert self.holder is not None
        current = read_holder(self.path)
        if current is None or current.token != self.holder.token:
            if not self.lost:
                self.lost = True
                log.error("Lost the lease of run directory %s to %s: another start took it over (this process "
                          "missed its heartbeats); stop one of the two", self.run_path,
                          current.describe(time.time()) if current else "nobody")
            return
        self.holder = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
        tmp = self.path.with_name(f".{LOCK_FILE}.{self.holder.token}.tmp")
        try:
            tmp.write_text(json.dumps(asdict(self.holder)))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk must not end the run; the lease only ages
            tmp.unlink(missing_ok=True)
            log.warning("cannot refresh the lease %s: %s", self.path, exc)

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours; removes a run directory acquire() created
        when nothing else was written into it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = read_holder(self.path)
        if self.holder is not None and current is not None and current.token == self.holder.token:
            self.path.unlink(missing_ok=True)
        self.holder = None
        self._drop_created_run_path()

    def _drop_created_run_path(self) -> None:
        if self._created_run_path:
            with contextlib.suppress(OSError):
                self.run_path.rmdir()  # only when empty: a start that wrote something keeps its directory
            self._created_run_path = False


@contextlib.contextmanager
def hold_run_lock(run_path: Path) -> Iterator[RunLock]:
    """The run's lease for the length of the block (RunLocked when another live start holds it)."""
    lock = RunLock(run_path).acquire()
    try:
        yield lock
    finally:
        lock.release()
