"""Exception classes of stoker: each is a :class:`StokerError` and also the builtin it behaves like.

They are defined here, in Python, because a class with two bases cannot be
made by pyo3's ``create_exception!``; the extension (``stoker._native``) looks
them up once and raises them. ``except TimeoutError`` or ``except OSError``
in existing training code therefore catches stoker's errors too, and
``except stoker.StokerError`` catches all of them.

Every class takes one message argument, keeps it in ``args`` and pickles (so
it crosses ``multiprocessing`` and ``torch.multiprocessing`` boundaries).
"""

from __future__ import annotations

__all__ = [
    "StokerError",
    "DaemonUnavailable",
    "DatasetError",
    "ProtocolError",
    "LimitError",
    "AccessDenied",
    "Timeout",
    "DeviceUnavailable",
]


class StokerError(Exception):
    """Base class of every stoker error."""


class DaemonUnavailable(StokerError, ConnectionError):
    """No stoker daemon answers at the socket, or it went away (a :class:`ConnectionError`)."""


class DatasetError(StokerError, OSError):
    """The dataset cannot be opened or a sample cannot be read (an :class:`OSError`).

    An :class:`OSError` because that is what reading a missing, unreadable or
    corrupt file raises elsewhere in Python (``open``, ``h5py.File``,
    ``numpy.load``, ``PIL.Image.open``), so code that already guards its I/O
    with ``except OSError`` keeps working when the reads move into the daemon.
    ``errno`` and ``filename`` are ``None``: the message names the file, field,
    key and index.
    """


class ProtocolError(StokerError, RuntimeError):
    """Client and daemon disagree (versions, messages, state) (a :class:`RuntimeError`)."""


class LimitError(StokerError, MemoryError):
    """A configured memory limit of the daemon would be exceeded (a :class:`MemoryError`).

    Raised when this process holds every batch its ring budget allows, or a
    stream would need more shared memory than the daemon grants. Both are what
    :class:`MemoryError` means in Python: release some objects (``del`` batches
    you keep, copy what you hold on to) or ask for less (a smaller
    ``batch_size``), and retry; nothing about the arguments' *type or value* is
    wrong in itself, which is what :class:`ValueError` would say.
    """


class AccessDenied(StokerError, PermissionError):
    """The daemon does not serve this user or path (a :class:`PermissionError`)."""


class Timeout(StokerError, TimeoutError):
    """The daemon did not answer within the Loader's ``timeout`` (a :class:`TimeoutError`)."""


class DeviceUnavailable(StokerError, RuntimeError):
    """``device="cuda..."`` cannot be served here (a :class:`RuntimeError`): no CUDA build of torch,
    no driver, no such GPU.

    A :class:`RuntimeError`, as torch's own "Found no NVIDIA driver" is: the
    argument is a valid device name, the machine lacks what it names. Raised
    by the :class:`Loader` constructor, before anything is opened.
    """


# Tracebacks and reprs say `stoker.Timeout`, the name users import; pickle
# finds the classes there too (the package re-exports them).
for _cls in (StokerError, DaemonUnavailable, DatasetError, ProtocolError, LimitError, AccessDenied, Timeout,
             DeviceUnavailable):
    _cls.__module__ = "stoker"
del _cls
