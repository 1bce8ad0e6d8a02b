"""Learning-rate schedulers with torch's names and torch's counting, for Lightning's
`lr_scheduler` dict (`configure_optimizers`); optax schedules work there too.

May import only the root modules (layer 6 of docs/architecture.md).
"""

from jaxlight.schedules._plateau import ReduceLROnPlateau, ReduceLROnPlateauState

__all__ = ["ReduceLROnPlateau", "ReduceLROnPlateauState"]
