"""Data sets: trees of files with incompressible (random) content.

Files have one size, or (sigma > 0) deterministic lognormal sizes around a
mean, scaled so that the total is exactly files × mean.

A data set lives in SCRATCH/data/NAME/src and is generated once. A marker
file next to it records the spec; the set is reused when the marker matches
and every file has the right size, and regenerated otherwise.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .system import BenchError

CHUNK = 4 << 20


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

    @property
    def name(self) -> str:
        layout = f"-{self.dirs}d" if self.dirs else ""
        spread = f"-ln{self.sigma:g}" if self.sigma else ""
        return f"{self.files}x{human_size(self.file_size)}{layout}{spread}"

    @functools.cached_property
    def sizes(self) -> list[int]:
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
        """Generate the data set unless an identical one is already there."""
        if self.is_present(scratch):
            return self.src(scratch)
        root = self.root(scratch)
        print(f"  generating data set {self.name} ({self.total_bytes / 2**20:,.0f} MiB) "
              f"in {root}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        tmp = root / "src.tmp"
        tmp.mkdir(parents=True)
        for rel, size in zip(self.relpaths(), self.sizes):
            _write_random(tmp / rel, size)
        tmp.rename(self.src(scratch))
        os.sync()
        self._marker(scratch).write_text(json.dumps(self._spec()))
        return self.src(scratch)


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

SAMPLE_FILES = 8
SAMPLE_BYTES = 1 << 20


def verify_copy(ds: Dataset, src: Path, dst: Path) -> None:
    """Check that dst holds exactly ds's files with the right sizes, and
    compare the content of a sample (whole small files; the first, middle and
    last MiB of large ones). Raises BenchError on any difference."""
    sizes = dict(zip(ds.relpaths(), ds.sizes))
    expected = set(sizes)
    expected_dirs = {str(Path(p).parent) for p in expected} - {"."}
    found: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(dst):
        here = Path(dirpath)
        for name in filenames:
            found[str((here / name).relative_to(dst))] = (here / name).lstat().st_size
        for name in dirnames:
            rel = str((here / name).relative_to(dst))
            if rel not in expected_dirs:
                found[rel + "/"] = -1
    extra = sorted(set(found) - expected)
    missing = sorted(expected - set(found))
    wrong = sorted(p for p in expected & set(found) if found[p] != sizes[p])
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} unexpected entries (e.g. {extra[:3]})")
    if wrong:
        problems.append(f"{len(wrong)} with the wrong size (e.g. {wrong[0]}: {found[wrong[0]]})")
    if not problems:
        rng = random.Random(len(found))
        for rel in rng.sample(sorted(expected), min(SAMPLE_FILES, len(expected))):
            if not _same_sample(src / rel, dst / rel, sizes[rel]):
                problems.append(f"content differs: {rel}")
                break
    if problems:
        raise BenchError(f"destination {dst} does not match the source: " + "; ".join(problems))


def _same_sample(a: Path, b: Path, size: int) -> bool:
    if size <= 3 * SAMPLE_BYTES:
        return a.read_bytes() == b.read_bytes()
    offsets = (0, (size // 2) - SAMPLE_BYTES // 2, size - SAMPLE_BYTES)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for off in offsets:
            fa.seek(off)
            fb.seek(off)
            if fa.read(SAMPLE_BYTES) != fb.read(SAMPLE_BYTES):
                return False
    return True
