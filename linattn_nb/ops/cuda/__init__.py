"""The CUDA sequence kernel and the kernels around it, one module per part (design: ``docs/cuda_kernels.md``).

``owner``, ``rows``, ``tiles``: the sequence kernel's three thread layouts;
``seq``: the kernel of a configuration (:func:`linattn_nb.ops.cuda.seq.seq_kernel`);
``blocks``: the device functions the layouts share; ``plan``: limits and the
choice of a configuration; ``helpers``: the state, copy and chunk-combine
kernels; ``views``: device-array views.  The launchers reach them through
:mod:`linattn_nb.ops._cuda_launch`.  Importing the package imports nothing.
"""
