"""Does this device's float32 -> e4m3 cast round every tie of the e4m3 grid to even, as the
CPU's does? (A diagnostic of session 48: prints the ties it rounds otherwise.)

    python tools/fp8_cast_ties.py [--device cuda]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    dev = torch.device(ap.parse_args().device)
    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique().sort().values
    mids = torch.cat([(grid[:-1] + grid[1:]) / 2, -(grid[:-1] + grid[1:]) / 2])
    lo = torch.cat([grid[:-1], -grid[:-1]]).to(torch.float8_e4m3fn).view(torch.uint8)
    hi = torch.cat([grid[1:], -grid[1:]]).to(torch.float8_e4m3fn).view(torch.uint8)
    even = torch.where(lo % 2 == 0, lo, hi)
    got = mids.to(dev).to(torch.float8_e4m3fn).view(torch.uint8).cpu()
    bad = got != even
    print(f"{dev}: {len(mids)} ties, {int(bad.sum())} not rounded to even")
    for m, g, w in zip(mids[bad][:20].tolist(), got[bad][:20].tolist(), even[bad][:20].tolist()):
        print(f"  {m!r}: got code {g}, even is {w}")


if __name__ == "__main__":
    main()
