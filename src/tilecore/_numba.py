"""numba's `njit`, cached on disk and compiled by one process at a time: the way every
tilecore kernel is compiled.

numba keeps machine code in an on-disk cache (`cache=True`), but processes that start
together on a cold cache each compile every kernel they call: the input worker
processes of a training run, the processes of a multi-process job, a test session's
workers. A kernel costs 1 to 6 s of CPU to compile, so six input workers on a small host
spent minutes compiling the same code before their first batch. Here a compile takes an
inter-process lock beside the function's cache index first; a process that waited for it
then finds the first one's machine code in the cache and loads it instead.

Only a cache miss locks: a signature this process already has, or one numba loads from
disk, costs what it did. Without a writable cache directory nothing is locked.

numba also checks a cached function only against its own source file: a kernel whose
helper in another module changed (say `ops/cpu/_vector.py` after a `git pull`) loads its
old machine code, silently. So every cached tilecore function is stamped with the
sources of all of tilecore's numba code (`source_stamp`): a change to any of them
compiles every kernel again, once.

A damaged cache entry (a truncated or overwritten index or machine-code file) made
numba raise from deep inside its unpickler, in every later process, and through the
CPU wing's probe it silently switched the process to the slower XLA kernels. A cached
function's entry that cannot be loaded is now dropped with a warning naming its file,
and compiled and written again (`heal_cache`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import pathlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numba
from numba.core import sigutils
from numba.core.compiler_lock import global_compiler_lock

_held: set[str] = set()
"""The lock files this process holds: a compile nested in another of the same function
(recursion) must not wait for itself."""


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`numba.njit(**options)` whose compiles of a cached function (`cache=True`) run in
    one process at a time, the others loading what it wrote."""
    decorate = numba.njit(**options)

    def wrap(func: Callable[..., Any]) -> Any:
        dispatcher = decorate(func)
        if options.get("cache"):
            _stamp_with_sources(dispatcher)
            heal_cache(dispatcher)
            _compile_once(dispatcher)
        return dispatcher

    return wrap


def cfunc(signature: Any, cache: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """`numba.cfunc(signature, cache=cache)` (compiled at once, as numba's is), whose cache
    entry is healed when damaged (`heal_cache`)."""
    from numba.core.ccallback import CFunc

    def wrap(func: Callable[..., Any]) -> Any:
        compiled = CFunc(func, sigutils.normalize_signature(signature), locals={}, options={})
        if cache:
            compiled.enable_caching()
            heal_cache(compiled)
        compiled.compile()
        return compiled

    return wrap


def heal_cache(compiled: Any) -> None:
    """Make a cache entry of `compiled` (a numba dispatcher or cfunc with its cache on)
    that cannot be loaded a miss: warn naming the entry's index file, remove the index
    (numba finds its machine-code files through it, and merges a new entry into it, so a
    damaged one would fail the save too), and let numba compile and write it again.

    Uses numba internals (`_cache.load_overload`, `_cache_file._index_path`); a numba
    without them keeps its own behaviour.
    """
    cache = getattr(compiled, "_cache", None)
    load = getattr(cache, "load_overload", None)
    index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    if cache is None or load is None or index is None:
        return

    def load_overload(sig: Any, target_context: Any) -> Any:
        try:
            return load(sig, target_context)
        except Exception as error:  # any damage: unpickling, truncation, bad machine code
            warnings.warn(
                f"tilecore: the cached machine code in {index} cannot be loaded "
                f"({type(error).__name__}: {error}); removing it and compiling again.",
                RuntimeWarning, stacklevel=2)
            with contextlib.suppress(OSError):
                os.remove(index)
            return None

    cache.load_overload = load_overload


@contextlib.contextmanager
def compile_lock(path: str) -> Iterator[None]:
    """Hold `path` (created if missing) exclusively against other processes, and numba's
    own compiler lock against this process's threads, while compiling what it guards.

    numba's lock comes first: a thread waiting for a file another thread of this process
    holds would otherwise wait while holding the lock that thread needs. A directory
    that cannot take the file, or a file system without locks, locks nothing.
    """
    with global_compiler_lock:
        if path in _held:
            yield
            return
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks (some network mounts): compile
                yield
                return
            _held.add(path)
            try:
                yield
            finally:
                _held.discard(path)
        finally:
            os.close(fd)  # releases the lock


def source_stamp() -> str:
    """SHA-256 (hex) of every tilecore module that holds numba code (names and bytes):
    what a cached kernel's machine code may depend on, whichever file defines it."""
    return _stamp_of(pathlib.Path(__file__).parent)


@functools.cache
def _stamp_of(root: pathlib.Path) -> str:
    """`source_stamp` of the package at `root` (read once per process)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        text = path.read_bytes()
        if b"numba" in text:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + text + b"\0")
    return digest.hexdigest()


def _stamp_with_sources(dispatcher: Any) -> None:
    """Make the dispatcher's on-disk cache valid only for today's `source_stamp`.

    numba keeps its function's file stamp in the cache index and drops the index when
    the stamp differs; the stamp is extended here (numba internals: a numba without
    them keeps its own, file-only check).
    """
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if cache_file is not None and hasattr(cache_file, "_source_stamp"):
        cache_file._source_stamp = (cache_file._source_stamp, source_stamp())


def _compile_once(dispatcher: Any) -> None:
    """Route the dispatcher's compiles of new signatures through `compile_lock`."""
    cache = dispatcher._cache
    directory = getattr(cache, "cache_path", None)
    base = getattr(getattr(cache, "_impl", None), "filename_base", None)
    if not directory or not base:
        return
    path = os.path.join(directory, f"{base}.lock")  # beside numba's `<base>.nbi` index
    compile_ = dispatcher.compile

    def compile(sig: Any) -> Any:
        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) in dispatcher.overloads:
            return compile_(sig)
        with contextlib.suppress(OSError):
            os.makedirs(directory, exist_ok=True)
        with compile_lock(path):
            return compile_(sig)  # loads from the cache when another process wrote it

    dispatcher.compile = compile
