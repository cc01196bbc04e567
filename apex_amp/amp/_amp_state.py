"""apex's ``amp._amp_state``, for code that reads or sets it: the latest ``initialize``'s scalers and properties.

``amp._amp_state`` (and ``from apex.amp._amp_state import _amp_state`` through
the compat distribution) is this module; its attributes are read from the
latest session each time (:mod:`apex_amp.amp.apex_private`):

* ``loss_scalers``: one view per loss, with apex's ``loss_scale()``,
  ``_loss_scale`` (settable), ``_unskipped`` (settable) and ``dynamic``;
* ``opt_properties``: the chosen properties, ``.options`` as apex's dict;
* ``verbosity``: the ``verbosity`` passed to ``initialize``.

Example::

    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    >>> amp._amp_state.loss_scalers[0]._loss_scale = 2**20   # NVIDIA's BERT recipe
    >>> amp.loss_scale()
    1048576.0
"""

from __future__ import annotations

import sys
from typing import Any

from . import apex_private, sessions

__all__: list[str] = []

# apex's code imports the object `_amp_state` from the module `_amp_state`: here they are one.
_amp_state = sys.modules[__name__]


def __getattr__(name: str) -> Any:
    if name == "loss_scalers":
        return apex_private.loss_scaler_views()
    if name == "opt_properties":
        return apex_private.opt_properties()
    if name == "verbosity":
        session = sessions.latest_session()
        return 1 if session is None else session.verbosity
    raise AttributeError(
        f"amp._amp_state has no {name!r} here: apex_amp provides 'loss_scalers', 'opt_properties' and "
        "'verbosity' (apex's handle and patching state do not exist; use amp.disable_casts() to turn "
        "O1's casts off, amp.loss_scale() for the scale)"
    )
