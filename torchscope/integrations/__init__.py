"""One-line hooks for training frameworks that expect a callback, not a ``serve()`` call.

Each framework has its own module, imported only by who uses it (torchscope does not depend on
any framework):

- ``torchscope.integrations.lightning``: ``TorchscopeCallback`` for ``lightning.pytorch``
  (or ``pytorch_lightning`` where only that is installed);
- ``torchscope.integrations.pytorch_lightning``: the same for the older package name, for jobs
  that have both installed and use ``pytorch_lightning``;
- ``torchscope.integrations.hf``: ``TorchscopeCallback`` for the Hugging Face ``Trainer``.

Each starts :func:`torchscope.serve` with the options given to it, and numbers the job's steps
by the framework's global step. This package itself imports nothing heavy.
"""
