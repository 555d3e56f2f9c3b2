"""A `ClickSource` over files read front to back (Criteo TSV, Parquet).

The data's batches are its valid rows, `batch_size` at a time, in file order
(the rows after the last full batch are not used). Without a separate held-out
file, batches 0 … H − 1 are held out (`eval_batch`) and training batch `step` is
batch H + (step mod E), E being the training batches in the file: at its end the
file is opened again (epochs). Every batch is a pure function of the files, the
options and its index, in every thread, process and resumed run.

`train_batch(step)` takes any step, in any order, from several threads (the
prefetching) or from copies in worker processes (a pickled source opens its own
files): a cursor moves forward through the file taking batches as raw rows
(checked, not converted: cheap) and converts only the batch asked for. The last
`KEEP` raw batches are kept, so requests a little out of order (prefetch
threads) cost nothing; a request behind them opens the file again.

Skipped bad rows are counted once however often a file is read: every reader
reads a file from its start, so the bad rows it has seen are the file's first
ones, up to the last it saw (`BadRows`). Copies in other processes count their
own; `bad_rows_by_file` and `merge_bad_rows` bring their counts together (per
file, the copy that read furthest).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ._checks import check_index
from ._clicks import ClickBatch, ClickFeature
from ._criteo import BadRowError
from ._progress import ReadProgress

KEEP = 8
"""Raw batches a cursor keeps (the newest ones)."""


class BadRowsWarning(UserWarning):
    """Rows that could not be read were skipped (`skip_bad_rows`); says how many."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BadRows:
    """The bad rows of one file seen so far: its first `count`, up to line (or row) `last`;
    `first` says where the first one is and why it is bad."""

    last: int
    count: int
    first: str


class Reader(Protocol):
    """One pass over a file: `take` up to `rows` checked rows, `parse` them later."""

    def take(self, rows: int) -> tuple[Any, int]: ...

    @property
    def progress(self) -> tuple[int, int]: ...

    def close(self) -> None: ...


OpenReader = Callable[[Callable[[BadRowError], None] | None], Reader]
"""Opens a reader; its argument is called with each bad row (None: raise instead)."""
Parse = Callable[[Any], ClickBatch]
"""Converts what `Reader.take` returned into a batch."""


class _Cursor:
    """Raw batches `first, first + 1, …` of the file `name`, wrapping around at its end."""

    def __init__(self, open_reader: OpenReader, source: StreamedClicks, *, name: str,
                 first: int, keep: int) -> None:
        # A proxy: no reference cycle, so dropping the source closes its files at once.
        self._source = weakref.proxy(source)
        self._open, self._name, self._first, self._keep = open_reader, name, first, keep
        self._reader: Reader | None = None
        self._index = 0  # the batch the reader takes next
        self.length: int | None = None  # batches in a pass, once the end was seen
        self._kept: collections.OrderedDict[int, Any] = collections.OrderedDict()

    def get(self, index: int, progress: ReadProgress) -> Any:
        """Raw batch `index` (counted from `first`)."""
        if self.length is not None:
            index %= self.length
        if index in self._kept:
            self._kept.move_to_end(index)
            return self._kept[index]
        if self._reader is None or index < self._index:
            self._restart()
        reader = self._reader
        assert reader is not None
        while True:
            raw, rows = reader.take(self._source.batch_size)
            if rows < self._source.batch_size:
                self._end(reader)
                return self.get(index, progress)
            self._kept[self._index] = raw
            while len(self._kept) > self._keep:
                self._kept.popitem(last=False)
            self._index += 1
            if self._index - 1 == index:
                return raw
            progress.update(*reader.progress, f"batch {index}")

    def close(self) -> None:
        """Close the file (a later `get` opens it again)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __del__(self) -> None:
        self.close()

    def _restart(self) -> None:
        self.close()
        source = self._source
        self._reader = self._open(source.on_bad if source.skip_bad_rows else None)
        self._index = 0
        for skipped in range(self._first):
            if self._reader.take(self._source.batch_size)[1] < self._source.batch_size:
                self._too_few(skipped)

    def _end(self, reader: Reader) -> None:
        reader.close()
        self._reader = None
        if self.length is None:
            self.length = self._index
            self._source.pass_done()
        if self.length == 0:
            self._too_few(self._first)

    def _too_few(self, batches: int) -> None:
        source = self._source
        skipped = " valid" if source.bad_rows else ""
        held = (f"; the first {self._first} are held out for evaluation and none is left for "
                "training (pass --eval-data, or lower --eval-batches or --batch-size)"
                if self._first else " (lower --batch-size)")
        raise ValueError(f"{self._name}: only {batches} full batches of {source.batch_size}"
                         f"{skipped} rows{held}.")


class StreamedClicks:
    """Click data read from a file as a stream; made by `open_click_data`."""

    def __init__(self, *, name: str, features: tuple[ClickFeature, ...], num_dense: int,
                 batch_size: int, train: OpenReader, parse: Parse, held_out: int,
                 eval_reader: OpenReader | None, skip_bad_rows: bool, progress: bool,
                 eval_name: str | None = None) -> None:
        """`name`: the training data's path; `eval_name`: the held-out data's, whose reader
        is `eval_reader` (None: the held-out batches are the first of `name`)."""
        self.name, self.features, self.num_dense = name, features, num_dense
        self.batch_size, self._parse, self.skip_bad_rows = batch_size, parse, skip_bad_rows
        self._train_open, self._eval_open, self._held_out = train, eval_reader, held_out
        self._eval_name = name if eval_reader is None or eval_name is None else eval_name
        self._progress_on = progress
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        held = self._held_out if self._eval_open is None else 0
        self._train = _Cursor(self._train_open, self, name=self.name, first=held, keep=KEEP)
        self._eval = _Cursor(self._eval_open or self._train_open, self, name=self._eval_name,
                             first=0, keep=self._held_out)
        self._progress = ReadProgress(self.name, enabled=self._progress_on)
        self._bad: dict[str, BadRows] = {}  # per file
        self._passes = 0

    def close(self) -> None:
        """Close the open files (reading again opens them again; garbage collection also
        closes them)."""
        with self._lock:
            self._train.close()
            self._eval.close()

    def __getstate__(self) -> dict[str, Any]:  # a copy opens its own files
        keep = ("name", "features", "num_dense", "batch_size", "skip_bad_rows", "_parse",
                "_train_open", "_eval_open", "_held_out", "_progress_on", "_eval_name")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def train_batch(self, step: int) -> ClickBatch:
        """Training batch `step` (see the module docstring)."""
        check_index(f"{self.name}: train_batch: step", step)
        return self._parse(self._get(self._train, step))

    def eval_batch(self, index: int) -> ClickBatch:
        """Held-out batch `index`, cycled over the held-out batches."""
        check_index(f"{self.name}: eval_batch: index", index)
        if not self._held_out:
            raise ValueError(f"{self.name}: opened without held-out batches "
                             "(ReadOptions.held_out_batches=0).")
        if self._eval_open is None:
            index %= self._held_out
        return self._parse(self._get(self._eval, index))

    def _get(self, cursor: _Cursor, index: int) -> Any:
        with self._lock:
            self._progress.start()
            try:
                return cursor.get(index, self._progress)
            finally:
                self._progress.finish()

    @property
    def bad_rows(self) -> int:
        """Rows skipped as unreadable so far (`skip_bad_rows`), each counted once: here, and
        in the copies whose counts were merged (`merge_bad_rows`)."""
        return sum(seen.count for seen in tuple(self._bad.values()))

    def bad_rows_by_file(self) -> dict[str, BadRows]:
        """The bad rows seen so far, per file: what `merge_bad_rows` of another copy of this
        source (e.g. in the process that started this one's) takes."""
        with self._lock:
            return dict(self._bad)

    def merge_bad_rows(self, seen: Mapping[str, BadRows]) -> None:
        """Count the bad rows another copy of this source has seen (`bad_rows_by_file`); rows
        both have seen count once."""
        with self._lock:
            before = self.bad_rows
            for path, rows in seen.items():
                mine = self._bad.get(path)
                if mine is None or rows.last > mine.last:
                    self._bad[path] = rows
            self._warn_first(before)

    def on_bad(self, error: BadRowError) -> None:
        """Count a skipped row (once, however often the file is read)."""
        key = str(error.path)
        mine = self._bad.get(key)
        if mine is not None and error.line <= mine.last:
            return
        before = self.bad_rows
        self._bad[key] = (
            BadRows(last=error.line, count=1, first=f"{error.where}: {error.reason}")
            if mine is None else dataclasses.replace(mine, last=error.line, count=mine.count + 1))
        self._warn_first(before)

    def _warn_first(self, before: int) -> None:
        if before or not self._bad:
            return
        first = next(iter(self._bad.values())).first
        warnings.warn(f"skipping rows that cannot be read; the first: {first}", BadRowsWarning,
                      stacklevel=3)

    def pass_done(self) -> None:
        """A cursor reached the end of its file for the first time."""
        self._passes += 1
        if self._passes == 1 and self.bad_rows:
            rows = "row" if self.bad_rows == 1 else "rows"
            warnings.warn(f"{self.name}: skipped {self.bad_rows} bad {rows} in one pass over the "
                          "data.", BadRowsWarning, stacklevel=2)
