"""Find the processes a test script started, however deep, by an environment variable they all inherit.

psutil's ``Process.environ()`` misses it in processes that renamed themselves (``setproctitle``, as SGLang's and
vLLM's engine processes do): the new title is written over the start of the environment block, and psutil stops at
the padding it leaves. The raw ``/proc/<pid>/environ`` still holds the rest, so the mark is searched there.
"""

from __future__ import annotations

from pathlib import Path


def marked(name: str, value: str) -> list[int]:
    """Pids of the live (not zombie) processes whose environment holds ``name=value``."""
    needle = f"\0{name}={value}\0".encode()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]  # after "pid (comm)"
            if state != "Z" and needle in b"\0" + (proc / "environ").read_bytes() + b"\0":
                out.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            pass
    return out
