"""Data sets: trees of files with incompressible (random) content.

Files have one size, or (sigma > 0) deterministic lognormal sizes around a
mean, scaled so that the total is exactly files × mean, or (max_size > 0)
deterministic log-uniform sizes from file_size to max_size (the spread of
an HSM session: as many files of each order of magnitude). Spread sizes are
drawn from a generator seeded with the data set's name.

A data set lives in SCRATCH/data/NAME/src and is generated once. A marker
file next to it records the spec; the set is reused when the marker matches
and every file has the right size, and regenerated otherwise. Its files'
permissions vary (MODES), so that a copy which does not keep them shows it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import shutil
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .system import BenchError

CHUNK = 4 << 20
# The permissions of the i-th file of a data set: MODES[i % len(MODES)]. With
# the usual umask (022) a copy that creates its files afresh gets 0644 for
# all of them.
MODES = (0o644, 0o600, 0o640, 0o755, 0o664)


def human_size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _unit(n: int) -> str:
    size = human_size(n)
    return f"{size[:-1]} {size[-1]}iB" if size[-1] in "KMG" else f"{size} B"


@dataclass(frozen=True)
class Dataset:
    files: int
    file_size: int         # the size of every file, or the mean with sigma > 0
    dirs: int = 0          # 0: all files directly in src/
    sigma: float = 0.0     # > 0: lognormal sizes with this shape parameter
    max_size: int = 0      # > 0: log-uniform sizes from file_size to this

    @property
    def name(self) -> str:
        layout = f"-{self.dirs}d" if self.dirs else ""
        spread = f"-ln{self.sigma:g}" if self.sigma else ""
        if self.max_size:
            spread = f"-to{human_size(self.max_size)}-logu"
        return f"{self.files}x{human_size(self.file_size)}{layout}{spread}"

    @functools.cached_property
    def sizes(self) -> list[int]:
        if self.max_size:
            rng = random.Random(self.name)
            lo, hi = math.log(self.file_size), math.log(self.max_size)
            return [round(math.exp(rng.uniform(lo, hi))) for _ in range(self.files)]
        if not self.sigma:
            return [self.file_size] * self.files
        rng = random.Random(self.name)
        mu = math.log(self.file_size) - self.sigma ** 2 / 2
        raw = [rng.lognormvariate(mu, self.sigma) for _ in range(self.files)]
        scale = self.file_size * self.files / sum(raw)
        sizes = [max(1, round(x * scale)) for x in raw]
        sizes[0] += self.file_size * self.files - sum(sizes)
        return sizes

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def describe(self) -> str:
        where = f" in {self.dirs} directories" if self.dirs else ""
        if self.max_size:
            return (f"{self.files:,} files{where}, log-uniform sizes from {self.file_size / 1e3:,.0f} KB "
                    f"to {self.max_size / 1e6:,.0f} MB ({min(self.sizes):,} B to "
                    f"{max(self.sizes):,} B, {self.total_bytes / 1e6:,.0f} MB in all), random content")
        if self.sigma:
            size = (f"lognormal sizes (σ = {self.sigma:g}) with a mean of "
                    f"{_unit(self.file_size)}, {min(self.sizes):,} B to "
                    f"{max(self.sizes) / 2**20:.1f} MiB")
            return f"{self.files:,} files{where}, {size}, random content"
        return f"{self.files:,} × {_unit(self.file_size)}{where}, random content"

    def relpaths(self) -> list[str]:
        if not self.dirs:
            return [f"file-{i:05d}.bin" for i in range(self.files)]
        return [f"d{i % self.dirs:02d}/f{i:05d}.bin" for i in range(self.files)]

    # -- on-disk location ----------------------------------------------------

    def root(self, scratch: Path) -> Path:
        return scratch / "data" / self.name

    def src(self, scratch: Path) -> Path:
        return self.root(scratch) / "src"

    def _marker(self, scratch: Path) -> Path:
        return self.root(scratch) / "spec.json"

    def _spec(self) -> dict:
        spec = asdict(self)
        if not self.sigma:
            del spec["sigma"]     # as written before sizes could vary
        if not self.max_size:
            del spec["max_size"]
        return spec

    # -- generation ----------------------------------------------------------

    def is_present(self, scratch: Path) -> bool:
        try:
            if json.loads(self._marker(scratch).read_text()) != self._spec():
                return False
        except (OSError, ValueError):
            return False
        src = self.src(scratch)
        try:
            return all((src / p).stat().st_size == n for p, n in zip(self.relpaths(), self.sizes))
        except OSError:
            return False

    def ensure(self, scratch: Path) -> Path:
        """Generate the data set unless an identical one is already there,
        and give its files their permissions (MODES)."""
        if self.is_present(scratch):
            self._set_modes(self.src(scratch))
            return self.src(scratch)
        root = self.root(scratch)
        print(f"  generating data set {self.name} ({self.total_bytes / 2**20:,.0f} MiB) "
              f"in {root}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        tmp = root / "src.tmp"
        tmp.mkdir(parents=True)
        for rel, size in zip(self.relpaths(), self.sizes):
            _write_random(tmp / rel, size)
        self._set_modes(tmp)
        tmp.rename(self.src(scratch))
        os.sync()
        self._marker(scratch).write_text(json.dumps(self._spec()))
        return self.src(scratch)


    def _set_modes(self, src: Path) -> None:
        for i, rel in enumerate(self.relpaths()):
            (src / rel).chmod(MODES[i % len(MODES)])


def _write_random(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, CHUNK)
            f.write(os.urandom(n))
            left -= n


# --------------------------------------------------------------------------
# checking a copy
# --------------------------------------------------------------------------

# What a copy can be asked to keep besides the content.
ATTRIBUTES = ("mode", "mtime")
# Examples of each kind of difference quoted in an error.
EXAMPLES = 3
# SHA-256 of source files, by path, with the (size, mtime, ctime, inode) they
# had: a data set is hashed once per harness invocation, not after every run.
_source_digests: dict[Path, tuple[tuple[int, int, int, int], bytes]] = {}


def _digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def _source_digest(path: Path, st: os.stat_result) -> bytes:
    key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    cached = _source_digests.get(path)
    if cached is None or cached[0] != key:
        cached = (key, _digest(path))
        _source_digests[path] = cached
    return cached[1]


def _mtime(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}"


def verify_copy(ds: Dataset, src: Path, dst: Path, preserves: tuple[str, ...] = ()) -> float:
    """Check that dst holds exactly ds's files with the right sizes, that
    every file's content is the source's (SHA-256), and for the ATTRIBUTES in
    `preserves` (what the tool was asked to keep) that every file's
    permission bits and modification time (to the nanosecond) are the
    source's. Raises BenchError listing every kind of difference with
    examples; returns the seconds the check took."""
    t0 = time.monotonic()
    sizes = dict(zip(ds.relpaths(), ds.sizes))
    expected = set(sizes)
    expected_dirs = {str(Path(p).parent) for p in expected} - {"."}
    found: dict[str, os.stat_result] = {}
    extra = []
    for dirpath, dirnames, filenames in os.walk(dst):
        here = Path(dirpath)
        for name in filenames:
            found[str((here / name).relative_to(dst))] = (here / name).lstat()
        for name in dirnames:
            rel = str((here / name).relative_to(dst))
            if rel not in expected_dirs:
                extra.append(rel + "/")
    extra += sorted(set(found) - expected)
    missing = sorted(expected - set(found))
    differ: dict[str, list[str]] = {"size": [], "type": [], "content": [], "mode": [],
                                    "mtime": []}
    for rel in sorted(expected & set(found)):
        got = found[rel]
        if not stat.S_ISREG(got.st_mode):
            differ["type"].append(f"{rel} (not a regular file)")
            continue
        if got.st_size != sizes[rel]:
            differ["size"].append(f"{rel} ({got.st_size} B, source {sizes[rel]} B)")
            continue
        want = (src / rel).stat()
        if _digest(dst / rel) != _source_digest(src / rel, want):
            differ["content"].append(rel)
        if "mode" in preserves and stat.S_IMODE(got.st_mode) != stat.S_IMODE(want.st_mode):
            differ["mode"].append(f"{rel} ({stat.S_IMODE(got.st_mode):04o}, source "
                                  f"{stat.S_IMODE(want.st_mode):04o})")
        if "mtime" in preserves and got.st_mtime_ns != want.st_mtime_ns:
            differ["mtime"].append(f"{rel} ({_mtime(got.st_mtime_ns)}, source "
                                   f"{_mtime(want.st_mtime_ns)})")
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(missing[:EXAMPLES])})")
    if extra:
        problems.append(f"{len(extra)} unexpected entries (e.g. {', '.join(extra[:EXAMPLES])})")
    what = {"size": "the wrong size", "type": "the wrong type", "content": "other content",
            "mode": "other permissions", "mtime": "another modification time"}
    for kind, rels in differ.items():
        if rels:
            problems.append(f"{len(rels)} with {what[kind]} (e.g. {'; '.join(rels[:EXAMPLES])})")
    if problems:
        checked = ", ".join(("content",) + tuple(a for a in ATTRIBUTES if a in preserves))
        raise BenchError(f"destination {dst} does not match the source {src} (checked every "
                         f"file's {checked}): " + "; ".join(problems))
    return time.monotonic() - t0
