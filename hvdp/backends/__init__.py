"""One package per framework, each a ``Backend`` of the contract in base.py, with the same module names.

As Keras keeps ``keras/src/backend/{torch,tensorflow}/`` with the same file names and ``backend/common/``
for what they share, a module's counterpart is found by its name:

- :mod:`.base`: the contract, and what both backends do alike over Horovod;
- :mod:`.direct`: what every framework's direct path shares, importing no framework;
- :mod:`.torch` and :mod:`.tensorflow`: each framework's ``Backend`` in its package's ``__init__``, its
  direct path in ``direct`` (a package on torch, one module on TensorFlow), and the rest by concern;
- :mod:`.keras`: the Keras 3 adapter both Keras backends share (``keras`` on torch is Keras on torch).

A package named ``torch`` (or ``tensorflow``, ``keras``) here does not hide the framework: imports are
absolute, so ``import torch`` inside it is PyTorch.
"""
