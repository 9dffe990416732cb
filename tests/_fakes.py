"""Test doubles shared by the CPU tests (no GPU here)."""

from __future__ import annotations

import numpy as np


class FakeDeviceArray:
    """A stand-in for a CuPy array: `formats.on_device` takes it for one (its class's module starts
    with "cupy"), it has the attributes and methods a CuPy array has that the host code may call
    (shape, dtype, nbytes, size, ndim, flags, view, reshape, indexing, reductions, operators), and
    it refuses to become a numpy array, as CuPy does. `host_scalars` counts the scalars read back."""

    host_scalars = 0

    def __init__(self, a):
        self._a = np.asarray(a)

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    nbytes = property(lambda self: self._a.nbytes)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    flags = property(lambda self: self._a.flags)

    def view(self, dtype):
        return FakeDeviceArray(self._a.view(dtype))

    def reshape(self, *shape):
        return FakeDeviceArray(self._a.reshape(*shape))

    def __getitem__(self, idx):
        return FakeDeviceArray(self._a[idx])

    def __len__(self):
        return len(self._a)

    def max(self):
        return FakeDeviceArray(self._a.max())

    def sum(self):
        return FakeDeviceArray(self._a.sum())

    def any(self):
        return FakeDeviceArray(self._a.any())

    def argmax(self):
        return FakeDeviceArray(self._a.argmax())

    def __int__(self):
        assert self._a.ndim == 0, "only scalars come back to the host"
        FakeDeviceArray.host_scalars += 1
        return int(self._a)

    def __bool__(self):
        return bool(int(self))

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed (a device array)")

    def get(self):
        raise AssertionError("a device array was copied to the host")

    def _op(name):  # noqa: N805 (a class-body helper)
        def op(self, other):
            other = other._a if isinstance(other, FakeDeviceArray) else other
            return FakeDeviceArray(getattr(self._a, name)(other))

        return op

    __and__, __or__, __sub__, __add__ = _op("__and__"), _op("__or__"), _op("__sub__"), _op("__add__")
    __eq__, __ne__, __ge__, __gt__, __le__, __lt__ = (_op("__eq__"), _op("__ne__"), _op("__ge__"), _op("__gt__"),
                                                      _op("__le__"), _op("__lt__"))
    __hash__ = None
    del _op


FakeDeviceArray.__module__ = "cupy._fake"
