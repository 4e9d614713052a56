"""`pytorch_model.bin` read without torch and without running pickled code (EAGLE official's drafts ship one).

    shapes = bin_tensor_shapes(path)          # {name: shape}, from the pickle alone
    d2t = bin_tensor_values(path, "d2t")      # a numpy array of one tensor's storage

A torch zip checkpoint is `ARCHIVE/data.pkl` (a pickled dict of tensors) beside `ARCHIVE/data/KEY` (each
storage's raw bytes). The unpickler here knows only what a dict of tensors needs (torch's tensor and
parameter rebuild functions, the typed storages, OrderedDict) and refuses every other name, as
`torch.load(weights_only=True)` does; tensors come back as references (shape, storage, offset), and only
the bytes of a tensor asked for are read. eyas.export.reader loads the tensors with torch itself.
"""

from __future__ import annotations

import collections
import pickle
import sys
import zipfile
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

# torch's typed storages as pickled (GLOBAL 'torch XStorage') -> numpy dtype of their bytes (None: no numpy
# dtype; such tensors have shapes but no values here).
_STORAGES = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": None,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass(frozen=True)
class _Storage:
    type: _StorageType
    key: str


@dataclass(frozen=True)
class TensorRef:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage, storage_offset, size, stride, *_):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, *_):
    return data


class _WeightsUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        raise pickle.UnpicklingError(
            f"{self.where}: refers to {module}.{name}, which a dict of tensors does not need; eyas does not run it. "
            "Expected a state dict saved with torch.save: convert the file to safetensors with its own tools"
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"{self.where}: persistent id {pid!r}, expected ('storage', type, key, ...)")
        return _Storage(pid[1], str(pid[2]))


def _archive(path: Path) -> tuple[zipfile.ZipFile, str]:
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path}: not a torch zip checkpoint (torch.save since torch 1.6); expected one: re-save it with "
            "torch.save(state_dict, path) or convert it to safetensors"
        )
    archive = zipfile.ZipFile(path)
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise ValueError(f"{path}: {len(pickles)} data.pkl entries, expected 1 (a torch.save archive)")
    return archive, pickles[0][: -len("data.pkl")]


def read_bin_refs(path: Path) -> dict[str, TensorRef]:
    """{tensor name: TensorRef} of a pytorch_model.bin holding a flat dict of tensors."""
    path = Path(path)
    archive, prefix = _archive(path)
    with archive, archive.open(prefix + "data.pkl") as f:
        state = _WeightsUnpickler(f, str(path)).load()
    if not isinstance(state, dict) or not all(isinstance(v, TensorRef) for v in state.values()):
        raise ValueError(f"{path}: holds a {type(state).__name__}, expected a flat dict of tensors (a state dict)")
    return dict(state)


def bin_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {k: ref.shape for k, ref in read_bin_refs(path).items()}


def bin_tensor_values(path: Path, name: str) -> np.ndarray:
    """The values of tensor `name` (read from its storage's bytes only), shaped as saved."""
    path = Path(path)
    ref = read_bin_refs(path)[name]
    dtype = _STORAGES[ref.storage.type.name]
    if dtype is None:
        raise ValueError(f"{path}: {name} is stored as {ref.storage.type.name}, which numpy cannot read")
    contiguous = tuple(prod(ref.shape[i + 1 :]) for i in range(len(ref.shape)))
    if ref.stride != contiguous and prod(ref.shape) > 1:
        raise ValueError(f"{path}: {name} has strides {list(ref.stride)}, expected a contiguous tensor")
    archive, prefix = _archive(path)
    with archive:
        raw = archive.read(f"{prefix}data/{ref.storage.key}")
        names = set(archive.namelist())
        order = archive.read(f"{prefix}byteorder").decode().strip() if f"{prefix}byteorder" in names else sys.byteorder
    values = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<" if order == "little" else ">"))
    return values[ref.offset : ref.offset + prod(ref.shape)].reshape(ref.shape)
