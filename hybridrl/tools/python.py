"""``python``: run the policy's Python 3 code in a subprocess sandbox and return what it prints.

``{"code": "print(6*7)"}`` → ``"42\\n"``: stdout, then stderr after a ``[stderr]`` line when there is any. A program
that fails raises (the runner makes that an error observation and counts it): exit code ≠ 0 → ``RuntimeError`` with
the code and the output (stderr's end: the traceback's last line); past the wall limit → ``TimeoutError``.

The code runs in a fresh ``sys.executable -I -S -u`` (isolated: no environment variables, no user or system
site-packages, so the standard library only; unbuffered, so what it printed before a kill comes back), with stdin
empty and a new scratch directory (``tempfile.mkdtemp``) as its cwd, HOME and TMPDIR, removed after every call,
killed or not. Every limit is the kernel's, none trusts the code:

- ``timeout_s`` (wall): past it the tool stops the sandbox (below) and raises ``TimeoutError``.
- ``cpu_time_s``: RLIMIT_CPU (SIGXCPU at the limit, SIGKILL a second later).
- ``memory_mb``: RLIMIT_AS, which counts *virtual* memory (address space, mapped but untouched pages included), so an
  allocation past it is a ``MemoryError``; it is per process (a program of n processes may hold n times as much).
- ``max_file_mb``: RLIMIT_FSIZE, the size of any one file it writes (a write past it: ``OSError: File too large``).
- ``max_processes``: RLIMIT_NPROC, which counts processes *and threads* (a fork bomb's fork fails: EAGAIN).
- ``max_output_chars``: of each of stdout and stderr; the tool reads at most 4 bytes per character (+4) of a pipe
  and then stops the program, so one that prints forever costs a few kB, not memory. Output past the limit is not
  an error: the text comes back cut, and says so (and that the program was stopped there).
- no network: the program runs in a new network namespace (``unshare(CLONE_NEWNET)``: only a loopback that is down).
  ``allow_network=True`` skips that namespace; it is off by default, and where the namespaces cannot be made the
  tool fails at construction (it runs a probe program then) instead of running with the network.

The code travels as an argument, so it may be at most 128 KiB (Linux's MAX_ARG_STRLEN; past it: ``OSError``).

How it is built (Linux only): the subprocess is this file run as a launcher (:func:`_launch`, no ``preexec_fn``,
which is unsafe in the runner's threads). It ``unshare``s a new pid namespace (and network namespace) and forks an
init (pid 1 there) that forks the program (pid 2); when the program ends, init ends and the kernel kills everything
the program left in the namespace (daemons, ``setsid`` escapees, a fork bomb's remains). To stop a call, the tool
sends the launcher SIGTERM, on which it kills init (so it reaps init itself: a killed parent would leave init a
zombie until the host's init reaps it), with a SIGKILL of the launcher's process group after 1 s as a fallback
(init dies with the launcher too: PR_SET_PDEATHSIG). The program's exit status goes back to the launcher on a pipe,
which exits the same way (dying of the same signal), so the tool reads it as the program's.

Run as root (this project's machines), the program runs as ``nobody`` (65534): the kernel exempts a process with
CAP_SYS_RESOURCE or CAP_SYS_ADMIN from RLIMIT_NPROC (kernel/fork.c, ``copy_process``), so a root fork bomb would
not be stopped, and root would own every file. The launcher therefore drops to 65534 (``setgroups([])``,
``setgid``, ``setuid``) after making its namespaces, and the scratch directory is given to 65534. RLIMIT_NPROC
counts every process and thread of a uid on the machine: concurrent calls (3 processes each: launcher, init,
program) and anything else running as ``nobody`` share ``max_processes``, hence its default of 64. An interpreter
under a directory that ``nobody`` cannot enter (pyenv in a 0700 ``/root``) is reached through a private mount
namespace: a tmpfs over that directory and the interpreter's prefix bind-mounted back at the same path (its
RUNPATH names that path), so the rest of that directory stays hidden. Run as another user, the program runs as that
user, in a user namespace (which lets it make the others); RLIMIT_NPROC then counts that namespace's processes
(Linux ≥ 5.14).

This sandbox bounds accidents of model-written code (loops, fork bombs, memory hogs, floods, network calls); it is
no security boundary against deliberately hostile code: the program reads what ``nobody`` may read, sees the host's
``/proc``, and may write world-writable places such as ``/tmp`` (files there outlive the call).
"""

from __future__ import annotations

import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

NOBODY = 65534
PROBE_TIMEOUT_S = 30.0  # the start-up probe's wall limit (at least timeout_s)
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4


class PythonTool:
    """``python`` tool: ``{"code": "print(6*7)"}`` → ``"42\\n"``, run in a sandbox with the limits of ``Config``."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        timeout_s: float = 5.0  # wall time of one call
        cpu_time_s: int = 5  # RLIMIT_CPU of the program
        memory_mb: int = 512  # RLIMIT_AS (virtual memory) of each of its processes
        max_file_mb: int = 64  # RLIMIT_FSIZE: the largest file it may write
        max_processes: int = 64  # RLIMIT_NPROC (processes and threads; as root: all of nobody's, see above)
        max_output_chars: int = 4000  # of stdout and of stderr each; past it the program is stopped
        allow_network: bool = False  # True: no network namespace (the program can reach the network)

        def __post_init__(self) -> None:
            if not self.timeout_s > 0:
                raise ValueError(f"timeout_s={self.timeout_s} must be > 0 (seconds)")
            for name in ("cpu_time_s", "memory_mb", "max_file_mb", "max_processes", "max_output_chars"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name}={getattr(self, name)} must be an integer ≥ 1")

    schema: ClassVar[dict[str, Any]] = {"type": "function", "function": {
        "name": "python",
        "description": "Run Python 3 code (standard library only, no network, a few seconds) and return what it "
                       "prints: print() every value you want to see.",
        "parameters": {"type": "object", "properties": {"code": {
            "type": "string", "description": "a complete Python 3 program, e.g. print(sum(range(10)))"}},
            "required": ["code"]}}}

    def __init__(self, config: PythonTool.Config | None = None, **ctx: Any) -> None:
        self.config = config if config is not None else self.Config()
        python = os.path.realpath(sys.executable)
        prefix = os.path.realpath(sys.base_prefix)
        self._argv = [python, "-I", "-S", os.path.abspath(__file__), python, prefix, _closed_ancestor(prefix),
                      *(str(v) for v in (self.config.cpu_time_s, self.config.memory_mb << 20,
                                         self.config.max_file_mb << 20, self.config.max_processes,
                                         int(self.config.allow_network)))]
        # the probe gets its own time (a start on a loaded machine can take longer than a small timeout_s)
        out, err, ended, code = self._run("print('ok')", timeout_s=max(self.config.timeout_s, PROBE_TIMEOUT_S))
        if (out, ended, code) != (b"ok\n", "", 0):
            raise RuntimeError(
                "the python tool's sandbox cannot start here (it needs Linux pid, mount and network namespaces; "
                "allow_network=True drops the network one): " + (err.decode(errors="replace").strip()[-500:]
                                                                  or f"exit code {code}, {ended or 'no output'}"))

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) - {"code"}:
            raise ValueError(f"python takes {{\"code\": \"<Python 3 program>\"}}, got {arguments!r}")
        out, err, ended, status = self._run(code)
        text = self._text(out, err, stopped=ended == "output")
        c = self.config
        if ended == "timeout":
            raise TimeoutError(f"the program ran past the {c.timeout_s:g} s time limit (timeout_s) and was "
                               f"killed{_after(text)}")
        if ended == "output":
            return text
        if status == -signal.SIGXCPU:
            raise RuntimeError(f"the program used up its {c.cpu_time_s} s of CPU time (cpu_time_s) and was "
                               f"killed{_after(text)}")
        if status < 0:
            raise RuntimeError(f"the program was killed by {signal.Signals(-status).name}{_after(text)}")
        if status > 0:
            hint = next((f" ({h})" for name, h in (
                ("MemoryError", f"memory_mb: each process may map {c.memory_mb} MB"),
                ("BlockingIOError", f"max_processes: the sandbox allows {c.max_processes} processes and threads"),
            ) if name in err.decode(errors="replace")[-300:]), "")
            raise RuntimeError(f"the program exited with code {status}{hint}{_after(text)}")
        return text

    def _run(self, code: str, *, timeout_s: float | None = None) -> tuple[bytes, bytes, str, int]:
        """stdout, stderr, how it ended ("" on its own, or killed at "timeout" or "output") and its exit status; the
        wall limit is ``timeout_s`` (default: the config's)."""
        home = tempfile.mkdtemp(prefix="hybridrl-python-")
        try:
            if os.geteuid() == 0:
                os.chown(home, NOBODY, NOBODY)
            env = {"HOME": home, "TMPDIR": home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
            proc = subprocess.Popen([*self._argv, code], cwd=home, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            try:
                out, err, ended = self._collect(proc, self.config.timeout_s if timeout_s is None else timeout_s)
            finally:
                if proc.returncode is None:  # stopped: the launcher kills init, so the kernel kills the rest
                    proc.terminate()
                    try:
                        proc.wait(1.0)
                    except subprocess.TimeoutExpired:  # unreaped, its group id is still the sandbox's
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                proc.stdout.close()  # type: ignore[union-attr]
                proc.stderr.close()  # type: ignore[union-attr]
            return out, err, ended, proc.returncode
        finally:
            shutil.rmtree(home, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[bytes, bytes, str]:
        cap, deadline = 4 * self.config.max_output_chars + 4, time.monotonic() + timeout_s
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
        out, err = bufs.values()
        with selectors.DefaultSelector() as selector:
            for fd in bufs:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                if (left := deadline - time.monotonic()) <= 0:
                    return bytes(out), bytes(err), "timeout"
                for key, _ in selector.select(left):
                    buf = bufs[key.fd]
                    chunk = os.read(key.fd, cap + 1 - len(buf))
                    if not chunk:
                        selector.unregister(key.fd)
                    buf += chunk
                    if len(buf) > cap:
                        return bytes(out), bytes(err), "output"
        try:  # both pipes closed: the program has ended, or closed them and goes on
            proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            return bytes(out), bytes(err), "timeout"
        return bytes(out), bytes(err), ""

    def _text(self, out: bytes, err: bytes, *, stopped: bool) -> str:
        n = self.config.max_output_chars
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        note = "; the program was stopped there" if stopped else ""
        if len(stdout) > n:
            stdout = f"{stdout[:n]}\n[stdout cut to its first {n} characters{note}]\n"
        if len(stderr) > n:
            stderr = f"[stderr cut to its last {n} characters{note}]\n{stderr[-n:]}"
        if not stderr:
            return stdout
        return f"{stdout}{'' if not stdout or stdout.endswith(chr(10)) else chr(10)}[stderr]\n{stderr}"


def _after(text: str) -> str:
    return f":\n{text}" if text else ""


def _closed_ancestor(path: str) -> str:
    """The first directory above ``path`` that others may not enter ("" if none): hidden from a root sandbox."""
    return next((str(p) for p in reversed(Path(path).parents) if not p.stat().st_mode & stat.S_IXOTH), "")


def _launch(python: str, prefix: str, hide: str, cpu: str, memory: str, fsize: str, nproc: str, network: str,
            code: str) -> None:
    """The sandbox's first process (``python -I -S this_file ...``): namespaces, the drop to nobody, init, the
    program; it exits as the program did."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            sys.exit(f"sandbox: {what}: {os.strerror(ctypes.get_errno())}")

    net = 0 if network == "1" else _CLONE_NEWNET
    if os.geteuid() == 0:
        check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWPID | net), "unshare(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWNET)")
        check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        if hide:  # tmpfs over the closed directory, the interpreter's prefix bound back at its own path
            os.umask(0o022)  # the directories made below: open to nobody
            fd = os.open(prefix, os.O_PATH)
            check(libc.mount(b"tmpfs", hide.encode(), b"tmpfs", 0, b"mode=755"), f"mount tmpfs on {hide}")
            os.makedirs(prefix)
            check(libc.mount(f"/proc/self/fd/{fd}".encode(), prefix.encode(), None, _MS_BIND | _MS_REC, None),
                  f"bind-mount {prefix}")
            os.close(fd)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    else:
        uid, gid = os.geteuid(), os.getegid()
        check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWPID | net), "unshare(CLONE_NEWUSER|CLONE_NEWPID|CLONE_NEWNET)")
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    # the tool's SIGTERM (a call stopped at a limit): kill init, so that the kernel kills the whole namespace
    # and this launcher reaps init (killed with the launcher, it would be a zombie until the host's init reaps it)
    init = 0  # until init is forked, 0: the launcher's own process group
    signal.signal(signal.SIGTERM, lambda *_: os.kill(init, signal.SIGKILL))
    status_r, status_w = os.pipe()  # init → launcher: the program's wait status
    if (init := os.fork()) == 0:  # init, pid 1 of the new pid namespace
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        os.close(status_r)
        program = os.fork()
        if program == 0:
            limits = ((resource.RLIMIT_CPU, int(cpu), int(cpu) + 1), (resource.RLIMIT_AS, int(memory), int(memory)),
                      (resource.RLIMIT_FSIZE, int(fsize), int(fsize)), (resource.RLIMIT_NPROC, int(nproc), int(nproc)),
                      (resource.RLIMIT_CORE, 0, 0))
            for limit, soft, hard in limits:
                resource.setrlimit(limit, (soft, hard))
            os.execv(python, [python, "-I", "-S", "-u", "-c", code])
        while (reaped := os.wait())[0] != program:  # init reaps the orphans too
            pass
        os.write(status_w, str(reaped[1]).encode())
        os._exit(0)  # the kernel now kills what is left in the namespace
    os.close(status_w)
    reported = os.read(status_r, 32)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # init is reaped next: its pid is no longer ours
    os.waitpid(init, 0)
    if not reported:
        sys.exit("sandbox: init was killed")
    exit_code = os.waitstatus_to_exitcode(int(reported))
    if exit_code < 0:  # die of the program's signal, without a core dump
        libc.prctl(_PR_SET_DUMPABLE, 0)
        signal.signal(-exit_code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-exit_code})
        os.kill(os.getpid(), -exit_code)
    sys.exit(exit_code)


if __name__ == "__main__":
    _launch(*sys.argv[1:])
