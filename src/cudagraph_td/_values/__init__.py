"""What goes into a graph and comes out of it: optree in the library's namespace (``tree``), a
call's signature and its static input buffers (``signature``), outputs in fresh memory
(``outputs``), and the inputs a graph writes in place (``aliasing``).
"""
