"""Every recipe test compiles quickly (see `_small.quick_compiles`)."""

from tests.recipes._small import quick_compiles  # noqa: F401 - an autouse fixture
