"""nvidia-smi's log of the SM clock, power and the clock-event reasons while a script times kernels, and what it
logged in a timing's windows. A slow figure under a lower SM clock points at the clock (the power cap, reason
0x4, took an H200's SM clock to 1.5 GHz: BENCHMARKS.md's seventh run); one under the same clock does not.

    with clock_log(path) as log:            # None where there is no nvidia-smi: nothing is logged
        t0 = time.time(); ...; t1 = time.time()
    print(summary(logged(log, [(t0, t1)])))
"""

from __future__ import annotations

import contextlib
import csv
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


@contextlib.contextmanager
def clock_log(path: str | None = None, period_ms: int = 200) -> Iterator[str | None]:
    """nvidia-smi's QUERY every `period_ms` into `path` (a temporary file when None) while the block runs; yields
    the path, or None where nvidia-smi is not on the PATH (nothing is logged)."""
    if shutil.which("nvidia-smi") is None:
        yield None
        return
    if path is None:
        path = tempfile.NamedTemporaryFile(prefix="clocks-", suffix=".csv", delete=False).name
    with open(path, "w") as out:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv", "-lms", str(period_ms)],
                               stdout=out, stderr=subprocess.DEVNULL)
        time.sleep(1.0)    # its first rows before the first timing
        try:
            yield path
        finally:
            time.sleep(0.5)
            smi.terminate()
            smi.wait()


def logged(path: str | None, windows: list[tuple[float, float]]) -> list[dict]:
    """The rows of the log at `path` whose timestamp lies in any of `windows` ([t0, t1], seconds since the epoch,
    local time as nvidia-smi writes it); none for no log."""
    if path is None:
        return []
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f, skipinitialspace=True):
            stamp = r.get("timestamp") or ""
            whole, _, frac = stamp.partition(".")
            try:
                t = time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + (float("0." + frac) if frac else 0.0)
            except ValueError:
                continue
            if any(t0 <= t <= t1 for t0, t1 in windows):
                rows.append(r)
    return rows


def summary(rows: list[dict]) -> str:
    """The range of each logged quantity over `rows` (the header's names differ between drivers, so a column is
    found by a part of its name), and the reasons seen."""
    if not rows:
        return "no clock samples"

    def column(part: str) -> str | None:
        return next((key for key in rows[0] if part in key), None)

    def span(part: str) -> str:
        key = column(part)
        vals = [float(v.split()[0]) for v in (r[key] for r in rows if key) if v.split() and v.split()[0][0].isdigit()]
        return f"{min(vals):.0f}-{max(vals):.0f}" if vals else "?"
    reasons = column("reasons")
    return (f"sm {span('sm')} MHz, mem {span('mem')} MHz, {span('power')} W, {span('temperature')} C, "
            f"reasons {','.join(sorted({r[reasons] for r in rows})) if reasons else '?'} ({len(rows)} samples)")
