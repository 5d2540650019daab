"""tools/soak/served.py's memory side: resident set sizes read from /proc, their growth over a window,
the verdict, the printed table and the saved samples.

Growth compares the median of a window's first tenth of samples with the median of its last
tenth: one sample can catch the transient buffers of the requests in flight, a leak moves the
whole tail.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

FLAT_PERCENT = 1.0  # growth below this over the verdict window reads "flat"
MB = 1e6


def parse_vm_rss(status: str) -> int:
    """Bytes resident, from the text of /proc/PID/status (its `VmRSS:  N kB` line)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"VmRSS in {unit!r}, not kB")
            return int(value) * 1024
    raise ValueError("no VmRSS line (a zombie or a kernel thread has none)")


def rss_bytes(pid: int) -> int:
    """Process `pid`'s resident bytes; ProcessLookupError once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return parse_vm_rss(f.read())
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} is gone") from None
    except ValueError:
        raise ProcessLookupError(f"process {pid} has exited") from None


@dataclass(slots=True, frozen=True)
class Sample:
    """The processes' resident bytes (in the run's process order) at `elapsed_s` into the run."""

    elapsed_s: float
    requests_done: int
    rss_bytes: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class Growth:
    """One process's resident size at the start and the end of a window."""

    start_bytes: float
    end_bytes: float
    num_samples: int

    @property
    def mb(self) -> float:
        return (self.end_bytes - self.start_bytes) / MB

    @property
    def percent(self) -> float:
        return 100.0 * (self.end_bytes - self.start_bytes) / self.start_bytes

    def describe(self) -> str:
        return (f"{self.start_bytes / MB:,.1f} -> {self.end_bytes / MB:,.1f} MB: {self.mb:+,.1f} MB "
                f"({self.percent:+.2f}%) over {self.num_samples} samples")


def growth(samples: Sequence[Sample], process: int, since_s: float) -> Growth | None:
    """Process number `process`'s growth over the samples from `since_s` on; None below 2 samples."""
    window = [s.rss_bytes[process] for s in samples if s.elapsed_s >= since_s]
    if len(window) < 2:
        return None
    edge = max(1, len(window) // 10)
    return Growth(statistics.median(window[:edge]), statistics.median(window[-edge:]), len(window))


def verdict(names: Sequence[str], growths: Sequence[Growth | None], window: str) -> str:
    """"flat" when every process grew less than FLAT_PERCENT over the window."""
    if any(g is None for g in growths):
        return f"no verdict: too few samples in {window}"
    grown = [f"{name} {g.percent:+.2f}%" for name, g in zip(names, growths) if g.percent >= FLAT_PERCENT]
    if grown:
        return f"growing: {', '.join(grown)} over {window} (flat is < {FLAT_PERCENT:g}%)"
    return f"flat: every process grew < {FLAT_PERCENT:g}% over {window}"


def rss_table(names: Sequence[str], samples: Sequence[Sample], warmup_s: float, rows: int = 13) -> str:
    """About `rows` samples evenly spaced over the run, the first and the last among them."""
    if not samples:
        return "(no samples)"
    step = max(1, round((len(samples) - 1) / (rows - 1))) if rows > 1 else len(samples)
    picked = list(samples[::step])
    if picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    header = "".join(f"{name + ' MB':>14}" for name in names)
    lines = [f"{'time':>8}  {'phase':<8}{header}{'requests':>10}"]
    for s in picked:
        phase = "warm-up" if s.elapsed_s < warmup_s else "measured"
        sizes = "".join(f"{rss / MB:>14,.1f}" for rss in s.rss_bytes)
        lines.append(f"{s.elapsed_s / 60:>6.2f} m  {phase:<8}{sizes}{s.requests_done:>10,}")
    return "\n".join(lines)


def write_samples(path: Path, names: Sequence[str], samples: Sequence[Sample], summary: dict) -> None:
    """`.csv`: one row per sample; anything else: JSON with the summary and the samples."""
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["elapsed_s", "requests_done", *(f"{n}_rss_bytes" for n in names)])
            writer.writerows([round(s.elapsed_s, 3), s.requests_done, *s.rss_bytes] for s in samples)
        return
    document = {"summary": summary, "processes": list(names), "samples": [asdict(s) for s in samples]}
    path.write_text(json.dumps(document, indent=1))


def draw(path: Path, names: Sequence[str], samples: Sequence[Sample], warmup_s: float) -> None:
    """Each process's RSS over time, the warm-up shaded (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(names), 1, figsize=(9, 2.6 * len(names)), sharex=True, squeeze=False)
    minutes = [s.elapsed_s / 60 for s in samples]
    for index, (name, ax) in enumerate(zip(names, axes[:, 0])):
        ax.plot(minutes, [s.rss_bytes[index] / MB for s in samples])
        ax.axvspan(0, warmup_s / 60, color="0.9", label="warm-up")
        ax.set_ylabel(f"{name} RSS (MB)")
        ax.legend(loc="lower right")
    axes[-1, 0].set_xlabel("minutes")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
