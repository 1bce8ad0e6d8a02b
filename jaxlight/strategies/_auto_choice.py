"""What Auto decided and why: `AutoChoice` (the candidate table Fit prints) and the message when
no layout fits."""

from __future__ import annotations

import dataclasses

from jaxlight.strategies._auto_candidates import Candidate
from jaxlight.strategies._roofline import DeviceSpec


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


@dataclasses.dataclass
class AutoChoice:
    """What Auto decided and why: the candidate table, the budget, the cost of choosing.

    `str(choice)` is the printed table.
    """

    chosen: str
    reason: str
    candidates: list[Candidate]
    budget_bytes: int
    usable_bytes: int
    device: DeviceSpec
    num_devices: int
    compiles: int
    seconds: float

    def to_dict(self) -> dict:
        return {
            "chosen": self.chosen, "reason": self.reason, "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes, "device": dataclasses.asdict(self.device),
            "num_devices": self.num_devices, "compiles": self.compiles,
            "seconds": round(self.seconds, 3),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def table(self) -> str:
        lines = [f"Auto layout over {self.num_devices} {self.device.name} devices, memory budget "
                 f"{fmt_bytes(self.budget_bytes)} per device ({fmt_bytes(self.usable_bytes)} "
                 f"usable); {self.compiles} compiles in {self.seconds:.2f} s",
                 f"{'layout':<26} {'args/device':>12} {'bytes/device':>13} "
                 f"{'collective/step':>16} {'predicted step':>15} {'fits':>5}  status"]
        for c in self.candidates:
            fits = "-" if c.fits is None else ("yes" if c.fits else "no")
            status = c.status + (f": {c.reason}" if c.reason else "")
            lines.append(f"{c.layout:<26} {fmt_bytes(c.argument_bytes):>12} "
                         f"{fmt_bytes(c.bytes_per_device):>13} "
                         f"{fmt_bytes(c.collective_bytes):>16} {fmt_time(c.predicted_s):>15} "
                         f"{fits:>5}  {status}")
        lines.append(f"chose {self.chosen}: {self.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def nothing_fits(cands: list, budget: int, usable: int, headroom: float, num_devices: int) -> str:
    """The error message when no candidate fits: the smallest one's needs, and every status."""
    compiled = [c for c in cands if c.bytes_per_device is not None]
    sized = [c for c in cands if c.argument_bytes is not None]
    if compiled:
        best = min(compiled, key=lambda c: c.bytes_per_device)
        need = (f" The smallest compiled layout, {best.layout}, needs "
                f"{fmt_bytes(best.bytes_per_device)} per device.")
    elif sized:
        best = min(sized, key=lambda c: c.argument_bytes)
        need = (f" The smallest layout, {best.layout}, holds "
                f"{fmt_bytes(best.argument_bytes)} of parameters, optimizer state and "
                "batch per device before any temporary.")
    else:
        need = ""
    return (f"Auto: no layout of the model fits the memory budget of {fmt_bytes(budget)} "
            f"per device ({fmt_bytes(usable)} usable after headroom={headroom}) over "
            f"{num_devices} devices.{need} Use more devices, a smaller batch "
            "(or callbacks.Microbatches), bf16 parameters, or a larger memory_budget.\n"
            + "\n".join(f"  {c.layout}: {c.status}{': ' + c.reason if c.reason else ''}"
                        for c in cands))
