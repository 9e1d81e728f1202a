"""Stream a running simulation's output to dmover sinks.

    import numpy as np
    from dmover_stream import Stream

    with Stream("gtc-17", ["ana1:7460", "ana2:7460"], "/scratch/me/spill") as s:
        for step in range(steps):
            phi = compute(step)
            s.write_metadata("var", "phi")
            s.write_metadata("dims", ",".join(map(str, phi.shape)))
            s.write(phi)          # copied once into the stream's buffer
            s.end_step()
    # leaving the block closes the stream: everything is sent

The token comes from the ``token`` argument, else DMOVER_TOKEN or the file
DMOVER_TOKEN_FILE names. See docs/STREAMING.md.
"""

from ._native import Stream

__all__ = ["Stream"]
