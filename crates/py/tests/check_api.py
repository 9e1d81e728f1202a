"""Checks the Python API against a real sink: buffer-protocol objects of
every kind arrive byte for byte, non-contiguous arrays are refused, the
context manager closes, and errors are the documented exception types.

    python3 check_api.py SINK SPILL_DIR SINK_DIR
"""

import array
import json
import os
import sys

import numpy as np

from dmover_stream import Stream

sink, spill, sink_dir = sys.argv[1:4]

a = np.arange(100_000, dtype=np.float32).reshape(100, 1000)
pieces = [b"bytes!", bytearray(b"bytearray"), memoryview(b"view"), array.array("i", [1, 2, 3]), a, a[10:20]]
with Stream("api", [sink], spill, block_size=64 * 1024, buffer=1 << 20) as s:
    assert s.step == 0
    for p in pieces:
        s.write(p)
    s.write_metadata("shape", a.shape)
    try:
        s.write(a[:, ::2])
        raise AssertionError("a non-contiguous array was accepted")
    except ValueError as e:
        assert "contiguous" in str(e), e
    s.end_step()
    assert s.step == 1
# Leaving the with block closed the stream.
for call in (lambda: s.write(b"x"), s.close, s.end_step):
    try:
        call()
        raise AssertionError("a closed stream was usable")
    except ValueError:
        pass

want = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
got = open(os.path.join(sink_dir, "api", "step-000000.dat"), "rb").read()
assert got == want, (len(got), len(want))
m = json.load(open(os.path.join(sink_dir, "api", "step-000000.json")))
assert m["metadata"]["shape"] == "(100, 1000)", m["metadata"]
assert [r["len"] for r in m["records"]] == [len(bytes(memoryview(p).cast("B"))) for p in pieces]

for bad, exc in [(dict(producer="../x"), ValueError), (dict(token="wrong-token-wrong-token"), PermissionError)]:
    args = dict(producer="api2", token=None) | bad
    try:
        Stream(args["producer"], [sink], spill, token=args["token"])
        raise AssertionError(f"{bad} was accepted")
    except exc:
        pass
print("ok")
