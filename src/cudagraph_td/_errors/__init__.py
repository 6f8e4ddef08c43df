"""The user-facing messages, grouped by what they are about: inputs, captures and arguments
(``inputs``), ``shapes=`` (``shapes``), the state around a graph (``state``), the arguments
of ``make_graphed_callables`` (``graphed``), and the hints of a failed capture (``causes``).
"""
