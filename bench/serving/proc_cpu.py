"""CPU seconds used by a process and all its descendants, per process, from /proc (Linux only):
which of a server's processes (gateway, engine core, lanes, span exporters) a change costs.

    before = tree_cpu(pid)          # {label: cpu seconds}
    ...
    used = cpu_delta(before, tree_cpu(pid))

A label is the process's role read from its command line (`role_of`), with `#n` added when one
role has several processes; a process that started or ended between two readings counts from 0.
"""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def role_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "gone"
    if "verifypd.net.span_export" in argv:
        return f"span-exporter({argv[-1]})"
    if "verifypd.core.process" in argv:
        return "engine-core"
    if "verifypd.cli" in argv:
        rest = argv[argv.index("verifypd.cli") + 1 :]
        if rest[:1] == ["serve"]:
            return "gateway"
        if rest[:1] == ["lane"]:
            return "lane(" + " ".join(a for a in rest[1:3] if not a.startswith("-")) + ")"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return os.path.basename(argv[0]) if argv else "?"


def tree_cpu(root: int) -> dict[str, float]:
    """{label: CPU seconds} of `root` and its descendants now."""
    return {label: cpu for label, (_, cpu) in tree(root).items()}


def tree(root: int) -> dict[str, tuple[int, float]]:
    """{label: (pid, CPU seconds)} of `root` and its descendants now."""
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            got = _stat(int(name))
            if got is not None:
                stats[int(name)] = got
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, tuple[int, float]] = {}
    stack = [root] if root in stats else []
    while stack:
        pid = stack.pop()
        label = role_of(pid)
        n = 1
        while (label if n == 1 else f"{label}#{n}") in out:
            n += 1
        out[label if n == 1 else f"{label}#{n}"] = (pid, stats[pid][1])
        stack.extend(sorted(children.get(pid, [])))
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
