"""apex.parallel.LARC: apex_amp's LARC (the same class), which amp.initialize accepts as apex's did."""

from apex_amp.optimizers import LARC

__all__ = ["LARC"]
