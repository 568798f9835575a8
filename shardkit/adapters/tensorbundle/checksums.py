"""TensorFlow's entry checksums, computed over a stored entry (`verify`).

``crc32c``: the masked crc32c of the entry's bytes, recorded as 8 lowercase hex digits of the
masked value, as the BundleEntryProto's ``crc32c`` field holds it. (DT_STRING entries are
checked by `strings.BundleStrings.verify`.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import UnknownCodecError
from ...format import EntryLayout
from .crc import crc32c_extend, mask

_STEP = 8 << 20


def entry_checksum(kind: str, src: Any, entry: EntryLayout) -> str:
    n = entry.nbytes
    if kind == "crc32c":
        view = src.view(entry, 0, n) if n else None
        if view is not None or n == 0:
            return f"{mask(crc32c_extend(0, view if view is not None else b'')):08x}"
        crc = 0
        buf = np.empty(min(n, _STEP), np.uint8)
        pos = 0
        while pos < n:
            k = min(len(buf), n - pos)
            src.read_into(entry, pos, pos + k, buf.data[:k])
            crc = crc32c_extend(crc, buf.data[:k])
            pos += k
        return f"{mask(crc):08x}"
    raise UnknownCodecError(f"{src.path}: checksum kind {kind!r} is not known to shardkit")
