"""Stub of the compiled kernel module shardkit._kernels._mmap (csrc/_mmap.pyx)."""

class Map:
    """The first `size` bytes of file `fd`, mapped copy-on-write (MAP_PRIVATE, read + write);
    a writable byte buffer that holds no descriptor and is unmapped when its last reference
    (numpy views included) goes. OSError (with errno) when the system refuses the map;
    ValueError for a negative size. A size of 0 maps nothing and gives an empty buffer."""

    def __init__(self, fd: int, size: int) -> None: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
