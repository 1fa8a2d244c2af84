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


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str = "") -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(tuple(dst.shape), tuple(src.shape), what)
    dst.copy_(src)


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
