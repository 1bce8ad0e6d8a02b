"""The fit core: `Fit` (a facade) over a session, a loop state, a training loop and an evaluator.

See docs/architecture.md for how the parts fit together.

May import every folder below it (layer 20 of docs/architecture.md); only the public
`jaxlight` names, the recipes and the CLI import it.
"""

from jaxlight._fit._config import FitConfig
from jaxlight._fit._facade import Fit
from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._session import Session, abstract_global_batch
from jaxlight._fit._train_loop import MAX_IN_FLIGHT, StepOutput

__all__ = ["MAX_IN_FLIGHT", "Fit", "FitConfig", "LoopState", "Session", "StepOutput",
           "abstract_global_batch"]
