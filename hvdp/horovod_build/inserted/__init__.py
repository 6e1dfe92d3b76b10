"""Larger additions hvdp's build makes to Horovod's Python modules (see hvdp.horovod_build.patches).

Each module here is inserted, as text, into one Horovod module of the patched
source; the installed Horovod never imports hvdp. They are valid Python on
their own so that they are linted and type-checked with the rest of hvdp, and
nothing in hvdp imports them.
"""
