"""A stand-in for the GTC simulation streaming with dmover_stream: STEPS
time steps, each "computing" for COMPUTE_MS and producing one numpy array
phi of N doubles, phi[i] = step * 1000003 + i (as gtc.c does).

    python3 gtc.py PRODUCER SINKS SPILL_DIR STEPS N COMPUTE_MS

SINKS is "host:port[,host:port...]"; the token is in DMOVER_TOKEN or the
file DMOVER_TOKEN_FILE names. Prints one line with the report.
"""

import sys
import time

import numpy as np

from dmover_stream import Stream


def main() -> None:
    producer, sinks, spill = sys.argv[1:4]
    steps, n, compute_ms = (int(a) for a in sys.argv[4:7])
    with Stream(producer, sinks.split(","), spill) as s:
        for step in range(steps):
            t0 = time.monotonic()
            phi = np.arange(step * 1000003, step * 1000003 + n, dtype=np.float64)
            time.sleep(max(0.0, compute_ms / 1000 - (time.monotonic() - t0)))
            s.write_metadata("var", "phi")
            s.write_metadata("dims", n)
            s.write_metadata("step", step)
            s.write(phi)
            s.end_step()
        report = s.close()
    print(" ".join(f"{k}={report[k]}" for k in ("steps", "bytes", "spilled_blocks", "failovers")),
          f"undelivered={report['undelivered_blocks']}")


if __name__ == "__main__":
    main()
