"""`python -m jaxlight._cli ...` is the `jaxlight` command."""

import sys

from jaxlight._cli._main import main

sys.exit(main())
