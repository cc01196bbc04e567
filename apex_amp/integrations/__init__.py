"""Adapters that plug apex_amp into training frameworks, each over the public ``apex_amp.amp`` API.

Each adapter lives in its own module and imports its framework at the top of that module, so
``import apex_amp`` never needs the framework; import the adapter itself:

* :mod:`apex_amp.integrations.lightning`: a Lightning 2.x ``Precision`` plugin
  (``pip install apex_amp[lightning]``).

Example::

    >>> from apex_amp.integrations.lightning import ApexAmpPrecision
    >>> trainer = lightning.pytorch.Trainer(plugins=[ApexAmpPrecision("O2", torch.bfloat16)])
"""

__all__: list[str] = []
