"""Type stubs of the Rust extension `stoker._native` (use the `stoker` package API instead)."""

from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ._errors import (
    AccessDenied as AccessDenied,
    DaemonUnavailable as DaemonUnavailable,
    DatasetError as DatasetError,
    LimitError as LimitError,
    ProtocolError as ProtocolError,
    StokerError as StokerError,
    Timeout as Timeout,
)

DEFAULT_SOCKET: str
SOCKET_ENV: str
__version__: str
#: The transform step names, from the daemon's definition (`stoker_proto::TransformDef`).
TRANSFORM_STEPS: List[str]
#: The wire protocol version this client speaks (`stoker_proto::PROTOCOL_VERSION`).
PROTOCOL_VERSION: int

def check_hdf5(definition: str) -> str:
    """Checks an HDF5 dataset description (JSON of ``stoker_proto::Hdf5Dataset``) with the daemon's own check;
    returns it in canonical form or raises ValueError naming the problem."""

def parse_steps(steps: str) -> str:
    """Checks a JSON list of transform steps (any accepted form); returns it in the daemon's form or raises
    ValueError."""


class Lease:
    """Base object of a batch's arrays; the slot is released when it is collected."""

    @property
    def epoch(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def slot(self) -> int: ...

class NativeStream:
    def __init__(
        self,
        socket: str,
        dataset: Tuple[Any, ...],
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        epoch: int,
        step: int,
        timeout: Optional[float] = None,
        block: Optional[Tuple[int, int]] = None,
    ) -> None: ...
    def info(self) -> Dict[str, Any]: ...
    def mapping_range(self) -> Tuple[int, int]: ...
    def shared_range(self) -> Tuple[int, int]: ...
    def set_epoch(self, epoch: int, step: int, timeout: Optional[float] = None) -> None: ...
    def position(self) -> Tuple[int, int]: ...
    def next(self, timeout: Optional[float] = None) -> Optional[Dict[str, Union[np.ndarray, List[np.ndarray]]]]: ...
    def close(self) -> None: ...
