"""The pure core: errors, metrics as vector transforms, exclusions and filters as data, results, tiling plans, the
key packing of the selection and fast mode's certificate arithmetic. No I/O, and no branch on the kind of device:
functions that touch arrays take the array module (``xp``: NumPy or CuPy) as an argument."""
