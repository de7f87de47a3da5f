"""Page-locked host buffers for checkpoint staging, obtained without stopping training.

Why not torch.empty(pin_memory=True): it goes through cudaHostAlloc, which is slow for checkpoint-sized buffers and
holds a driver lock the whole time - a training loop beside it ran much slower, with single kernel launches blocked
(benchmarks/pinned_staging.py, BENCHMARKS.md "Tried, did not pay"). Torch's caching host allocator also rounds each block
up to a power of two. Here the buffers of one allocation batch are views into one ordinary pageable allocation (an
"arena") whose pages are first faulted in by several threads, then page-locked with ONE cudaHostRegister
for its exact, page-aligned size: fast, barely slowing the steps while it runs in a thread, with pinned-speed
device-to-host copies, and torch sees the views as pinned (non_blocking copies stay asynchronous). One registration
per arena, not per tensor: small tensors share pages with their heap neighbours, and a page can be registered once.

A registered arena must be unregistered before its memory is freed: HostStaging owns its arenas and unregisters one
when none of its buffers is in use any more, on release(), and at garbage collection.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

PAGE = 4096
ALIGN = 512  # every buffer starts on this boundary inside its arena (any dtype, and DMA-friendly)

# (data_ptr, nbytes) -> raises on failure. Replaceable for tests (CPU-only machines have no CUDA runtime).
PageLocker = Callable[[int, int], None]
PageUnlocker = Callable[[int], None]
Spec = tuple[str, torch.Size, torch.dtype, bool]  # key path, shape, dtype, page-locked


CUDA_HOST_REGISTER_PORTABLE = 1  # page-locked for every CUDA context of the process, not only the caller's device


def cuda_register(ptr: int, nbytes: int) -> None:
    """Page-lock [ptr, ptr + nbytes) for DMA (cudaHostRegister; HIP's on ROCm builds, through the same binding)."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)} ({err})")


def cuda_unregister(ptr: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {int(err)} ({err})")


def _current_device() -> int | None:
    """The caller's CUDA device, without initializing CUDA where nothing has (CPU runs, tests)."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def run_in_own_thread(fn: Callable[[], None], device: int | None) -> None:
    """fn() in a short-lived thread on `device`, its exception re-raised here. Why: a new thread starts on CUDA device
    0 (a rank on another GPU would create a context there), and a failed CUDA runtime call leaves the calling thread's
    last-error flag set, which torch's next kernel-launch check on the training thread would report as its own."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            fn()
        except BaseException as e:  # noqa: BLE001  # re-raised on the caller's thread below
            failure.append(e)

    thread = threading.Thread(target=target, name="checkpoint-page-lock", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


# Arenas whose unregistration failed: kept alive for the process's lifetime, since freeing memory the driver still
# holds registered could let it DMA into whatever reuses those pages.
_KEPT_REGISTERED: list = []


def torch_pinned_empty(nbytes: int) -> torch.Tensor:
    """The fallback where registering fails: torch's pinned allocator (cudaHostAlloc)."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)


def touch_pages(region: torch.Tensor, threads: int | None = None) -> None:
    """Zero a uint8 host tensor from several threads, faulting its pages in. Why threads of our own: torchrun and Ray
    workers run with OMP_NUM_THREADS=1, where torch's fill faults every page in on one core."""
    n = region.numel()
    threads = min(8, os.cpu_count() or 1) if threads is None else threads
    if threads <= 1 or n < (64 << 20):
        region.zero_()
        return
    chunk = _round_up(-(-n // threads), PAGE)
    with ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-touch") as pool:
        # torch releases the GIL inside zero_, so the chunks fault in at the same time
        list(pool.map(lambda a: region[a:a + chunk].zero_(), range(0, n, chunk)))


def page_aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor on pages of its own (an anonymous private mapping): its storage starts on a page boundary,
    so registering it shares no page with another allocation, and torch.Tensor.is_pinned() - which asks about the
    storage's first byte - reports the registration for every view into it. Freed when the last view is gone."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


class _Arena:
    """One page-locked allocation and the key paths whose buffers are views into it."""

    def __init__(self, storage: torch.Tensor, region_ptr: int | None, paths: set[str], device: int | None):
        self.storage = storage  # keeps the memory alive
        self.region_ptr = region_ptr  # the registered range's start, None when torch pinned it (fallback)
        self.paths = paths
        self.device = device  # the CUDA device current when it was registered (unregistered from there too)


class HostStaging:
    """Host buffers kept from one checkpoint save to the next, keyed by the state's key path.

    ensure(specs) makes a buffer of the right shape and dtype for every (path, shape, dtype, pin) - page-locked when
    pin - allocating what is missing in one arena; buffer(path, like) returns one (allocating it if missing).
    prepare(specs) does ensure in a background thread, ahead of the first save that needs the buffers (a resumed
    run's first background save would otherwise pay for them while training waits); ensure/buffer wait for it.
    """

    def __init__(self, lock: PageLocker | None = None, unlock: PageUnlocker | None = None,
                 touch_threads: int | None = None):
        self._lock = cuda_register if lock is None else lock
        self.touch_threads = touch_threads  # threads faulting a new arena's pages in (None: up to 8)
        self._unlock = cuda_unregister if unlock is None else unlock
        self.buffers: dict[str, torch.Tensor] = {}
        self._pinned_paths: set[str] = set()
        self._arena_of: dict[str, _Arena] = {}
        self._arenas: list[_Arena] = []
        self._thread: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self.last_prepare_error: str | None = None  # a failed prepare(): the next save allocated instead
        self.fallbacks = 0  # arenas that came from torch's pinned allocator because registering failed
        self.last_alloc: dict = {}  # what the last ensure() allocated: buffers, bytes, seconds
        # Unregister at garbage collection too: freeing registered memory without it leaves the driver a stale range.
        self._finalizer = weakref.finalize(self, _unlock_all, self._arenas, self._unlock)

    # -- allocation --------------------------------------------------------------------------------------------------

    def _fits(self, path: str, shape: torch.Size, dtype: torch.dtype, pin: bool) -> bool:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            return False
        return not pin or buf.numel() == 0 or path in self._pinned_paths

    def _missing(self, specs: Iterable[Spec]) -> list[Spec]:
        out = [(p, torch.Size(shape), d, pin) for p, shape, d, pin in specs]
        return [spec for spec in out if not self._fits(*spec)]

    def _forget(self, path: str) -> None:
        self.buffers.pop(path, None)
        self._pinned_paths.discard(path)
        arena = self._arena_of.pop(path, None)
        if arena is not None:
            arena.paths.discard(path)
            # No buffer of it in use: give the pages back. (An arena of which one buffer still lives stays whole.)
            if not arena.paths:
                _unlock_all([arena], self._unlock)
                self._arenas.remove(arena)

    def _allocate(self, specs: list[Spec], device: int | None) -> None:
        t0 = time.perf_counter()
        for path, *_ in specs:
            self._forget(path)
        locked = [(p, s, d) for p, s, d, pin in specs if pin and _nbytes(s, d) > 0]
        for path, shape, dtype, pin in specs:
            if not (pin and _nbytes(shape, dtype) > 0):
                self.buffers[path] = torch.empty(shape, dtype=dtype, device="cpu")
        total = 0
        offsets = []
        for _, shape, dtype in locked:
            offsets.append(total)
            total = _round_up(total + _nbytes(shape, dtype), ALIGN)
        if locked:
            size = _round_up(total, PAGE)
            region = page_aligned_empty(size)
            # Fault every page in now, on several threads (the driver would do it on one).
            touch_pages(region, self.touch_threads)
            try:
                run_in_own_thread(lambda: self._lock(region.data_ptr(), size), device)
                arena = _Arena(region, region.data_ptr(), set(), device)
            except (RuntimeError, OSError, AttributeError):
                # No registration on this build or platform: torch's own pinned allocator (slower, see the docstring).
                self.fallbacks += 1
                del region
                region = torch_pinned_empty(size)
                arena = _Arena(region, None, set(), device)
            self._arenas.append(arena)
            for (path, shape, dtype), off in zip(locked, offsets):
                nbytes = _nbytes(shape, dtype)
                self.buffers[path] = region[off:off + nbytes].view(dtype).view(shape)
                self._pinned_paths.add(path)
                self._arena_of[path] = arena
                arena.paths.add(path)
        self.last_alloc = {"new_buffers": len(specs), "new_locked_bytes": total,
                           "alloc_s": round(time.perf_counter() - t0, 3)}

    def ensure(self, specs: Iterable[Spec]) -> None:
        """A buffer for every spec; whatever does not fit yet is allocated now, the page-locked ones in one arena."""
        self.wait_prepared()
        missing = self._missing(specs)
        self.last_alloc = {}
        if missing:
            self._allocate(missing, _current_device())

    def buffer(self, path: str, like: torch.Tensor, pin: bool | None = None) -> torch.Tensor:
        """The buffer for `path`, (re)allocated to like's shape and dtype; page-locked when `pin` (default: when
        like is on a GPU)."""
        pin = (like.is_cuda and torch.cuda.is_available()) if pin is None else pin
        self.wait_prepared()
        if not self._fits(path, like.shape, like.dtype, pin):
            self._allocate([(path, like.shape, like.dtype, pin)], _current_device())
        return self.buffers[path]

    # -- preparation in the background ------------------------------------------------------------------------------

    def prepare(self, specs: Iterable[Spec]) -> None:
        """ensure(specs) in a thread; the next ensure/buffer call waits for it. A failure is kept in
        last_prepare_error and the next save allocates what is missing itself (reporting its own failure, if any)."""
        self.wait_prepared()
        todo = self._missing(specs)
        if not todo:
            return
        device = _current_device()  # the caller's: the thread would start on device 0

        def work() -> None:
            try:
                self._allocate(todo, device)
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
            self.last_prepare_error = f"{type(error).__name__}: {error}"

    def release(self) -> None:
        """Unregister and forget every buffer (after a staging error, or to give the host memory back)."""
        try:
            self.wait_prepared()
        finally:
            _unlock_all(self._arenas, self._unlock)
            self._arenas.clear()
            self._arena_of.clear()
            self._pinned_paths.clear()
            self.buffers.clear()

    def __len__(self) -> int:
        return len(self.buffers)


def _unlock_all(arenas: list[_Arena], unlock: PageUnlocker) -> None:
    for arena in arenas:
        ptr = arena.region_ptr
        if ptr is None:
            continue
        try:
            run_in_own_thread(lambda p=ptr: unlock(p), arena.device)
        except (RuntimeError, OSError, AttributeError):
            # Still registered as far as we know (or the runtime is gone at interpreter shutdown): never free it.
            _KEPT_REGISTERED.append(arena.storage)
        arena.region_ptr = None


def tensor_specs(tree: dict, prefix: str = "") -> list[Spec]:
    """(key path, shape, dtype, page-locked = on a GPU) of every tensor leaf of a nested state dict - a DTensor's
    local shard - in the key paths stage_to_host uses."""
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
