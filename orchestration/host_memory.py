"""Page-locked host buffers for checkpoint staging, obtained without stopping training.

Why not torch.empty(pin_memory=True): it goes through cudaHostAlloc, which on the H200 host took 5 s for 13 GiB and
held a driver lock the whole time - a training loop beside it ran 2x slower, with single kernel launches blocked for
1.1 s (benchmarks/pinned_staging.py, BENCHMARKS.md session 14). Torch's caching host allocator also rounds each block
up to a power of two. Here a buffer is ordinary pageable memory whose pages are first faulted in by torch's
multithreaded fill, then page-locked with cudaHostRegister for its exact size: 0.95 s for 13 GiB, 8% slower steps
while it runs in a thread, the same 55 GB/s device-to-host copies, and torch sees it as pinned (non_blocking copies
stay asynchronous).

A registered buffer must be unregistered before its memory is freed: HostStaging owns its buffers and unregisters
them when they are replaced or released (and at garbage collection).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

import torch

# (data_ptr, nbytes) -> raises on failure. Replaceable for tests (CPU-only machines have no CUDA runtime).
PageLocker = Callable[[int, int], None]
PageUnlocker = Callable[[int], None]


def cuda_register(ptr: int, nbytes: int) -> None:
    """Page-lock [ptr, ptr + nbytes) for DMA (cudaHostRegister; HIP's on ROCm builds, through the same binding)."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)} ({err})")


def cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def torch_pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The fallback where registering fails: torch's pinned allocator (cudaHostAlloc)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


class HostStaging:
    """Host buffers kept from one checkpoint save to the next, keyed by the state's key path.

    buffer(path, like) returns a CPU tensor of like's shape and dtype: page-locked when `like` is on a GPU, reused
    while shape and dtype stay the same. prepare(specs) allocates buffers in a background thread ahead of the first
    save that needs them (a resumed run's first background save would otherwise pay for them while training waits);
    buffer() waits for a preparation in flight.
    """

    def __init__(self, lock: PageLocker | None = None, unlock: PageUnlocker | None = None):
        self._lock = cuda_register if lock is None else lock
        self._unlock = cuda_unregister if unlock is None else unlock
        self.buffers: dict[str, torch.Tensor] = {}
        # data_ptr of every buffer registered here (and not yet unregistered)
        self._locked: dict[int, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self.fallbacks = 0  # buffers that came from torch's pinned allocator because registering failed
        # Unregister at garbage collection too: freeing registered memory without it leaves the driver a stale range.
        self._finalizer = weakref.finalize(self, _unlock_all, self._locked, self._unlock)

    # -- allocation --------------------------------------------------------------------------------------------------

    def _new_buffer(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        if not pin:
            return torch.empty(shape, dtype=dtype, device="cpu")
        buf = torch.empty(shape, dtype=dtype, device="cpu")
        nbytes = buf.numel() * buf.element_size()
        if nbytes == 0:
            return buf
        buf.zero_()  # fault every page in now, on torch's threads (the driver would do it on one)
        try:
            self._lock(buf.data_ptr(), nbytes)
        except (RuntimeError, OSError, AttributeError):
            # No registration on this build or platform: torch's own pinned allocator (slower, see the docstring).
            self.fallbacks += 1
            return torch_pinned_empty(shape, dtype)
        self._locked[buf.data_ptr()] = buf
        return buf

    def _drop(self, buf: torch.Tensor) -> None:
        if self._locked.pop(buf.data_ptr(), None) is not None:
            self._unlock(buf.data_ptr())

    def _fits(self, path: str, shape: torch.Size, dtype: torch.dtype, pin: bool) -> bool:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            return False
        return not pin or buf.numel() == 0 or buf.data_ptr() in self._locked or buf.is_pinned()

    def buffer(self, path: str, like: torch.Tensor, pin: bool | None = None) -> torch.Tensor:
        """The buffer for `path`, (re)allocated to like's shape and dtype; page-locked when `pin` (default: when
        like is on a GPU)."""
        self.wait_prepared()
        pin = (like.is_cuda and torch.cuda.is_available()) if pin is None else pin
        if self._fits(path, like.shape, like.dtype, pin):
            return self.buffers[path]
        old = self.buffers.get(path)
        if old is not None:
            self._drop(old)
        buf = self._new_buffer(like.shape, like.dtype, pin)
        self.buffers[path] = buf
        return buf

    # -- preparation in the background ------------------------------------------------------------------------------

    def prepare(self, specs: Iterable[tuple[str, torch.Size, torch.dtype, bool]]) -> None:
        """Allocate buffers for (path, shape, dtype, pin) in a thread; the next buffer() call waits for it. A
        failure is kept and raised by that call (the save then reports it like any staging error)."""
        self.wait_prepared()
        todo = [(p, torch.Size(s), d, pin) for p, s, d, pin in specs if not self._fits(p, torch.Size(s), d, pin)]
        if not todo:
            return

        def work() -> None:
            try:
                for path, shape, dtype, pin in todo:
                    old = self.buffers.get(path)
                    if old is not None:
                        self._drop(old)
                    self.buffers[path] = self._new_buffer(shape, dtype, pin)
            except BaseException as e:  # noqa: BLE001  # handed to the training thread by wait_prepared
                self._prepare_error = e

        self._thread = threading.Thread(target=work, name="checkpoint-staging-prepare", daemon=True)
        self._thread.start()

    def preparing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_prepared(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._prepare_error = self._prepare_error, None
        if error is not None:
            raise RuntimeError(f"preparing the checkpoint's host buffers failed: {type(error).__name__}: {error}") \
                from error

    def release(self) -> None:
        """Unregister and forget every buffer (after a staging error, or to give the host memory back)."""
        try:
            self.wait_prepared()
        finally:
            _unlock_all(self._locked, self._unlock)
            self.buffers.clear()

    def __len__(self) -> int:
        return len(self.buffers)


def _unlock_all(locked: dict[int, torch.Tensor], unlock: PageUnlocker) -> None:
    for ptr in list(locked):
        try:
            unlock(ptr)
        except (RuntimeError, OSError, AttributeError):
            pass  # interpreter shutdown: the CUDA runtime may be gone, and the process frees everything anyway
        locked.pop(ptr, None)


def tensor_specs(tree: dict, prefix: str = "") -> list[tuple[str, torch.Size, torch.dtype, bool]]:
    """(key path, shape, dtype, on a GPU) of every tensor leaf of a nested state dict - a DTensor's local shard - in
    the key paths stage_to_host uses."""
    from torch.distributed.tensor import DTensor

    out = []
    for key, value in tree.items():
        path = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.extend(tensor_specs(value, path))
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            out.append((path, local.shape, local.dtype, local.is_cuda))
    return out
