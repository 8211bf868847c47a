"""Validated 2-D views of f32 buffers, shared by the op builders.

Kernels address activations as rows: row r of a view starts at element `off + r*stride` of its
buffer. A view checks its own bounds when made, so builders only check shapes against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from vkflash.gpu.memory import Buffer

F32 = 4  # bytes per element of every view


@dataclass(frozen=True)
class Rows:
    """n_rows rows of n_cols f32 elements in `buf`; row r starts at element off + r*stride.

    stride defaults to n_cols (dense rows); stride 0 repeats one row (a broadcast operand).
    """

    buf: Buffer
    n_rows: int
    n_cols: int
    off: int = 0
    stride: int = -1

    def __post_init__(self) -> None:
        if self.stride == -1:
            object.__setattr__(self, "stride", self.n_cols)
        name = self.buf.name or "buffer"
        if self.n_rows < 1 or self.n_cols < 1:
            raise ValueError(f"view of {name!r}: needs at least one row and column, got {self.n_rows}x{self.n_cols}")
        if self.off < 0 or self.stride < 0:
            raise ValueError(f"view of {name!r}: negative offset {self.off} or stride {self.stride}")
        if 0 < self.stride < self.n_cols:
            raise ValueError(f"view of {name!r}: stride {self.stride} < row length {self.n_cols} overlaps rows")
        if self.end * F32 > self.buf.nbytes:
            raise ValueError(f"view of {name!r}: {self.n_rows}x{self.n_cols} at {self.off} stride {self.stride} "
                             f"needs {self.end * F32} B, buffer has {self.buf.nbytes} B")

    @classmethod
    def flat(cls, buf: Buffer, n: int, off: int = 0) -> "Rows":
        """n consecutive elements from `off`, as one row."""
        return cls(buf, 1, n, off)

    def cols(self, start: int, n: int) -> "Rows":
        """Columns [start, start + n) of every row."""
        if start < 0 or start + n > self.n_cols:
            raise ValueError(f"columns [{start}, {start + n}) of a row of {self.n_cols}")
        return Rows(self.buf, self.n_rows, n, self.off + start, self.stride)

    def rows(self, start: int, n: int) -> "Rows":
        """Rows [start, start + n)."""
        if start < 0 or start + n > self.n_rows:
            raise ValueError(f"rows [{start}, {start + n}) of {self.n_rows}")
        return Rows(self.buf, n, self.n_cols, self.off + start * self.stride, self.stride)

    @property
    def end(self) -> int:
        """One past the last element the view touches."""
        return self.off + (self.n_rows - 1) * self.stride + self.n_cols

    @property
    def size(self) -> int:
        return self.n_rows * self.n_cols

    def overlaps(self, other: "Rows") -> bool:
        """Whether the two views may share an element (exact for equal strides, else by span)."""
        if self.buf is not other.buf or self.end <= other.off or other.end <= self.off:
            return False
        s = self.stride
        if s == other.stride and s > 0:  # element sets are column windows modulo s
            a, b = self.off % s, other.off % s
            return (b - a) % s < self.n_cols or (a - b) % s < other.n_cols
        return True  # conservative


def check_alias(op: str, out: Rows, *inputs: Rows) -> None:
    """An output has distinct rows and may be an input's exact view (in place), never a partial overlap."""
    if out.stride == 0 and out.n_rows > 1:
        raise ValueError(f"{op}: output view has stride 0: its rows would be written by several invocations")
    for x in inputs:
        if x.overlaps(out) and (x.off, x.stride, x.n_rows, x.n_cols) != (out.off, out.stride, out.n_rows, out.n_cols):
            raise ValueError(f"{op}: output view partly overlaps an input view of {x.buf.name or 'a buffer'!r}; "
                             "in-place use needs the identical view")


def check_same_shape(op: str, **views: Rows) -> None:
    """All views have the same n_rows x n_cols."""
    shapes = {k: (v.n_rows, v.n_cols) for k, v in views.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{op}: shapes differ: " + ", ".join(f"{k} {r}x{c}" for k, (r, c) in shapes.items()))


def grid(n_items: int, per_group: int, max_groups: int) -> int:
    """Workgroups for a grid-stride loop over n_items at per_group items per group."""
    return max(1, min(max_groups, -(-n_items // per_group)))
