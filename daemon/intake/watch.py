"""What the daemon remembers about the inbox from one scan to the next: settling and reported folders.

**Settling without trusting modification times.** A file may still be being copied when a scan sees
it. Comparing its modification time with the clock fails on devices with wrong clocks (no real-time
clock, media written by another device): a time in the future would never look old enough. Instead,
a file is *settled* once its size and modification time stayed the same across scans at least
``settle_seconds`` apart by the daemon's own clock, whatever either time says. ``settle_seconds: 0``
means at once. A scan forgets files it no longer sees, so the memory is bounded by the inbox. The
memory lives in the process: after a restart each file waits ``settle_seconds`` once more, which
costs a delay, never a torn file. A clock that goes backwards restarts the wait.

**Problems reported once.** A folder that cannot be listed (permissions, an I/O error) is reported
when it is first met and not again while it stays so; once it can be listed again, a later failure is
reported anew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Signature = tuple[int, int]  # size, modification time (ns)


@dataclass
class InboxWatch:
    """State kept across scans by one daemon process (see the module docstring)."""

    _seen: dict[tuple[str, ...], tuple[Signature, float]] = field(default_factory=dict)
    _current: set[tuple[str, ...]] = field(default_factory=set)
    _problems: dict[str, str] = field(default_factory=dict)
    scans: int = 0

    def settled(self, key: tuple[str, ...], signature: Signature, now: float, settle_seconds: float) -> bool:
        """Whether the file ``key`` (its path components) has settled; records this observation."""
        self._current.add(key)
        if settle_seconds <= 0:
            return True
        before = self._seen.get(key)
        if before is None or before[0] != signature or now < before[1]:
            self._seen[key] = (signature, now)
            return False
        return now - before[1] >= settle_seconds

    def end_scan(self) -> None:
        """Forget files this scan did not see (ingested, removed, renamed)."""
        self._seen = {k: v for k, v in self._seen.items() if k in self._current}
        self._current = set()
        self.scans += 1

    def problems(self, found: dict[str, str]) -> tuple[dict[str, str], list[str]]:
        """Of ``found`` (folder -> reason) this scan: those not reported before, and the folders
        reported before that are fine now (reported again should they fail again)."""
        new = {k: v for k, v in found.items() if self._problems.get(k) != v}
        cleared = [k for k in self._problems if k not in found]
        self._problems = dict(found)
        return new, cleared
