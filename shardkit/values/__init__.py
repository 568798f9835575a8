"""Value types with no I/O: keys, dtypes, devices, slices, string tensors."""
