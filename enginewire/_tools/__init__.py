"""The maintainers' tools of a source checkout (trio's ``_tools``): ``generate`` writes, or
checks fresh, every file generated from a declaration. Not part of the public surface; run as
``python -m enginewire._tools.generate``."""
