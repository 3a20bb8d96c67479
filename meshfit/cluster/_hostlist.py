"""Expand SLURM host lists such as ``node[01-03,7],gpu5``."""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_pattern(pattern: str, variable: str) -> list[str]:
    """Expand every ``[...]`` group of one host pattern (cartesian product, left to right)."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise ValueError(f"Invalid {variable}: unbalanced ']' in host pattern {pattern!r}. "
                             "Use SLURM's form, e.g. node[01-03,7].")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"Invalid {variable}: unbalanced '[' in host pattern {pattern!r}. "
                         "Use SLURM's form, e.g. node[01-03,7].")
    prefix, body, rest = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    numbers: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise ValueError(f"Invalid {variable}: cannot read range {item!r} in host pattern {pattern!r}. "
                             "Use numbers or lo-hi ranges, e.g. node[01-03,7].")
        lo_text, hi_text = match.group(1), match.group(2) or match.group(1)
        if int(hi_text) < int(lo_text):
            raise ValueError(f"Invalid {variable}: range {item!r} in {pattern!r} runs backwards. "
                             "Write ranges as lo-hi.")
        width = len(lo_text)
        numbers.extend(str(n).zfill(width) for n in range(int(lo_text), int(hi_text) + 1))
    return [prefix + n + tail for n in numbers for tail in _expand_pattern(rest, variable)]


def expand_hostlist(hostlist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a SLURM host list into host names, in order.

    Args:
        hostlist: e.g. ``"node[01-03,7],gpu5"``.
        variable: the environment variable it came from, for error messages.

    Returns:
        The host names, e.g. ``["node01", "node02", "node03", "node7", "gpu5"]``.

    Raises:
        ValueError: the list is empty or a bracket group cannot be read.

    Example:
        >>> expand_hostlist("node[01-03,7],gpu5")
        ['node01', 'node02', 'node03', 'node7', 'gpu5']
    """
    hosts = [host for part in _split_top_level(hostlist) for host in _expand_pattern(part, variable)]
    if not hosts:
        raise ValueError(f"Invalid {variable}: received {hostlist!r}, which names no host. "
                         "Run inside a SLURM allocation or set MESHFIT_MASTER_ADDR.")
    return hosts
