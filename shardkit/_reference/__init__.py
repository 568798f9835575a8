"""Pure-Python twins of the compiled kernels: one module per kernel module, same functions.

They are the oracle the kernel tests compare against and the baseline of the kernel benchmarks.
"""
