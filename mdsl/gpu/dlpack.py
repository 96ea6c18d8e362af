"""DLPack through ctypes, both ways: read the tensor a capsule describes (so that kernels can run on
other libraries' GPU arrays) and export a tensor as a capsule (so that torch and others can consume an
mdsl DeviceArray). No GPU is involved: the structures only describe memory.

A capsule handed to us is read, never consumed: the producer's object outlives the call that reads
it, and the capsule's own destructor releases the producer's tensor. A tensor we export keeps its
owner alive until the consumer calls the deleter, or until the capsule dies unconsumed.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional, Sequence

# DLDeviceType and DLDataTypeCode values (dlpack.h)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
INT, UINT, FLOAT, BFLOAT = 0, 1, 2, 4

LEGACY, VERSIONED = b"dltensor", b"dltensor_versioned"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


# Our own prototypes of the capsule API, so that ctypes.pythonapi's shared ones are left as they are.
_API = ctypes.pythonapi
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", _API))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", _API))
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _API))
# the destructor runs while the capsule is freed, so it must not make Python references to it: raw pointers
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _API))
_raw_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _API))


class Described(NamedTuple):
    """What a DLPack capsule says about its tensor. Strides are in elements (None: compact row-major)."""

    data: int
    shape: tuple
    strides: Optional[tuple]
    dtype: tuple       # (code, bits, lanes)
    device: tuple      # (device type, device id)


def read(capsule) -> Described:
    """The tensor a (legacy or versioned) DLPack capsule describes; the capsule is not consumed."""
    name = _capsule_name(capsule)
    if name == LEGACY:
        tensor = DLManagedTensor.from_address(_capsule_pointer(capsule, LEGACY)).dl_tensor
    elif name == VERSIONED:
        tensor = DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, VERSIONED)).dl_tensor
    else:
        raise ValueError(f"not an unconsumed DLPack capsule (its name is {name!r})")
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else None
    return Described((tensor.data or 0) + tensor.byte_offset, shape, strides,
                     (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes),
                     (tensor.device.device_type, tensor.device.device_id))


def compact_strides(shape: Sequence[int]) -> tuple:
    """Row-major strides, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def is_compact(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether strides (in any unit, one element = 1) lay the tensor out row-major without gaps;
    the stride of a dim of size 1 does not matter."""
    step = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


# ---------------------------------------------------------------------------------------------
# export

_EXPORTED: dict = {}   # address of a managed tensor -> what must stay alive until its deleter runs


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _deleter(address):
    _EXPORTED.pop(address, None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule):
    # a consumer renames the capsule when it takes the tensor; one still named dltensor was never taken
    for name in (LEGACY, VERSIONED):
        if _raw_is_valid(capsule, name):
            _EXPORTED.pop(_raw_pointer(capsule, name), None)


_DELETER = ctypes.cast(_deleter, ctypes.c_void_p).value
_DESTRUCTOR = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


def export(data: int, shape: Sequence[int], dtype: tuple, device: tuple, owner, *, versioned: bool = False):
    """A DLPack capsule for compact row-major memory at `data`; `owner` stays alive while the tensor does.
    `dtype` is (code, bits, lanes), `device` (device type, device id)."""
    ndim = len(shape)
    shape_array = (ctypes.c_int64 * ndim)(*shape)
    strides_array = (ctypes.c_int64 * ndim)(*compact_strides(shape))
    tensor = DLTensor(data, DLDevice(*device), ndim, DLDataType(*dtype), shape_array, strides_array, 0)
    if versioned:
        managed = DLManagedTensorVersioned(DLPackVersion(1, 0), None, _DELETER, 0, tensor)
    else:
        managed = DLManagedTensor(tensor, None, _DELETER)
    address = ctypes.addressof(managed)
    _EXPORTED[address] = (managed, shape_array, strides_array, owner)
    return _capsule_new(address, VERSIONED if versioned else LEGACY, _DESTRUCTOR)


def exported_count() -> int:
    """How many exported tensors are still alive (for tests: every export must be released)."""
    return len(_EXPORTED)
