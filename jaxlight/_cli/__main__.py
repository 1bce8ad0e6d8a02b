"""`python -m jaxlight._cli ...` is the `jaxlight` command (the package's `main`: its help
imports no JAX)."""

import sys

from jaxlight._cli import main

sys.exit(main())
