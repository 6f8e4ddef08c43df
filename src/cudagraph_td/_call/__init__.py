"""The call path and its graph table: ``CudaGraphModule`` (``module``), the one lookup of a call's
key (``table``), the replay path of readers, one metadata check and writers (``replay``), the
parts of that key (``modes``, ``static``), the TensorDict-module layer (``tdmodule``),
``verify=`` (``verify``), copies of a wrapper (``copying``) and ``make_graphed_callables``
(``graphed_callables``).
"""
