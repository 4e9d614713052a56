"""A local directory as storage: objects are files written temporary -> fsync -> rename (eyas.fsio)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from eyas.checksum import checksum_bytes, checksum_file, short
from eyas.fsio import TMP_MARKER, atomic_write_bytes, commit_temp, fsync_path, temp_path
from eyas.storage.base import ChecksumMismatchError, check_checksum


class LocalStorage:
    """A directory; names may contain '/' (subdirectories are created on write)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        if name.startswith("/") or ".." in Path(name).parts:
            raise ValueError(f"storage {self.url}: object name {name!r} must be relative and stay inside the root")
        return self.root / name

    def put_bytes(self, name: str, data: bytes) -> str:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        return checksum_bytes(data)

    def get_bytes(self, name: str, *, checksum: str | None = None) -> bytes:
        data = self._path(name).read_bytes()
        if checksum is not None:
            check_checksum(data, checksum, source=str(self._path(name)))
        return data

    def get_range(self, name: str, start: int, end: int) -> bytes:
        with open(self._path(name), "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    def download_to(self, name: str, path: str | Path, *, checksum: str | None = None) -> None:
        tmp = temp_path(Path(path))
        try:
            shutil.copyfile(self._path(name), tmp)
            if checksum is not None and (found := checksum_file(tmp)) != checksum:
                raise ChecksumMismatchError(
                    f"{self._path(name)}: checksum {short(found)} of {tmp.stat().st_size} bytes read, expected "
                    f"{short(checksum)}; the object is corrupt or was replaced; verification quarantines it and "
                    f"extraction rewrites it"
                )
            commit_temp(tmp, Path(path))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def list(self, prefix: str = "") -> dict[str, int]:
        return {name: st.st_size for name, st in self._stats(prefix).items()}

    def versions(self, prefix: str = "") -> dict[str, str]:
        return {name: f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}" for name, st in self._stats(prefix).items()}

    def _stats(self, prefix: str) -> dict[str, os.stat_result]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return {}
        out = {}
        with os.scandir(base) as entries:
            for e in entries:
                if e.is_file() and TMP_MARKER not in e.name:
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue  # deleted since the directory was read (a released or quarantined shard): not there
                    out[f"{prefix.rstrip('/')}/{e.name}" if prefix else e.name] = st
        return out

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def move(self, name: str, to: str) -> None:
        src, dst = self._path(name), self._path(to)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        fsync_path(dst.parent)
        fsync_path(src.parent)

    def remove_partial(self) -> list[str]:
        strays = []
        for p in sorted(self.root.rglob(f".*{TMP_MARKER}*")):
            if p.is_file():
                p.unlink()
                strays.append(str(p.relative_to(self.root)))
        return strays

    def local_path(self) -> Path | None:
        return self.root
