"""A flat fp32 CPU buffer with one named view per parameter.

The anchor, the outer momentum and the pseudo-gradient each live in one contiguous tensor: the
averager sends one vector, the outer step is a handful of fused ops instead of a Python loop over
parameters, and a fingerprint is a single pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Names, shapes and offsets of parameters packed into one flat vector."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> FlatLayout:
        names, shapes, offsets, total = [], [], [], 0
        for name, tensor in named_tensors:
            names.append(name)
            shapes.append(tensor.shape)
            offsets.append(total)
            total += tensor.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), total)

    def new_buffer(self, pin_memory: bool = False) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32, pin_memory=pin_memory)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into ``flat`` (no copies): writing a view writes the buffer."""
        assert flat.numel() == self.numel, (flat.numel(), self.numel)
        return {
            name: flat[offset : offset + shape.numel()].view(shape)
            for name, shape, offset in zip(self.names, self.shapes, self.offsets)
        }

    @torch.no_grad()
    def pack(self, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy named tensors (any device/dtype) into the flat buffer ``out``."""
        for name, view in self.views(out).items():
            view.copy_(tensors[name])
        return out

    def describe(self) -> list[list]:
        """A JSON-friendly description of the layout, used in the run's compatibility hash."""
        return [[name, list(shape)] for name, shape in zip(self.names, self.shapes)]
