"""The mmap indexed dataset: Megatron's and DeepSpeed's `.bin`/`.idx` pair, read through a memory map.

A dataset at prefix `p` is two files. `p.bin` holds every item's elements back to back, in one numpy
dtype. `p.idx` describes them, little-endian:

    b"MMIDIDX\\x00\\x00"        9 bytes, magic
    version                   uint64, always 1
    dtype code                uint8 (`DTYPE_CODES`)
    item count N              uint64
    document count D          uint64
    sizes                     int32[N], elements per item
    pointers                  int64[N], byte offset of each item in `.bin`
    document index            int64[D], item index where each document starts (first is 0)

Files written here are byte-identical to DeepSpeed 0.19.8's builder for the same items, so either side
reads the other's: the data analyzer's metric indexes and the curriculum sampler's cluster files use
this format.
"""

from __future__ import annotations

import logging
import numbers
import os
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DTYPE_CODES",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "code",
    "data_file_path",
    "dataset_exists",
    "dtype_from_code",
    "get_available_dataset_impl",
    "index_file_path",
    "infer_dataset_impl",
    "make_builder",
    "make_dataset",
    "valid_dtypes",
]

#: Format code -> (numpy dtype, torch dtype or None). The codes are the format's; do not renumber.
DTYPE_CODES: dict[int, tuple[type[np.generic], torch.dtype | None]] = {
    1: (np.uint8, torch.uint8),
    2: (np.int8, torch.int8),
    3: (np.int16, torch.int16),
    4: (np.int32, torch.int32),
    5: (np.int64, torch.int64),
    6: (np.uint16, None),
    7: (np.uint32, None),
    8: (np.uint64, None),
}
#: Every numpy and torch dtype an item may be stored as.
valid_dtypes: set[Any] = {np_dt for np_dt, _ in DTYPE_CODES.values()} | {
    t for _, t in DTYPE_CODES.values() if t is not None
}

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, item count, document count


def _numpy_dtype(dtype: Any) -> type[np.generic]:
    """The format's numpy dtype for a numpy/torch dtype (or numpy dtype instance)."""
    for np_dt, torch_dt in DTYPE_CODES.values():
        if dtype is torch_dt or (not isinstance(dtype, torch.dtype) and np.dtype(dtype) == np.dtype(np_dt)):
            return np_dt
    raise ValueError(
        f"dtype {dtype} cannot be stored in an indexed dataset; use one of {sorted(map(str, valid_dtypes))}"
    )


def code(dtype: Any) -> int:
    """The format code of a numpy or torch dtype.

    Raises:
        ValueError: the dtype has no code (floats, bool).
    """
    np_dt = _numpy_dtype(dtype)
    return next(c for c, (candidate, _) in DTYPE_CODES.items() if candidate is np_dt)


def dtype_from_code(dtype_code: int) -> type[np.generic]:
    """The numpy dtype a format code stands for."""
    if dtype_code not in DTYPE_CODES:
        raise ValueError(f"unknown indexed-dataset dtype code {dtype_code}; known: {sorted(DTYPE_CODES)}")
    return DTYPE_CODES[dtype_code][0]


def index_file_path(prefix_path: str) -> str:
    return f"{prefix_path}.idx"


def data_file_path(prefix_path: str) -> str:
    return f"{prefix_path}.bin"


def write_index(path: str, dtype: Any, sizes: Sequence[int], doc_idx: Sequence[int]) -> None:
    """Write an `.idx` file for items of `sizes` elements of `dtype`, packed in order in the `.bin`."""
    np_dt = _numpy_dtype(dtype)
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    pointers = np.zeros(len(sizes_arr), dtype=np.int64)
    if len(sizes_arr) > 1:
        np.cumsum(sizes_arr[:-1] * np.dtype(np_dt).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, _VERSION, code(np_dt), len(sizes_arr), len(doc_idx)))
        f.write(sizes_arr.astype(np.int32).tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(doc_idx, dtype=np.int64).tobytes(order="C"))


class MMapIndex:
    """The parsed `.idx` file: sizes, byte pointers and document index as views of one memory map."""

    def __init__(self, path: str, skip_warmup: bool = False) -> None:
        with open(path, "rb") as f:
            header = f.read(_HEADER.size)
        if len(header) < _HEADER.size or header[:9] != _MAGIC:
            raise ValueError(f"{path} is not an mmap indexed-dataset index (its magic is not {_MAGIC!r})")
        _, version, dtype_code, length, doc_count = _HEADER.unpack(header)
        if version != _VERSION:
            raise ValueError(f"{path}: index version {version} is not supported (only {_VERSION})")
        self._dtype = dtype_from_code(dtype_code)
        self._len = int(length)
        if not skip_warmup:
            _warmup(path)
        self._mmap = np.memmap(path, mode="r", order="C")
        offset = _HEADER.size
        self._sizes = np.frombuffer(self._mmap, dtype=np.int32, count=self._len, offset=offset)
        offset += self._sizes.nbytes
        self._pointers = np.frombuffer(self._mmap, dtype=np.int64, count=self._len, offset=offset)
        offset += self._pointers.nbytes
        self._doc_idx = np.frombuffer(self._mmap, dtype=np.int64, count=int(doc_count), offset=offset)

    @property
    def dtype(self) -> type[np.generic]:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    def __getitem__(self, i: int) -> tuple[int, int]:
        return int(self._pointers[i]), int(self._sizes[i])

    def __len__(self) -> int:
        return self._len


def _warmup(path: str) -> None:
    """Read a file once so the first accesses through the map do not fault page by page."""
    with open(path, "rb") as stream:
        while stream.read(100 * 1024 * 1024):
            pass


class MMapIndexedDataset(torch.utils.data.Dataset[Any]):
    """Items of an indexed dataset at `path` (the prefix, without `.bin`/`.idx`) as numpy views of a memory map.

    `ds[i]` is item `i` (a read-only 1-D array), `ds[a:b]` a list of items; `get(i, offset, length)` a part
    of one item. Pickles as its path (DataLoader workers reopen the maps).
    """

    Index = MMapIndex

    def __init__(self, path: str, skip_warmup: bool = False) -> None:
        super().__init__()
        self._do_init(path, skip_warmup)

    def _do_init(self, path: str, skip_warmup: bool) -> None:
        self._path = path
        self._index = MMapIndex(index_file_path(path), skip_warmup)
        if not skip_warmup:
            _warmup(data_file_path(path))
        self._bin = np.memmap(data_file_path(path), mode="r", order="C")

    def __getstate__(self) -> str:
        return self._path

    def __setstate__(self, state: str) -> None:
        self._do_init(state, skip_warmup=True)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an indexed dataset must be contiguous (step 1)")
            if start >= stop:
                return []
            sizes = self._index.sizes[start:stop]
            flat = np.frombuffer(
                self._bin, dtype=self._index.dtype, count=int(sizes.sum()), offset=int(self._index.pointers[start])
            )
            return np.split(flat, np.cumsum(sizes)[:-1])
        if isinstance(idx, numbers.Integral):
            i = int(idx)
            if i < 0:
                i += len(self)
            if not 0 <= i < len(self):
                raise IndexError(f"index {idx} out of range for an indexed dataset of {len(self)} items")
            ptr, size = self._index[i]
            return np.frombuffer(self._bin, dtype=self._index.dtype, count=size, offset=ptr)
        raise TypeError(f"indexed dataset indices are ints or slices, got {type(idx).__name__}")

    def __iter__(self) -> Iterator[np.ndarray]:
        """Items `0 .. len - 1` in order (what iterating through `__getitem__` gives)."""
        for i in range(len(self)):
            yield self[i]

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Elements `offset : offset + length` of item `idx` (to its end when `length` is None)."""
        ptr, size = self._index[idx]
        if length is None:
            length = size - offset
        ptr += offset * np.dtype(self._index.dtype).itemsize
        return np.frombuffer(self._bin, dtype=self._index.dtype, count=length, offset=ptr)

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    def size(self, index: int) -> int:
        return int(self._index.sizes[index])

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def get_doc_idx(self) -> np.ndarray:
        return self._index._doc_idx

    def set_doc_idx(self, doc_idx: np.ndarray) -> None:
        self._index._doc_idx = doc_idx

    @property
    def supports_prefetch(self) -> bool:
        return False

    @property
    def dtype(self) -> type[np.generic]:
        return self._index.dtype

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


class MMapIndexedDatasetBuilder:
    """Writes items to `out_file` (the `.bin`) as they come; `finalize(index_file)` writes the `.idx`.

    Items are stored in `dtype` (numpy or torch; converted on the way in). `end_document()` closes a
    document after the items added so far.
    """

    def __init__(self, out_file: str, dtype: Any = np.int64) -> None:
        self._dtype = _numpy_dtype(dtype)
        self._data_file = open(out_file, "wb")  # noqa: SIM115 - stays open until finalize()
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    @property
    def dtype(self) -> type[np.generic]:
        return self._dtype

    def add_item(self, tensor: torch.Tensor | np.ndarray) -> None:
        """Append one item (any shape; stored flattened)."""
        array = tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
        self.add_item_numpy(array)

    def add_item_numpy(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self._dtype)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(int(array.size))

    def add_items(self, arrays: Iterable[np.ndarray]) -> None:
        """Append several items."""
        for array in arrays:
            self.add_item_numpy(array)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file: str) -> None:
        """Append every item and document of the dataset at prefix `another_file` (same dtype)."""
        index = MMapIndex(index_file_path(another_file), skip_warmup=True)
        if index.dtype is not self._dtype:
            raise ValueError(
                f"cannot merge {another_file}: its dtype {np.dtype(index.dtype)} differs from the builder's "
                f"{np.dtype(self._dtype)}"
            )
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in index.sizes)
        self._doc_idx.extend(int(d) + offset for d in index.doc_idx[1:])
        with open(data_file_path(another_file), "rb") as f:
            shutil.copyfileobj(f, self._data_file)
        self._data_file.flush()

    def finalize(self, index_file: str) -> None:
        """Close the `.bin` and write the `.idx` at `index_file`."""
        self._data_file.close()
        write_index(index_file, self._dtype, self._sizes, self._doc_idx)


_LEGACY_MAGIC = b"TNTIDX\x00\x00"
_ONLY_MMAP = "ds implements the 'mmap' indexed dataset only (not fairseq's 'lazy'/'cached' format)"


def get_available_dataset_impl() -> list[str]:
    """The dataset implementations ds reads and writes."""
    return ["mmap"]


def infer_dataset_impl(path: str) -> str | None:
    """'mmap' for an mmap indexed dataset at `path`, 'cached' for the legacy format, None otherwise."""
    if not MMapIndexedDataset.exists(path):
        logger.warning("no indexed dataset at %s (a prefix to which .idx and .bin are appended)", path)
        return None
    with open(index_file_path(path), "rb") as f:
        magic = f.read(9)
    if magic == _MAGIC:
        return "mmap"
    return "cached" if magic[:8] == _LEGACY_MAGIC else None


def make_builder(out_file: str, impl: str, vocab_size: int | None = None) -> MMapIndexedDatasetBuilder:
    """A builder for token ids: uint16 when `vocab_size` < 65500, else int32.

    Raises:
        ValueError: `impl` is not 'mmap'.
    """
    if impl != "mmap":
        raise ValueError(f"indexed dataset impl {impl!r}: {_ONLY_MMAP}")
    dtype = np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32
    return MMapIndexedDatasetBuilder(out_file, dtype=dtype)


def make_dataset(path: str, impl: str, skip_warmup: bool = False) -> MMapIndexedDataset | None:
    """The dataset at `path` (`impl` 'mmap' or 'infer'); None when there is none.

    Raises:
        ValueError: the dataset is in another format, or `impl` is neither 'mmap' nor 'infer'.
    """
    if not MMapIndexedDataset.exists(path):
        logger.warning("no indexed dataset at %s (a prefix to which .idx and .bin are appended)", path)
        return None
    if impl == "infer":
        impl = infer_dataset_impl(path) or "unknown"
    if impl != "mmap":
        raise ValueError(f"indexed dataset at {path} is {impl!r}: {_ONLY_MMAP}")
    return MMapIndexedDataset(path, skip_warmup)


def dataset_exists(path: str, impl: str) -> bool:
    return MMapIndexedDataset.exists(path)
