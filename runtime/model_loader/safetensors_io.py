# SPDX-License-Identifier: Apache-2.0
"""Finding, validating and streaming the tensors of a safetensors checkpoint directory.

`find_checkpoint_files(dir)` lists the shard files, `CheckpointIndex(dir)` maps every tensor
name to its shard and header facts (shape, dtype) without reading any tensor data, and
`iterate_tensors(index)` yields `(name, tensor)` shard by shard. Every problem a user can fix
(wrong path, missing shard, corrupt or truncated file, missing tensor) is a `CheckpointError`
whose message says what is wrong and what to do about it.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"

# The format caps the header at 100 MB; a larger length means the first 8 bytes are garbage.
_MAX_HEADER_BYTES = 100_000_000

# safetensors dtype string -> (torch dtype, bits per element). Needed to answer `dtype(name)`
# from the header alone; safetensors exposes no public mapping for this.
_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 64),
    "F32": (torch.float32, 32),
    "F16": (torch.float16, 16),
    "BF16": (torch.bfloat16, 16),
    "I64": (torch.int64, 64),
    "I32": (torch.int32, 32),
    "I16": (torch.int16, 16),
    "I8": (torch.int8, 8),
    "U8": (torch.uint8, 8),
    "BOOL": (torch.bool, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 8),
    "F8_E5M2": (torch.float8_e5m2, 8),
    "F8_E8M0": (torch.float8_e8m0fnu, 8),
    "U16": (torch.uint16, 16),
    "U32": (torch.uint32, 32),
    "U64": (torch.uint64, 64),
}

_REDOWNLOAD = "re-download or re-save the checkpoint"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as given; the message says what to do."""


@dataclass(frozen=True)
class TensorInfo:
    """Header facts about one stored tensor: its shard, dtype string, shape, byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def find_checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The `*.safetensors` shards of `model_dir`, sorted.

    With a `model.safetensors.index.json`, exactly the files its `weight_map` names (so stray
    or duplicate shards in the directory are not loaded). Raises `CheckpointError` when the
    directory is missing, holds no shards, or the index names a file that is not there.
    """
    root = Path(model_dir)
    hint = "pass --model-path pointing to a directory with config.json and *.safetensors"
    if not root.exists():
        raise CheckpointError(f"model path '{root}' does not exist: {hint}")
    if not root.is_dir():
        raise CheckpointError(f"model path '{root}' is not a directory: {hint}")
    index_path = root / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_weight_map(index_path)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise CheckpointError(
                f"'{index_path}' references {', '.join(repr(m) for m in missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} missing from '{root}': the download "
                f"is incomplete; {_REDOWNLOAD}"
            )
        return [root / f for f in files]
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"no *.safetensors files in '{root}': {hint}")
    return files


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """`weight_map` of an index.json: tensor name -> shard file name relative to its folder."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"'{index_path}' is unreadable or has no 'weight_map' ({e}): {_REDOWNLOAD}"
        ) from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"'weight_map' in '{index_path}' must map tensor names to file names: {_REDOWNLOAD}"
        )
    return weight_map


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> `TensorInfo` from the header of one safetensors file, validated.

    The header is `u64 little-endian length` + that many bytes of JSON; data offsets are
    relative to the end of the header. Raises `CheckpointError` naming the file when the
    header is unreadable or any tensor's bytes lie beyond the end of the file.
    """
    size = path.stat().st_size
    corrupt = f"checkpoint file '{path}' is corrupt or truncated"
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{corrupt}: only {size} bytes, no header; {_REDOWNLOAD}")
            length = int.from_bytes(prefix, "little")
            if length > _MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(
                    f"{corrupt}: header length {length} does not fit in its {size} bytes; "
                    f"{_REDOWNLOAD}"
                )
            header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{corrupt}: header is not valid JSON ({e}); {_REDOWNLOAD}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{corrupt}: header is not a JSON object; {_REDOWNLOAD}")
    data_size = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info = _tensor_info(path, name, entry)
        if info is None:
            raise CheckpointError(f"{corrupt}: bad header entry for '{name}'; {_REDOWNLOAD}")
        if info.end > data_size:
            raise CheckpointError(
                f"{corrupt}: tensor '{name}' needs data up to byte {8 + length + info.end} but "
                f"the file has {size} bytes; {_REDOWNLOAD}"
            )
        tensors[name] = info
    return tensors


def _tensor_info(path: Path, name: str, entry: object) -> TensorInfo | None:
    """`TensorInfo` for one header entry, or None when the entry is malformed."""
    if not isinstance(entry, dict):
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")

    def ints(xs) -> bool:
        return isinstance(xs, list) and all(isinstance(x, int) and x >= 0 for x in xs)

    if not (isinstance(dtype, str) and ints(shape) and ints(offsets) and len(offsets) == 2):
        return None
    begin, end = offsets
    if begin > end:
        return None
    if dtype in _DTYPES:
        numel = 1
        for d in shape:
            numel *= d
        if (numel * _DTYPES[dtype][1] + 7) // 8 != end - begin:
            return None
    return TensorInfo(path, dtype, tuple(shape), begin, end)


class CheckpointIndex:
    """Every tensor of a checkpoint directory: name -> shard file and header facts.

    Built from `model_dir` by reading and validating each shard's header (no tensor data is
    read). With an index.json, its `weight_map` decides which shard holds each name.
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self.files = find_checkpoint_files(self.model_dir)
        headers = {f: read_header(f) for f in self.files}
        index_path = self.model_dir / INDEX_FILE
        self._infos: dict[str, TensorInfo] = {}
        if index_path.is_file():
            for name, fname in _read_weight_map(index_path).items():
                file = self.model_dir / fname
                if name not in headers[file]:
                    raise CheckpointError(
                        f"'{index_path}' lists tensor '{name}' in '{fname}' but that file does "
                        f"not contain it: the shard and the index do not match; {_REDOWNLOAD}"
                    )
                self._infos[name] = headers[file][name]
        else:
            for file, tensors in headers.items():
                for name, info in tensors.items():
                    if name in self._infos:
                        raise CheckpointError(
                            f"tensor '{name}' is in both '{self._infos[name].file.name}' and "
                            f"'{file.name}' under '{self.model_dir}': remove the duplicate shard "
                            f"or add a {INDEX_FILE}"
                        )
                    self._infos[name] = info
        # Shard order, then storage order inside a shard, so reads go through files sequentially.
        order = {f: i for i, f in enumerate(self.files)}
        self._names = sorted(
            self._infos, key=lambda n: (order[self._infos[n].file], self._infos[n].begin, n)
        )

    def names(self) -> list[str]:
        """All tensor names, grouped by shard in storage order."""
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._infos

    __contains__ = has

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        """Header facts for `name`; `CheckpointError` ("missing tensor NAME") when absent."""
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(
                f"missing tensor {name}: no *.safetensors file under '{self.model_dir}' holds "
                f"'{name}'; check that the checkpoint matches the model"
            ) from None

    def file_of(self, name: str) -> Path:
        return self.info(name).file

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype `name` loads as; `CheckpointError` for a dtype torch lacks here."""
        dtype = self.info(name).dtype
        if dtype not in _DTYPES:
            raise CheckpointError(
                f"tensor '{name}' in '{self.file_of(name)}' has dtype {dtype}, which this "
                f"runtime cannot load: convert the checkpoint to a supported dtype"
            )
        return _DTYPES[dtype][0]


def iterate_tensors(
    index: CheckpointIndex,
    names: Iterable[str] | None = None,
    progress: bool = True,
    desc: str = "Loading weights",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for `names` (default: all), on CPU as stored, shard by shard.

    Every name is checked before anything is read, so a missing tensor fails fast with
    `CheckpointError`. The tqdm bar counts tensors; it hides itself when `progress` is False
    or stderr is not a terminal.
    """
    for handle, file, name in walk_shards(index, names, progress, desc):
        yield name, _get(handle, file, name)


def walk_shards(
    index: CheckpointIndex,
    names: Iterable[str] | None,
    progress: bool,
    desc: str,
) -> Iterator[tuple[object, Path, str]]:
    """`(open handle, file, name)` for `names` (default: all), one shard open at a time and
    each shard's tensors in file order, so reads go forward through the file; a handle is
    valid until the walk moves to the next shard."""
    wanted = index.names() if names is None else list(dict.fromkeys(names))
    by_file: dict[Path, list[str]] = {f: [] for f in index.files}
    for name in wanted:
        by_file[index.file_of(name)].append(name)
    bar = tqdm(total=len(wanted), desc=desc, unit="tensor", disable=None if progress else True)
    with bar:
        for file, file_names in by_file.items():
            if not file_names:
                continue
            file_names.sort(key=lambda n: index.info(n).begin)
            with open_shard(file) as handle:
                for name in file_names:
                    yield handle, file, name
                    bar.update(1)


class TensorReader:
    """Random access to single tensors by name, keeping the last few shards open.

    Use as a context manager; `get(name)` returns the stored tensor. Meant for small side
    reads (a weight's scale stored in another shard) next to `iterate_tensors`.
    """

    def __init__(self, index: CheckpointIndex, max_open: int = 2):
        self.index, self.max_open = index, max_open
        self._open: OrderedDict[Path, object] = OrderedDict()

    def get(self, name: str) -> torch.Tensor:
        file = self.index.file_of(name)
        handle = self._open.pop(file, None)
        if handle is None:
            handle = open_shard(file).__enter__()
        self._open[file] = handle
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)[1].__exit__(None, None, None)
        return _get(handle, file, name)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].__exit__(None, None, None)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_shard(file: Path):
    """`safe_open` on `file` (torch tensors, CPU), its errors turned into `CheckpointError`."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError type for bad files
        raise CheckpointError(
            f"checkpoint file '{file}' is corrupt or truncated ({e}); {_REDOWNLOAD}"
        ) from e


def _get(handle, file: Path, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as e:
        if name not in handle.keys():
            raise CheckpointError(
                f"missing tensor {name}: '{file}' does not contain it; check that the "
                f"checkpoint matches the model"
            ) from e
        raise CheckpointError(
            f"cannot read tensor '{name}' from '{file}' ({e}): the file is corrupt or "
            f"truncated; {_REDOWNLOAD}"
        ) from e
