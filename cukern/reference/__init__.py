"""Float64 NumPy references for every kernel family (one module per family).

They take and return NumPy arrays, compute in float64, and are what the GPU
tests and the notebooks compare against."""
