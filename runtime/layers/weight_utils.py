# SPDX-License-Identifier: Apache-2.0
"""How a checkpoint tensor lands in a parameter.

Every parameter a checkpoint fills carries a `weight_loader(param, loaded, shard_id=None)`.
Loaders raise `WeightShapeError` on a mismatch; the model's `load_weights` adds the
checkpoint name so the user sees which tensor was wrong.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class WeightShapeError(ValueError):
    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...], what: str = ""):
        self.expected, self.got = tuple(expected), tuple(got)
        detail = f" ({what})" if what else ""
        super().__init__(f"shape mismatch{detail}: expected {self.expected}, got {self.got}")


def materialize(loaded) -> torch.Tensor:
    """A checkpoint tensor as a `torch.Tensor`: loaders may be handed a lazy slice (any
    object with `shape`, `narrow(dim, start, length)` and `materialize()`, see
    `runtime.model_loader.lazy`) so that a rank reads only its own shard."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()


def copy_checked(dst: torch.Tensor, src, what: str = "") -> None:
    """Copy a checkpoint tensor (or lazy slice) into a parameter of the same shape."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(tuple(dst.shape), tuple(src.shape), what)
    dst.copy_(materialize(src))


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if shard_id is not None:
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} takes no shard id, got {shard_id!r}"
        )
    copy_checked(param.data, loaded)


def set_weight_loader(param: nn.Parameter, loader: Callable) -> nn.Parameter:
    param.weight_loader = loader
    return param


def make_param(
    shape: tuple[int, ...],
    dtype: torch.dtype | None = None,
    loader: Callable = default_weight_loader,
) -> nn.Parameter:
    """An inference parameter (no grad), filled later by its `weight_loader`."""
    param = nn.Parameter(
        torch.empty(shape, dtype=dtype or torch.get_default_dtype()), requires_grad=False
    )
    return set_weight_loader(param, loader)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rows `[start, end)` of an even split of `total` for `rank`; `total` must divide."""
    if total % size:
        raise ValueError(f"dimension {total} does not split evenly over {size} ranks")
    per = total // size
    return rank * per, (rank + 1) * per


def shard_of(loaded, dim: int, rank: int, size: int, full: int | None = None, what: str = ""):
    """This rank's even share of `loaded` along `dim` (the whole tensor when `size` is 1);
    a lazy slice stays lazy, so only the share is ever read. `full`: the length `dim` must
    have in the checkpoint (a `WeightShapeError` otherwise)."""
    if full is not None and loaded.shape[dim] != full:
        expected = list(loaded.shape)
        expected[dim] = full
        raise WeightShapeError(tuple(expected), tuple(loaded.shape), what)
    if size == 1:
        return loaded
    if loaded.shape[dim] % size:
        raise WeightShapeError(tuple(loaded.shape), tuple(loaded.shape), f"not divisible by {size}")
    start, end = shard_range(loaded.shape[dim], rank, size)
    return loaded.narrow(dim, start, end - start)


def copy_stacked_shards(
    dst: torch.Tensor, loaded, sizes: list[int], rank: int, size: int, what: str = ""
) -> None:
    """`loaded` stacks parts of `sizes` rows (dim 0); `dst` holds this rank's share of each
    part, back to back (a fused q|k|v projection or its conv filter under TP)."""
    if loaded.shape[0] != sum(sizes):
        raise WeightShapeError((sum(sizes), *dst.shape[1:]), tuple(loaded.shape), what)
    src = dst_row = 0
    for part in sizes:
        share = part // size
        piece = loaded.narrow(0, src + rank * share, share)
        copy_checked(dst[dst_row : dst_row + share], piece, what)
        src, dst_row = src + part, dst_row + share


def sharded_param(
    full_shape: tuple[int, ...],
    dim: int,
    rank: int,
    size: int,
    dtype: torch.dtype | None = None,
) -> nn.Parameter:
    """A parameter holding this rank's even share of a `full_shape` checkpoint tensor along
    `dim` (per-head vectors such as attention sinks or decay rates)."""
    shape = list(full_shape)
    if shape[dim] % size:
        raise ValueError(f"dimension {shape[dim]} does not split evenly over {size} ranks")
    shape[dim] //= size

    def loader(param, loaded, shard_id=None) -> None:
        default_weight_loader(param, shard_of(loaded, dim, rank, size, full_shape[dim]))

    if size == 1:
        return make_param(tuple(shape), dtype)
    return make_param(tuple(shape), dtype, loader)


def expect_loads(param: nn.Parameter, keys: set[tuple]) -> nn.Parameter:
    """Declare which `weight_loader` argument tuples together fill `param` (a load with no
    extra arguments always fills it whole). Default: one whole load."""
    param.expected_loads = set(keys)
    return param


class WeightLoadTracker:
    """Drives `weight_loader`s for one model and checks that every parameter got filled.

    Errors name the checkpoint tensor: a shape mismatch says expected vs got; a parameter
    left (partly) empty is reported at the end with the pieces that are missing.
    """

    def __init__(self, params: dict[str, nn.Parameter]):
        self.params = params
        self.loaded_params: set[str] = set()
        self.unexpected: list[str] = []
        self._seen: dict[str, set[tuple]] = {}

    def load(self, ckpt_name: str, param_name: str, tensor: torch.Tensor, *loader_args) -> None:
        param = self.params.get(param_name)
        if param is None:
            self.unexpected.append(ckpt_name)
            return
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, *loader_args)
        except WeightShapeError as err:
            raise ValueError(
                f"checkpoint tensor '{ckpt_name}' (-> {param_name}) has the wrong shape: "
                f"expected {err.expected}, got {err.got}"
            ) from None
        self._seen.setdefault(param_name, set()).add(tuple(loader_args))
        self.loaded_params.add(param_name)

    def missing(self) -> dict[str, list[tuple]]:
        """Parameter -> loader argument tuples never seen ([] = never loaded at all)."""
        out: dict[str, list[tuple]] = {}
        for name, param in self.params.items():
            seen = self._seen.get(name)
            if seen is None:
                out[name] = []
            elif () not in seen:
                expected = getattr(param, "expected_loads", {()})
                absent = sorted(expected - seen, key=str)
                if absent:
                    out[name] = absent
        return out

    def raise_if_incomplete(self, what: str = "model") -> None:
        missing = self.missing()
        if not missing:
            return
        lines = [
            f"  {name}"
            + (f" (missing parts: {parts[:6]}{' ...' if len(parts) > 6 else ''})" if parts else "")
            for name, parts in list(missing.items())[:20]
        ]
        more = f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise ValueError(
            f"{what}: the checkpoint is missing {len(missing)} required tensor(s):\n"
            + "\n".join(lines)
            + more
        )
