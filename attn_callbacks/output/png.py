"""PNG encoding of the Agg canvas' RGB(A) arrays: numpy and the standard library only (with numba's "Up" filter when
asked), so that the drawing process (:mod:`.draw_worker`) encodes without importing torch."""

from __future__ import annotations

import struct
import zlib

import numpy as np

__all__ = ["encode_png"]


def encode_png(image: np.ndarray, compress_level: int = 1, numba: bool = False) -> bytes:
    """An ``(H, W, 3)`` uint8 RGB array (or ``(H, W, 4)`` RGBA, its alpha dropped) as RGB PNG bytes; ``numba``
    filters the rows with :func:`~attn_callbacks.output.png_numba.up_filter` (the same bytes, one pass).

    Every scanline uses the PNG "Up" filter (each byte minus the byte above it): a heatmap's cells repeat row after
    row, so the filtered image is mostly zeros, and zlib level 1 then compresses it about as small as Pillow's
    encoder (which tries every filter on every row, with no option to skip that) in about half its time. Any PNG
    reader decodes it to the same pixels. Unlike Pillow, it takes 8-bit RGB(A) only: what the Agg canvas holds.
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (3, 4) or 0 in image.shape:
        raise ValueError(
            "Expected argument `image` to be a non-empty (H, W, 3) or (H, W, 4) uint8 array, "
            f"but got {image.dtype} {image.shape}"
        )
    height, width = image.shape[:2]
    rows = np.empty((height, 1 + width * 3), dtype=np.uint8)  # one filter-type byte, then the filtered row
    if numba:
        from attn_callbacks.output.png_numba import up_filter

        up_filter(image, rows)
    else:
        rgb = np.ascontiguousarray(image[..., :3]).reshape(height, width * 3)
        rows[:, 0] = 2  # Up; the first row's "above" is zeros, so it is stored as is
        rows[:1, 1:] = rgb[:1]
        np.subtract(rgb[1:], rgb[:-1], out=rows[1:, 1:])  # modulo 256, as PNG filters are

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, adaptive filters, no interlace
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            chunk(b"IHDR", header),
            chunk(b"IDAT", zlib.compress(rows.data, compress_level)),
            chunk(b"IEND", b""),
        ]
    )
