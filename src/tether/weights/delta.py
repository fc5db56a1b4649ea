"""Exact weight deltas: one version as the XOR of its bytes with another's, compressed.

After an optimizer step most weights keep their sign, exponent and leading mantissa bits,
so `new ^ ref` is mostly zero bits in the high bytes of each element. Grouping each byte
position of the elements together (a byte shuffle, as blosc does) puts those zeros in
long runs, and zstd compresses them away. Applying is the same XOR, so rebuilding is bit
exact for any dtype: nothing is rounded, nothing is assumed about the update.
The same idea ships in verl's and slime's delta weight sync (XOR + zstd).

A flat buffer (`tether.weights.publisher.pack`) is cut into buckets: contiguous byte ranges
of at most `bucket_bytes`, each holding elements of one size, so a bucket is encoded,
sent and applied on its own and the working memory of either side is one bucket.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

Layout = tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # name, dtype, shape, start, end


@dataclass(frozen=True)
class Bucket:
    start: int  # byte offsets into the flat buffer
    end: int
    itemsize: int  # the byte-shuffle's element size


@dataclass(frozen=True)
class Delta:
    """`blobs[i]`: bucket i of (new ^ ref) shuffled and zstd-compressed (ref None: of new)."""

    buckets: tuple[Bucket, ...]
    blobs: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)


def buckets(layout: Layout, bucket_bytes: int) -> tuple[Bucket, ...]:
    """Byte ranges of at most `bucket_bytes` (a tensor larger than that is split on element
    boundaries), each of one element size, covering the buffer in order."""
    out: list[Bucket] = []
    for _, dtype, _, a, b in layout:
        size = torch.empty(0, dtype=dtype).element_size()
        step = max(8, bucket_bytes // 8 * 8)  # splits on 8-byte boundaries: whole elements
        for lo in range(a, b, step):
            hi = min(b, lo + step)
            last = out[-1] if out else None
            if last and last.itemsize == size and last.end == lo and hi - last.start <= bucket_bytes:
                out[-1] = Bucket(last.start, hi, size)
            else:
                out.append(Bucket(lo, hi, size))
    return tuple(out)


def _xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a ^ b on uint8 buffers, 8 bytes at a time where the length allows."""
    aligned = a.storage_offset() % 8 == 0 and b.storage_offset() % 8 == 0
    n = a.numel() // 8 * 8 if aligned else 0
    out = torch.empty_like(a)
    if n:
        torch.bitwise_xor(a[:n].view(torch.int64), b[:n].view(torch.int64), out=out[:n].view(torch.int64))
    torch.bitwise_xor(a[n:], b[n:], out=out[n:])
    return out


def _shuffle(x: torch.Tensor, itemsize: int) -> np.ndarray:
    """Byte i of every element together (numpy: 4x faster than torch's uint8 transpose)."""
    return np.ascontiguousarray(x.numpy().reshape(-1, itemsize).T)


def _unshuffle(x: np.ndarray, itemsize: int) -> torch.Tensor:
    return torch.from_numpy(np.array(x.reshape(itemsize, -1).T, order="C").reshape(-1))  # a copy


def encode(new: torch.Tensor, ref: torch.Tensor | None, parts: tuple[Bucket, ...],
           level: int = 1, threads: int = 1) -> Delta:
    """`new` (a flat uint8 host buffer) against `ref` (same layout; None: `new` alone);
    `threads` buckets at a time (zstd, numpy and torch release the GIL)."""

    def one(p: Bucket) -> bytes:
        x = new[p.start:p.end]
        if ref is not None:
            x = _xor(x, ref[p.start:p.end])
        return zstandard.ZstdCompressor(level=level).compress(_shuffle(x, p.itemsize))

    return Delta(parts, tuple(_map(one, parts, threads)))


def apply(delta: Delta, ref: torch.Tensor | None, out: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """The buffer `delta` was encoded from, given the same `ref` (None if it had none),
    written into `out`'s buckets (`out` may be `ref` itself: each is read, then written)."""

    def one(item: tuple[Bucket, bytes]) -> None:
        p, blob = item
        raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob, max_output_size=p.end - p.start),
                            dtype=np.uint8)
        x = _unshuffle(raw, p.itemsize)
        out[p.start:p.end] = x if ref is None else _xor(x, ref[p.start:p.end])

    list(_map(one, list(zip(delta.buckets, delta.blobs)), threads))
    return out


def _map(fn, items, threads: int):
    if threads <= 1 or len(items) <= 1:
        return map(fn, items)
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))
