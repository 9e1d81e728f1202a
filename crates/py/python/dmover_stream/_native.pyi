from os import PathLike
from types import TracebackType
from typing import Any, Optional, Sequence, Type, TypedDict, Union

class DestinationReport(TypedDict):
    addr: str
    blocks: int
    bytes: int

class Report(TypedDict):
    steps: int
    bytes: int
    blocks: int
    spilled_blocks: int
    spilled_bytes: int
    resent_blocks: int
    failovers: int
    undelivered_blocks: int
    damaged_blocks: int
    split_steps: list[int]
    complete_at: dict[int, list[str]]
    max_streams: int
    seconds: float
    manifest: Optional[str]
    destinations: list[DestinationReport]

class Stream:
    """A stream of a running simulation's steps to dmover sinks."""

    def __init__(
        self,
        producer: str,
        destinations: Sequence[str],
        spill_dir: Union[str, PathLike[str]],
        *,
        token: Optional[str] = None,
        buffer: int = 80 << 20,
        block_size: int = 1 << 20,
        max_wait: float = 0.0,
        max_streams: int = 8,
        close_timeout: Optional[float] = None,
        ack_timeout: Optional[float] = None,
        replicas: Optional[int] = None,
        keep_manifest: Optional[bool] = None,
    ) -> None:
        """Opens the stream. close_timeout and ack_timeout are seconds (default
        DMOVER_CLOSE_TIMEOUT and DMOVER_ACK_TIMEOUT if set, else 600 and 90);
        replicas is how many sinks each step goes to, whole (default
        DMOVER_REPLICAS if set, else 1); keep_manifest keeps the producer's
        manifest after a close that delivered everything (default
        DMOVER_KEEP_MANIFEST=1 if set, else removed then)."""
    @property
    def step(self) -> int:
        """The step being written (0 first)."""
    def write(self, data: Any) -> None:
        """Copies the bytes of a C-contiguous buffer (numpy array, bytes, ...) into the stream."""
    def write_metadata(self, key: str, value: Any) -> None:
        """Attaches key=str(value) to the current step."""
    def end_step(self) -> None:
        """Ends the current time step."""
    def close(self) -> Report:
        """Sends everything left, returns the report; the manifest is kept (its
        path in report["manifest"]) only if something is left to drain or
        keep_manifest was asked for."""
    def __enter__(self) -> "Stream": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
