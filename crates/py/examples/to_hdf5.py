"""A `dmover sink --hook`: converts a complete step to HDF5.

    dmover sink --dir DIR --hook 'python3 to_hdf5.py' ...

For the manifest it is given (DIR/PRODUCER/step-NNNNNN.json), it writes
step-NNNNNN.h5 beside it, with one dataset per write of the step. The
producer describes its writes with metadata, one entry per write separated
by ';' (a single entry applies to every write):

    var    dataset names                    "phi;density"   (default: data0, data1, ...)
    dims   shape of each, comma-separated    "64,64;128"     (default: one dimension)
    dtype  numpy type of each                "<f8;<f4"       (default: <f8)

Every metadata pair also becomes an attribute of the file, then the
producer and the step (an integer) do, so that a producer's own `step`
metadata does not replace the step number. The file appears under its final name only when
complete (written as .NAME.tmp, then renamed).
"""

import json
import os
import sys

import h5py
import numpy as np


def per_write(meta: dict, key: str, n: int, default):
    """The metadata entry `key` split into one value per write."""
    if key not in meta:
        return [default(i) for i in range(n)]
    parts = meta[key].split(";")
    if len(parts) == 1:
        parts = parts * n
    if len(parts) != n:
        sys.exit(f"to_hdf5: metadata {key!r} has {len(parts)} entries for {n} writes")
    return parts


def main() -> None:
    manifest_path = sys.argv[1]
    with open(manifest_path) as f:
        m = json.load(f)
    if not m["complete"]:
        sys.exit(f"to_hdf5: step {m['step']} is not complete here")
    records, meta = m["records"], m["metadata"]
    n = len(records)
    names = per_write(meta, "var", n, lambda i: f"data{i}")
    dtypes = [np.dtype(t) for t in per_write(meta, "dtype", n, lambda i: "<f8")]
    dims = per_write(meta, "dims", n, lambda i: None)
    if len(set(names)) != n:
        names = [f"{name}_{i}" for i, name in enumerate(names)]
    out = os.path.join(os.path.dirname(manifest_path), f"step-{m['step']:06d}.h5")
    tmp = os.path.join(os.path.dirname(out), "." + os.path.basename(out) + ".tmp")
    raw = np.memmap(m["data"], dtype=np.uint8, mode="r") if m["bytes"] else np.zeros(0, np.uint8)
    with h5py.File(tmp, "w") as h:
        for k, v in meta.items():
            h.attrs[k] = v
        h.attrs["producer"] = m["producer"]
        h.attrs["step"] = m["step"]
        for r, name, dtype, shape in zip(records, names, dtypes, dims):
            a = raw[r["offset"]: r["offset"] + r["len"]].view(dtype)
            if shape is not None:
                a = a.reshape([int(d) for d in shape.split(",")])
            h.create_dataset(name, data=a)
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
