"""The CUDA sequence kernel and the kernels around it, one module per part (design: ``docs/cuda_kernels.md``).

The launchers reach them through :mod:`linattn_nb.ops._cuda_launch`.  Importing the package imports nothing.
"""
