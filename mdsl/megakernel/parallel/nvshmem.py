"""NVSHMEM's host library through ctypes: the transport of the tensor-parallel megakernel.

NVSHMEM gives every rank (PE) a symmetric heap: `malloc(n)` returns, on every PE, a buffer at the same
offset of its heap, and `peer_address(ptr, pe)` the address at which this process reaches that PE's copy
by NVLink loads and stores (NVSHMEM maps the peers' heaps into this process: nvshmem_ptr). The
megakernel's put-with-signal is then what NVSHMEM's own put-with-signal does between NVLink peers: the
block's stores into the peer's buffer, a system-scope fence, and a release add on the peer's event
counter. NVSHMEM's device library is not linked into the megakernel (its headers take 8 s through NVRTC
and its static library does not resolve for NVRTC-built relocatable code); only its host library is used.

Bootstrap by unique id: rank 0 makes the id (`unique_id()`), the launcher hands its 128 bytes to every
rank, and each rank calls `init(rank, world, uid)`. NVLink multicast stays off (NVSHMEM_DISABLE_NVLS=1):
the shared machines forbid it, and a one-shot push all-reduce needs only peer-to-peer stores.

The library comes from the `nvidia-nvshmem-cu13` wheel (`pip install mdsl[tp]`) or MDSL_NVSHMEM_LIB.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from typing import Optional

from mdsl.errors import MdslError

UNIQUE_ID_BYTES = 128
_INIT_WITH_UNIQUEID = 1 << 3
# NVLink multicast (NVLS) is never used: it can take a shared host's GPUs out of service
SAFE_ENVIRONMENT = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}


class NvshmemError(MdslError):
    pass


class _UniqueId(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("internal", ctypes.c_char * 124)]


class _UniqueIdArgs(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("id", ctypes.POINTER(_UniqueId)), ("myrank", ctypes.c_int),
                ("nranks", ctypes.c_int)]


class _InitArgs(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("uid_args", _UniqueIdArgs), ("content", ctypes.c_char * 96)]


class _InitAttr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", _InitArgs)]


# the headers' static_asserts (nvshmem_types.h, nvshmem_uniqueid.h): a different NVSHMEM ABI fails here
assert (ctypes.sizeof(_UniqueId), ctypes.sizeof(_UniqueIdArgs), ctypes.sizeof(_InitArgs),
        ctypes.sizeof(_InitAttr)) == (128, 24, 128, 144)


def _versioned(struct):
    return (1 << 16) + ctypes.sizeof(struct)


def library_path() -> Optional[str]:
    """libnvshmem_host.so.3 from MDSL_NVSHMEM_LIB or the nvidia-nvshmem wheel; None when neither is there."""
    given = os.environ.get("MDSL_NVSHMEM_LIB")
    if given:
        return given
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []) or []:
        found = sorted(glob.glob(os.path.join(root, "nvshmem", "lib", "libnvshmem_host.so*")))
        if found:
            return found[0]
    return None


_lib = None


def _library():
    global _lib
    if _lib is None:
        path = require()
        for name, value in SAFE_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        if os.environ["NVSHMEM_DISABLE_NVLS"] != "1":
            raise NvshmemError("NVSHMEM_DISABLE_NVLS must be 1: the megakernel never uses NVLink multicast")
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        signatures = {
            "nvshmemx_get_uniqueid": (ctypes.c_int, [ctypes.POINTER(_UniqueId)]),
            "nvshmemx_set_attr_uniqueid_args": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_UniqueId),
                                                               ctypes.POINTER(_InitAttr)]),
            "nvshmemx_hostlib_init_attr": (ctypes.c_int, [ctypes.c_uint, ctypes.POINTER(_InitAttr)]),
            "nvshmemx_hostlib_finalize": (None, []),
            "nvshmem_my_pe": (ctypes.c_int, []), "nvshmem_n_pes": (ctypes.c_int, []),
            "nvshmem_malloc": (ctypes.c_void_p, [ctypes.c_size_t]), "nvshmem_free": (None, [ctypes.c_void_p]),
            "nvshmem_ptr": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int]),
            "nvshmem_barrier_all": (None, []), "nvshmem_quiet": (None, []),
        }
        for name, (restype, argtypes) in signatures.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
        _lib = lib
    return _lib


def available() -> bool:
    return library_path() is not None


def require() -> str:
    """The host library's path, or an NvshmemError saying what to install (nothing is loaded)."""
    path = library_path()
    if path is None:
        raise NvshmemError("tensor parallelism needs NVSHMEM's host library, which is not installed",
                           hint="pip install nvidia-nvshmem-cu13 (or mdsl[tp]), or set MDSL_NVSHMEM_LIB to "
                                "libnvshmem_host.so.3")
    return path


def unique_id() -> bytes:
    """Rank 0's bootstrap id (128 bytes) for `init` on every rank."""
    uid = _UniqueId()
    uid.version = _versioned(_UniqueId)
    status = _library().nvshmemx_get_uniqueid(ctypes.byref(uid))
    if status != 0:
        raise NvshmemError(f"nvshmemx_get_uniqueid failed ({status})")
    return bytes(uid)


class Nvshmem:
    """This process's PE after `init`; the current CUDA context must be the device's primary context
    (NVSHMEM works through the CUDA runtime, which uses it)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self._buffers: list = []

    def malloc(self, nbytes: int) -> int:
        """A symmetric buffer (same size and order on every PE: a collective call)."""
        ptr = _library().nvshmem_malloc(max(16, int(nbytes)))
        if not ptr:
            raise NvshmemError(f"nvshmem_malloc({nbytes}) failed: the symmetric heap is too small",
                               hint="raise NVSHMEM_SYMMETRIC_SIZE (bytes, e.g. 2G)")
        self._buffers.append(ptr)
        return ptr

    def peer_address(self, ptr: int, pe: int) -> int:
        """Where this process stores into PE `pe`'s copy of the symmetric buffer at `ptr` (NVLink)."""
        address = _library().nvshmem_ptr(ctypes.c_void_p(ptr), pe)
        if not address:
            raise NvshmemError(f"PE {pe}'s symmetric heap is not reachable by loads and stores from PE {self.rank}",
                               hint="the tensor-parallel megakernel needs the GPUs of one host, connected by "
                                    "NVLink or PCIe peer-to-peer")
        return address

    def barrier(self) -> None:
        """Every PE has arrived, and this PE's puts and memory operations are complete."""
        _library().nvshmem_barrier_all()

    def close(self) -> None:
        lib = _library()
        for ptr in self._buffers:
            lib.nvshmem_free(ctypes.c_void_p(ptr))
        self._buffers = []
        lib.nvshmemx_hostlib_finalize()


def init(rank: int, world: int, uid: bytes) -> Nvshmem:
    """Join the job as PE `rank` of `world` (every rank calls this with rank 0's `unique_id()`)."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise NvshmemError(f"an NVSHMEM unique id has {UNIQUE_ID_BYTES} bytes, not {len(uid)}")
    lib = _library()
    identity = _UniqueId.from_buffer_copy(uid)
    attr = _InitAttr()
    attr.version = _versioned(_InitAttr)
    attr.args.version = _versioned(_InitArgs)
    attr.args.uid_args.version = _versioned(_UniqueIdArgs)
    status = lib.nvshmemx_set_attr_uniqueid_args(rank, world, ctypes.byref(identity), ctypes.byref(attr))
    if status == 0:
        status = lib.nvshmemx_hostlib_init_attr(_INIT_WITH_UNIQUEID, ctypes.byref(attr))
    if status != 0:
        raise NvshmemError(f"NVSHMEM initialisation of PE {rank} of {world} failed ({status})",
                           hint="NVSHMEM_DEBUG=INFO prints why; every rank must call init with the same id")
    me, count = lib.nvshmem_my_pe(), lib.nvshmem_n_pes()
    if (me, count) != (rank, world):
        raise NvshmemError(f"NVSHMEM made this process PE {me} of {count}, not {rank} of {world}")
    return Nvshmem(rank, world)
