"""Starts a multi-process job on this machine: ``python -m jreplicate.cluster.launch``.

Usage::

    python -m jreplicate.cluster.launch --nproc N [--devices-per-proc K] [--max-restarts R] \\
        [--max-preemptions P] [--grace S] [--timeout S] script.py [args ...]

Starts ``N`` copies of ``script.py`` (or ``-m module``) that find each other through a
coordinator on ``127.0.0.1`` and a free port (``--host`` may name another loopback
address, ``::1`` or ``localhost``; every socket of the job listens on loopback only, see
:func:`jreplicate.cluster.runtime.connect`): each gets ``JREPLICATE_COORDINATOR``,
``JREPLICATE_NUM_PROCESSES`` and ``JREPLICATE_PROCESS_ID``, which
:class:`jreplicate.MultiWorkerStrategy` reads, and ``JREPLICATE_RESTART_COUNT`` (0 for
the first attempt). With ``N > 1`` each also gets ``JREPLICATE_FAIL_FAST=1`` (unless
set already): a strategy created with ``fail_fast=None`` then ends its process at the
first uncaught exception, so that the peers are not left waiting for it in a collective.
``--devices-per-proc K`` gives every process ``K`` simulated CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=K``, ``JAX_PLATFORMS=cpu``).

Every output line of process ``i`` is printed prefixed with ``[p<i>]``. When a process
fails (non-zero exit code or a signal), the others are terminated (SIGTERM, then SIGKILL
after ``--grace`` seconds) and the launcher exits with the status of the process that
failed first (128 + signal number for a signal) and a message saying which process it
was and how it failed: the exception its traceback ended with (``ValueError: ...``), or
else its last line on stderr. Peers that fail because of it, or are stopped, are not
blamed. Processes started by the programs die with the group: each program runs in its
own process group, which is killed when the group stops, and a small guard process
kills these groups if the launcher itself is killed (even by SIGKILL). With
``--max-restarts R`` the whole group is started again, up to ``R`` times, on a fresh
port; a program that restores its latest checkpoint on start (see
:class:`jreplicate.checkpoint.CheckpointManager`) then resumes where it stopped.

Preemption: a group whose processes all exit with status 42
(:data:`jreplicate.cluster.watchdog.EXIT_PREEMPTED`, what
:class:`jreplicate.checkpoint.Preempted` ends a process with once every process saved
the same checkpoint) is restarted without counting against ``--max-restarts``, up to
``--max-preemptions P`` times (default 100). When one process exits 42, the others
have ``--grace`` seconds to follow. A SIGTERM to the launcher itself (the host is going
away) is forwarded to every process as SIGTERM; the launcher waits ``--grace`` seconds
(give it more than a save takes), then exits 42 if every process did, without
restarting, and otherwise kills what is left and exits 143.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jreplicate.cluster.spec import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    is_loopback_host,
)
from jreplicate.cluster.watchdog import ENV_FAIL_FAST, EXIT_INIT_TIMEOUT, EXIT_PREEMPTED

_log = logging.getLogger("jreplicate")

ENV_RESTART_COUNT = "JREPLICATE_RESTART_COUNT"
_PROG = "jreplicate.cluster.launch"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def coordinator_address(host: str) -> str:
    """``host:port`` (``[host]:port`` for IPv6) with a port free on ``host``."""
    host = host.strip("[]")
    return f"[{host}]:{free_port(host)}" if ":" in host else f"{host}:{free_port(host)}"


@dataclasses.dataclass
class Outcome:
    """How one attempt of the group ended.

    Attributes:
      ok: every process exited with status 0.
      exit_code: the launcher's exit status for this outcome.
      message: which process failed and why (empty when ``ok``).
      preempted: every process exited with :data:`EXIT_PREEMPTED` (a restart that
        does not count against ``--max-restarts``).
    """

    ok: bool
    exit_code: int = 0
    message: str = ""
    preempted: bool = False


def describe_status(returncode: int) -> str:
    """``"exit code 3"`` or ``"killed by signal 9 (SIGKILL)"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name})"
    if returncode == EXIT_INIT_TIMEOUT:
        return f"exit code {returncode} (could not join the cluster in time)"
    if returncode == EXIT_PREEMPTED:
        return f"exit code {returncode} (preempted, after saving a checkpoint)"
    return f"exit code {returncode}"


def child_env(base: dict[str, str], *, coordinator: str, nproc: int, rank: int,
              devices_per_proc: int | None, restart: int) -> dict[str, str]:
    """The environment of process ``rank``.

    With more than one process it asks the strategies to fail fast
    (``JREPLICATE_FAIL_FAST=1``, unless ``base`` sets it): a process that raised ends at
    once, so that its peers are not left waiting for it in a collective.
    """
    env = dict(base)
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(nproc),
                ENV_PROCESS_ID: str(rank), ENV_RESTART_COUNT: str(restart),
                "PYTHONUNBUFFERED": "1"})
    if nproc > 1:
        env.setdefault(ENV_FAIL_FAST, "1")
    if devices_per_proc is not None:
        flag = "--xla_force_host_platform_device_count"
        kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
        env["XLA_FLAGS"] = " ".join(kept + [f"{flag}={devices_per_proc}"])
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_proc)
        env["JAX_PLATFORMS"] = "cpu"
        # Enough CPU client threads for K devices' collectives on small machines.
        env.setdefault("PJRT_NPROC", str(2 * devices_per_proc + 2))
    return env


# Runs first in each child (Linux): ask for SIGKILL when the launcher dies, check the
# launcher is still alive, then become the program. No Python runs between fork and exec.
_TIE_TO_PARENT = (
    "import ctypes,os,signal,sys\n"
    "try:\n ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "except Exception:\n pass\n"
    "if os.getppid() != int(sys.argv[1]):\n sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def tied_to_parent(cmd: list[str]) -> list[str]:
    """``cmd`` made to die with this process (PR_SET_PDEATHSIG on Linux), so that a
    killed launcher leaves nothing behind; unchanged elsewhere."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-S", "-c", _TIE_TO_PARENT, str(os.getpid()), *cmd]


# A guard per group: reads "<pgid>" lines from the launcher; on "exit" it ends; on EOF (the
# launcher died, however: its end of the pipe closed) it SIGKILLs every group it was told
# of, so that the programs' own children (grandchildren) die with the launcher.
_GUARD = (
    "import os,signal,sys\n"
    "for s in (signal.SIGINT, signal.SIGHUP):\n signal.signal(s, signal.SIG_IGN)\n"
    "groups = set()\n"
    "for line in sys.stdin:\n"
    " line = line.strip()\n"
    " if line == 'exit':\n  sys.exit(0)\n"
    " if line.isdigit():\n  groups.add(int(line))\n"
    "for g in groups:\n"
    " try:\n  os.killpg(g, signal.SIGKILL)\n"
    " except OSError:\n  pass\n"
)

_TRACEBACK = "Traceback (most recent call last):"
# The line jreplicate.checkpoint writes before a preempted process exits 42.
_PREEMPTED_LINE = re.compile(r"preempted: every process saved checkpoint (\d+)")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: .*)?$")


class _Group:
    """The N processes of one attempt, their output pumps, their guard and shutdown."""

    def __init__(self, cmd: list[str], envs: list[dict[str, str]]):
        self._lock = threading.Lock()
        self._last_err = [collections.deque(maxlen=5) for _ in envs]
        self._exception: list[str] = ["" for _ in envs]
        self.saved_step: list[int | None] = [None for _ in envs]  # before exiting 42
        self.ended: list[float | None] = [None for _ in envs]
        self.procs: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        self._guard = _start_guard()
        for rank, env in enumerate(envs):
            p = subprocess.Popen(tied_to_parent(cmd), env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
            self.procs.append(p)
            self._tell_guard(str(p.pid))  # its own session: process group id = pid
            threads = [threading.Thread(target=self._pump, args=(rank, p.stdout, sys.stdout,
                                                                  False), daemon=True),
                       threading.Thread(target=self._pump, args=(rank, p.stderr, sys.stderr,
                                                                  True), daemon=True),
                       threading.Thread(target=self._wait, args=(rank,), daemon=True)]
            for t in threads:
                t.start()
            self._pumps.extend(threads[:2])

    def _tell_guard(self, line: str) -> None:
        if self._guard is None:
            return
        try:
            self._guard.stdin.write(line + "\n")
            self._guard.stdin.flush()
        except (OSError, ValueError):  # the guard is gone: nothing to tell
            pass

    def _wait(self, rank: int) -> None:
        self.procs[rank].wait()
        self.ended[rank] = time.monotonic()

    def _pump(self, rank: int, stream, out, is_err: bool) -> None:
        prefix = f"[p{rank}] "
        in_traceback = False
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            if is_err and line.strip():
                if m := _PREEMPTED_LINE.search(line):
                    self.saved_step[rank] = int(m.group(1))
                self._last_err[rank].append(line.strip())
                if line.startswith(_TRACEBACK):
                    in_traceback = True
                elif in_traceback and not line[:1].isspace() and _EXCEPTION_LINE.match(line):
                    self._exception[rank] = line.strip()  # a traceback's final line
                    in_traceback = False
            with self._lock:
                out.write(prefix + line + "\n")
                out.flush()
        stream.close()

    def last_error_line(self, rank: int) -> str:
        lines = [ln for ln in self._last_err[rank] if not ln.startswith("*** ")]
        return lines[-1] if lines else ""

    def exception(self, rank: int) -> str:
        """The last ``SomeError: message`` line that ended a traceback of ``rank``."""
        return self._exception[rank]

    def first_failure(self) -> tuple[int, int] | None:
        """``(rank, returncode)`` of the process that failed first, or None; a process
        that exited :data:`EXIT_PREEMPTED` has not failed."""
        failed = [(self.ended[r] or float("inf"), r, c) for r, c in
                  enumerate(p.poll() for p in self.procs) if c not in (None, 0, EXIT_PREEMPTED)]
        if not failed:
            return None
        _, rank, code = min(failed)
        return rank, code

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:  # it exited between poll() and the signal
                    continue
                except PermissionError:
                    _log.warning("launch: no permission to signal process group %d "
                                 "(signal %d)", p.pid, sig)

    def stop(self, grace: float) -> None:
        """SIGTERM the processes still running, SIGKILL them after ``grace`` seconds."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _log.warning("launch: process %d still running 10 s after SIGKILL", p.pid)
        self.join_output()

    def join_output(self) -> None:
        for t in self._pumps:
            t.join(timeout=5)
        self.release_guard()

    def release_guard(self) -> None:
        """Ends the guard without it killing anything (the group ended normally)."""
        if self._guard is not None:
            self._tell_guard("exit")
            try:
                self._guard.stdin.close()
                self._guard.wait(timeout=5)
            except (OSError, ValueError, subprocess.TimeoutExpired) as e:
                # the guard was told to exit; one that lingers kills nothing
                _log.debug("launch: the group's guard did not close cleanly: %r", e)
            self._guard = None


def _start_guard() -> subprocess.Popen | None:
    try:
        return subprocess.Popen([sys.executable, "-S", "-c", _GUARD], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    except OSError:  # cannot start one: processes are still tied to the launcher
        return None


def run_group(cmd: list[str], *, nproc: int, devices_per_proc: int | None, host: str,
              restart: int, grace: float, timeout: float | None,
              terminate: threading.Event | None = None) -> Outcome:
    """Runs one attempt of the group to completion, first failure or preemption.

    Args:
      terminate: set (by the launcher's SIGTERM handler) to forward SIGTERM to every
        process and wait ``grace`` seconds for them to exit (see :func:`_forwarded`).
    """
    coordinator = coordinator_address(host)
    envs = [child_env(dict(os.environ), coordinator=coordinator, nproc=nproc, rank=r,
                      devices_per_proc=devices_per_proc, restart=restart)
            for r in range(nproc)]
    group = _Group(cmd, envs)
    start = time.monotonic()
    try:
        while True:
            if terminate is not None and terminate.is_set():
                return _forwarded(group, grace)
            codes = [p.poll() for p in group.procs]
            first = group.first_failure()
            if first is not None:
                time.sleep(0.1)  # let the exit times of near-simultaneous failures arrive
                return _failed(group, *(group.first_failure() or first), grace)
            if all(c == 0 for c in codes):
                group.join_output()
                return Outcome(True)
            if EXIT_PREEMPTED in codes:
                outcome = _preempted(group, grace)
                if outcome is not None:
                    return outcome
            if timeout is not None and time.monotonic() - start > timeout:
                running = [r for r, c in enumerate(codes) if c is None]
                group.stop(grace)
                return Outcome(False, 124, f"--timeout {timeout:g}s expired with processes "
                                           f"{running} still running; stopped them")
            time.sleep(0.05)
    except BaseException:  # broad: Ctrl-C or any error stops the group, then re-raised
        group.stop(grace)
        raise


def _failed(group: _Group, rank: int, code: int, grace: float) -> Outcome:
    """Stops the group after process ``rank`` failed with ``code``; says who and how."""
    nproc = len(group.procs)
    group.stop(grace)
    msg = f"process {rank} of {nproc} failed first: {describe_status(code)}"
    if group.exception(rank):
        msg += f"; it raised {group.exception(rank)[:500]}"
    elif group.last_error_line(rank):
        msg += f"; its last stderr line: {group.last_error_line(rank)[:500]}"
    if nproc > 1:
        msg += "; stopped the other processes"
    return Outcome(False, code if code > 0 else 128 - code, msg)


def _saved(group: _Group) -> str:
    """``"saved checkpoint 57 and "`` when every process said so, else ``""``."""
    steps = set(group.saved_step)
    return f"saved checkpoint {steps.pop()} and " if len(steps) == 1 and None not in steps \
        else ""


def _preempted(group: _Group, grace: float) -> Outcome | None:
    """The outcome once a process exited :data:`EXIT_PREEMPTED`: a preemption when every
    process did; a failure when one exited 0, or did not follow within ``grace``
    seconds (then stopped); None while the others may still follow."""
    codes = [p.poll() for p in group.procs]
    nproc = len(codes)
    out = [r for r, c in enumerate(codes) if c == EXIT_PREEMPTED]
    if all(c == EXIT_PREEMPTED for c in codes):
        group.join_output()
        every = "every process" if nproc > 1 else "the process"
        return Outcome(False, EXIT_PREEMPTED, f"preempted: {every} {_saved(group)}exited "
                                              f"{EXIT_PREEMPTED}", preempted=True)
    first_out = min(group.ended[r] or time.monotonic() for r in out)
    if None in codes and time.monotonic() - first_out < grace:
        return None
    stragglers = [r for r, c in enumerate(codes) if c != EXIT_PREEMPTED]
    group.stop(grace)
    how = (f"did not stop within --grace {grace:g}s (stopped them)" if None in codes else
           "ended otherwise (" + ", ".join(describe_status(codes[r]) for r in stragglers)
           + ")")
    return Outcome(False, EXIT_PREEMPTED, (
        f"processes {out} of {nproc} exited {EXIT_PREEMPTED} (preempted) but processes "
        f"{stragglers} {how}: they did not stop at the same save (every process must call "
        "CheckpointManager.save at every step); not a preemption"))


def _forwarded(group: _Group, grace: float) -> Outcome:
    """Forwards the launcher's SIGTERM to every process, waits ``grace`` seconds, then
    kills what is left: status 42 when every process exited 42, 0 when every process
    finished, else 143 (128 + SIGTERM)."""
    group.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in group.procs):
        time.sleep(0.05)
    codes = [p.poll() for p in group.procs]
    group.stop(0)  # SIGKILLs the processes still running (their SIGTERM was sent)
    if all(c == EXIT_PREEMPTED for c in codes):
        return Outcome(False, EXIT_PREEMPTED, (
            f"received SIGTERM and forwarded it: every process {_saved(group)}exited "
            f"{EXIT_PREEMPTED}; not restarting"), preempted=True)
    if all(c == 0 for c in codes):
        return Outcome(True, 0, "received SIGTERM; every process had finished")
    listed = "; ".join(f"process {r}: " + ("still running, killed" if c is None else
                                            describe_status(c)) for r, c in enumerate(codes)
                       if c != EXIT_PREEMPTED)
    return Outcome(False, 128 + signal.SIGTERM, (
        f"received SIGTERM and forwarded it; not every process exited {EXIT_PREEMPTED} "
        f"within --grace {grace:g}s ({listed}); stopped them"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {_PROG}",
        description="Start N local processes of a jreplicate multi-worker program.")
    p.add_argument("--nproc", type=int, required=True, help="number of processes (>= 1)")
    p.add_argument("--devices-per-proc", type=int, default=None, metavar="K",
                   help="simulated CPU devices per process")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="restart the whole group up to R times after a failure (default 0)")
    p.add_argument("--max-preemptions", type=int, default=100, metavar="P",
                   help=f"restart the whole group up to P times after every process exited "
                        f"{EXIT_PREEMPTED} (preempted, checkpoint saved); these restarts do "
                        "not count against --max-restarts (default 100)")
    p.add_argument("--host", default="127.0.0.1",
                   help="coordinator host, a loopback address (default 127.0.0.1)")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping, and for the "
                        f"processes to follow one that exited {EXIT_PREEMPTED} (default 5)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop the group if an attempt runs longer than S seconds")
    p.add_argument("script", help="the program: a .py file, or -m module")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the program")
    return p


_VALUED = ("--nproc", "--devices-per-proc", "--max-restarts", "--max-preemptions", "--host",
           "--grace", "--timeout")


def _program_start(argv: list[str]) -> int:
    """Index of the program (script or ``-m``): the first token that is not ours."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return i + 1
        if a in _VALUED:
            i += 2
        elif a.startswith("--") and a.split("=", 1)[0] in _VALUED or a in ("-h", "--help"):
            i += 1
        else:
            return i
    return i


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher; returns its exit status."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    i = _program_start(argv)
    ours = argv[:i - 1] if i and argv[i - 1] == "--" else argv[:i]  # `-- script.py`
    if i < len(argv) and argv[i] == "-m":  # `-m module args...`
        if i + 1 >= len(argv):
            parser.error("-m needs a module name, e.g. -m mypackage.train")
        ns = parser.parse_args(ours + ["--", "-m"])
        cmd = [sys.executable, "-u", "-m", argv[i + 1], *argv[i + 2:]]
    else:
        ns = parser.parse_args(ours + ["--"] + argv[i:])
        if not os.path.exists(ns.script):
            parser.error(f"script {ns.script!r} does not exist; give the path of a Python "
                         "file, or -m module")
        cmd = [sys.executable, "-u", ns.script, *ns.args]
    if ns.nproc < 1:
        parser.error(f"--nproc {ns.nproc}: the number of processes must be >= 1")
    if ns.devices_per_proc is not None and ns.devices_per_proc < 1:
        parser.error(f"--devices-per-proc {ns.devices_per_proc}: must be >= 1")
    if ns.max_restarts < 0:
        parser.error(f"--max-restarts {ns.max_restarts}: must be >= 0")
    if ns.max_preemptions < 0:
        parser.error(f"--max-preemptions {ns.max_preemptions}: must be >= 0")
    if ns.grace < 0:
        parser.error(f"--grace {ns.grace}: must be a number of seconds >= 0")
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error(f"--timeout {ns.timeout}: must be a positive number of seconds")
    if not is_loopback_host(ns.host):
        parser.error(f"--host {ns.host}: the launcher starts every process on this machine, "
                     "and they listen on --host only; give a loopback address: 127.0.0.1 "
                     "(the default), ::1 or localhost")

    terminate = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminate.set())
    try:
        return _attempts(cmd, ns, terminate)
    finally:  # main() may run inside another program (tests): give SIGTERM back
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _attempts(cmd: list[str], ns: argparse.Namespace, terminate: threading.Event) -> int:
    """Runs the group, restarting it after failures (``--max-restarts``) and after
    preemptions (``--max-preemptions``), counted apart; returns the exit status."""
    restarts = preemptions = 0
    while True:
        try:
            outcome = run_group(cmd, nproc=ns.nproc, devices_per_proc=ns.devices_per_proc,
                                host=ns.host, restart=restarts + preemptions,
                                grace=ns.grace, timeout=ns.timeout, terminate=terminate)
        except KeyboardInterrupt:
            print(f"{_PROG}: interrupted; stopped all processes", file=sys.stderr)
            return 130
        if outcome.message:
            print(f"{_PROG}: {outcome.message}", file=sys.stderr, flush=True)
        if outcome.ok:
            if restarts + preemptions:
                print(f"{_PROG}: succeeded after {restarts + preemptions} restart(s)",
                      file=sys.stderr)
            return 0
        if terminate.is_set():  # the host is going away: no restart
            return outcome.exit_code
        if outcome.preempted:
            if preemptions >= ns.max_preemptions:
                print(f"{_PROG}: giving up after {preemptions} preemption restart(s) "
                      f"(--max-preemptions {ns.max_preemptions})", file=sys.stderr)
                return outcome.exit_code
            preemptions += 1
            print(f"{_PROG}: restarting all {ns.nproc} processes (preemption {preemptions} of "
                  f"{ns.max_preemptions}; not counted against --max-restarts)",
                  file=sys.stderr, flush=True)
            continue
        if restarts >= ns.max_restarts:
            if ns.max_restarts:
                print(f"{_PROG}: giving up after {ns.max_restarts} restart(s)", file=sys.stderr)
            return outcome.exit_code
        restarts += 1
        print(f"{_PROG}: restarting all {ns.nproc} processes (restart {restarts} of "
              f"{ns.max_restarts})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
